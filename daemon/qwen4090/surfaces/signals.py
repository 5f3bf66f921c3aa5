"""Signals, gunicorn-style: a handler only queues the signal and wakes the loop.

The wake-up is a pipe: signal handlers, probe threads and reader threads write a byte, and the
main loop waits on it with a timeout.  No logging and no work inside a handler.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOPS = (signal.SIGTERM, signal.SIGINT)  # a stop; SIGHUP is a reload
# Only wake the loop: vLLM's API server (our child) or an orphan of its group (re-parented to
# us, the subreaper) has ended, so reap and the group's wait look now instead of at the next
# tick (a killed API server was seen up to 0.5 s late).  Never queued as a command.
WAKE_ONLY = (signal.SIGCHLD,)


class Wakeup:
    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.w, b".")

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(InterruptedError):
            select.select([self.r], [], [], max(0.0, timeout))
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.r, 512):
                pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


def install(deliver: Callable[[int], None], wakeup: Wakeup) -> None:
    def handler(signum: int, _frame: FrameType | None) -> None:
        deliver(signum)
        wakeup.wake()

    def wake_only(_signum: int, _frame: FrameType | None) -> None:
        wakeup.wake()

    for sig in HANDLED:
        signal.signal(sig, handler)
    for sig in WAKE_ONLY:
        signal.signal(sig, wake_only)


def restore() -> None:
    for sig in (*HANDLED, *WAKE_ONLY):
        signal.signal(sig, signal.SIG_DFL)
