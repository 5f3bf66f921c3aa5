"""Page-cache read-ahead of the model's weight files at each launch (``restart.readahead``).

Why: vLLM spends its first 20-55 s importing Python in two interpreters (API server, then the
EngineCore) before it opens a single weight file; reading the files into the page cache during
that time makes "weights loaded" a memory copy instead of a disk read after a reboot or after
the cache was evicted.  ``posix_fadvise(WILLNEED)`` asks the kernel to read each file in the
background; it costs no memory that the kernel cannot take back.  Skipped when the files exceed
half of the available memory (they would only push each other out), when the model is not a
local directory, or when there are no weight files (``--load-format dummy``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MAX_SHARE = 0.5  # of the available memory


def weight_files(model: str) -> list[tuple[Path, int]]:
    d = Path(model).expanduser()
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.rglob("*")):
        if p.suffix in WEIGHT_SUFFIXES and p.is_file():
            out.append((p, p.stat().st_size))
    return out


def decide(files: list[tuple[Path, int]], available: int) -> str | None:
    """None = read them ahead; else why not (pure)."""
    total = sum(size for _, size in files)
    if not files or total == 0:
        return "no weight files"
    if total > MAX_SHARE * available:
        return f"{total / 1024 ** 3:.1f} GiB of weights > {MAX_SHARE:g} x " \
               f"{available / 1024 ** 3:.1f} GiB available"
    return None


def _available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def advise(files: list[tuple[Path, int]]) -> int:
    """WILLNEED every file; returns how many were advised."""
    n = 0
    for path, _size in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def start(model: str, log: Any, available: Callable[[], int] = _available
          ) -> threading.Thread | None:
    """Start the read-ahead on a daemon thread (never blocks the launch)."""
    files = weight_files(model)
    why = decide(files, available())
    if why is not None:
        log.debug("readahead_skipped", reason=why)
        return None

    def work() -> None:
        t0 = time.monotonic()
        n = advise(files)
        log.info("readahead_done", files=n, gib=round(sum(s for _, s in files) / 1024 ** 3, 2),
                 seconds=round(time.monotonic() - t0, 2))

    t = threading.Thread(target=work, name="qwen4090-readahead", daemon=True)
    t.start()
    return t
