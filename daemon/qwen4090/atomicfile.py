"""Write a small file so that a reader sees the old content or the new, never half of either.

The child record (instance.py), the learned limits (learned.py) and the KV budget
(kvbudget.py) are read back after a crash, a SIGKILL or a power cut: a temporary file in the
same directory, flushed to disk, then renamed over the old one (rename is atomic within one
file system; fsync first, or a power cut can leave the new name with no data behind it).

Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically; the directory must exist.

    Raises OSError as the underlying calls do; no temporary file is left behind.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
