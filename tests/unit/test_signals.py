"""signals.py: a handled signal is queued and wakes the loop; a child's end only wakes it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from qwen4090.surfaces import signals


def readable(w: signals.Wakeup, limit: float = 5.0) -> bool:
    return bool(select.select([w.r], [], [], limit)[0])


def test_a_childs_end_wakes_the_loop_without_a_command() -> None:
    w = signals.Wakeup()
    got: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (*signals.HANDLED, *signals.WAKE_ONLY)}
    signals.install(got.append, w)
    try:
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait(timeout=30)
        assert readable(w)  # SIGCHLD wrote to the pipe: reap runs now, not at the next tick
        w.wait(0)
        assert got == []  # not a command for the supervisor
        os.kill(os.getpid(), signal.SIGHUP)
        assert readable(w) and got == [signal.SIGHUP]
    finally:
        signals.restore()
        w.close()
        restored = signal.getsignal(signal.SIGCHLD)
        for sig, handler in saved.items():  # pytest's own (its SIGINT handler among them)
            signal.signal(sig, handler)
    assert restored == signal.SIG_DFL
