"""Signals while the daemon is still starting (issue 18.2), on the real supervisor process: the
handlers are installed first thing, so a SIGHUP during the GPU driver wait is queued and handled
(`reloaded` at the supervisor's first step) instead of ending the process with "Hangup" (exit
129, seen before the change), and a SIGTERM ends the wait at once and the daemon cleanly.

The driver wait is real: with `gpu.enabled = "required"` on a machine without an NVIDIA driver,
the daemon waits up to `gpu.driver_wait` for one (`gpu_driver_wait` in the journal).  No vLLM is
started: the preflight that follows the wait finds no GPU.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.support.daemon import Daemon
from tests.support.runtime import cpu_config, free_port, write_toml


def waiting_for_the_driver(tmp_path: Path, driver_wait: float) -> Daemon:
    port = free_port()
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        port, gpu={"enabled": "required", "driver_wait": driver_wait,
                   "state_directory": str(tmp_path / "state")}))
    d = Daemon(cfg, tmp_path, port=port)
    d.wait_event("gpu_driver_wait", 30)  # inside the blocking wait now
    return d


def test_a_sighup_during_the_driver_wait_is_queued_not_fatal(tmp_path: Path) -> None:
    d = waiting_for_the_driver(tmp_path, driver_wait=6.0)
    try:
        mark = d.mark()
        d.signal(signal.SIGHUP)
        time.sleep(1.0)  # a measurement window: the default action would end it at once
        assert d.proc.poll() is None, f"the daemon died of a SIGHUP at start: {d.where()}"
        # handled by the supervisor once the wait is over
        d.wait_event("reloaded", 60, after=mark)
        assert d.event("gpu_driver_not_ready", after=mark) is not None  # the wait ran out
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    finally:
        d.close()


def test_a_sigterm_during_the_driver_wait_ends_it_at_once(tmp_path: Path) -> None:
    d = waiting_for_the_driver(tmp_path, driver_wait=600.0)
    try:
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait_exit(30) == 0
        # not the 600 s wait: the queued stop ends it within its next second
        assert time.monotonic() - t0 < 15, d.where()
        assert d.event("state_changed", to="stopped") is not None
    finally:
        d.close()
