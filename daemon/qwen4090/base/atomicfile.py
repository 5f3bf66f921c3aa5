"""Write a small file so that a reader sees the old content or the new, never half of either;
and say in words why a write failed, once per file.

The child record (instance.py), the learned limits (learned.py) and the KV budget
(kvbudget.py) are read back after a crash, a SIGKILL or a power cut: a temporary file in the
same directory, flushed to disk, then renamed over the old one (rename is atomic within one
file system; fsync first, or a power cut can leave the new name with no data behind it).

None of these files is needed to serve (issue 18.1: a full /var/lib/qwen4090 crashed the start
with a traceback).  A write that fails is said once per file (:class:`Failures`), in words a
sysadmin greps for (:func:`cause`: "disk full", "read-only file system", "permission
denied"), and what it would have kept degrades for the life of the process.

Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

# What a sysadmin reads in the journal; the errno's name follows, for a search.
CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
# The errors that are the disk's state or its permissions, not a bug of ours: a writer that
# meets one degrades (the others are OSErrors too and are said the same way).
DISK_ERRNOS = frozenset(CAUSES)


def cause(e: OSError) -> str:
    """``disk full (ENOSPC)``, ``read-only file system (EROFS)``, ``permission denied
    (EACCES)``; else the error's own text (``Not a directory``)."""
    words = CAUSES.get(e.errno or 0)
    if words:
        return f"{words} ({errno.errorcode[e.errno or 0]})"
    return e.strerror or str(e) or type(e).__name__


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically; the directory must exist.

    Raises OSError as the underlying calls do (ENOSPC from the write, the flush or the fsync;
    EROFS or EACCES from creating the temporary file or the rename); the old content stays and
    no temporary file is left behind.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:  # closes fd even when a flush fails
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Failures:
    """Which files could not be written, so each is said once, not at every write.

    ``failed(path)`` is True the first time a write to ``path`` fails (say it then);
    ``saved(path)`` is True the first time one succeeds after that (say it is kept again).
    Thread-safe: the KV budget is written from a startup hook, the record from the loop.
    """

    def __init__(self) -> None:
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, path: Path) -> bool:
        with self._lock:
            new = str(path) not in self._failed
            self._failed.add(str(path))
            return new

    def saved(self, path: Path) -> bool:
        with self._lock:
            if str(path) in self._failed:
                self._failed.discard(str(path))
                return True
            return False


# One per process: the writers build their store objects afresh at each use (gpu.py), so the
# memory of what was said cannot live on them.
FAILURES = Failures()


# What a JsonState could not write (or remove) stays here for the life of this process, keyed
# by path (the stores are built at each use): {} for a file whose removal failed.
_unsaved: dict[Path, dict[str, Any]] = {}
_unsaved_lock = threading.Lock()


class JsonState:
    """A small JSON file in the state directory that degrades visibly: what cannot be written
    is kept in this process (read() returns it) and said once (``state_not_saved`` with the
    path and the cause in words), and ``state_saved`` when a write works again.  Used by the
    KV budget (kvbudget.py) and the longest engine step (steptime.py)."""

    def __init__(self, path: Path, log: Any) -> None:
        self.path = path
        self.log = log

    def read(self) -> dict[str, Any]:
        with _unsaved_lock:
            if self.path in _unsaved:
                return dict(_unsaved[self.path])
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # missing, unreadable or torn
        return data if isinstance(data, dict) else {}

    def write(self, data: dict[str, Any], what: str, then: str) -> bool:
        """Write ``data`` atomically; True when it is on disk (else kept here, see above)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        except OSError as e:
            self.unsaved(data, e, what, then)
            return False
        self.saved(what)
        return True

    def unsaved(self, data: dict[str, Any], e: OSError, what: str, then: str) -> None:
        with _unsaved_lock:
            _unsaved[self.path] = data
        if FAILURES.failed(self.path):
            self.log.warning("state_not_saved", path=str(self.path), what=what, cause=cause(e),
                             hint=f"free space in {self.path.parent} or make it writable for "
                                  f"the service user; until then {then}")

    def saved(self, what: str) -> None:
        with _unsaved_lock:
            _unsaved.pop(self.path, None)
        if FAILURES.saved(self.path):
            self.log.info("state_saved", path=str(self.path), what=what)
