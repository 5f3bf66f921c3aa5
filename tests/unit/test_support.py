"""The shared test runner (tests/support/daemon.py) on a few lines of Python instead of vLLM:
waits end at their line, at a fail line, or as soon as the process is gone with its output read;
and the one CPU config renders as TOML that the daemon's own loader accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.support.daemon import Proc
from tests.support.runtime import cpu_config, render_toml, write_toml

from qwen4090.settings.config import load


def py(code: str, log: Path | None = None) -> Proc:
    return Proc([sys.executable, "-c", code], log).start()


def test_wait_line_returns_the_line_and_its_time_and_logs_it(tmp_path: Path) -> None:
    p = py("import sys; print('one'); sys.stderr.write('two\\n')", tmp_path / "p.log")
    t, line = p.wait_line(r"^two$", 30)
    assert line == "two" and 0 <= t <= p.elapsed()
    assert p.find(r"^one$") is not None and p.find(r"^one$", after=t) is None
    assert p.proc.wait(30) == 0
    p.kill()  # the group is gone already; this closes the output and the log
    assert [ln.split(None, 1)[1] for ln in (tmp_path / "p.log").read_text().splitlines()] == [
        "one", "two"]


def test_a_fail_line_ends_the_wait_at_once() -> None:
    p = py("import time; print('giving_up', flush=True); time.sleep(60)")
    try:
        with pytest.raises(AssertionError, match="'giving_up' seen while waiting for 'ready'"):
            p.wait_line("ready", 30, fail="giving_up")
    finally:
        p.kill()


def test_a_wait_ends_when_the_process_is_gone_not_at_its_deadline() -> None:
    p = py("print('bye')")
    # "the process ended", not "timed out after 300s": it did not sit out the deadline
    with pytest.raises(AssertionError, match="the process ended waiting for 'never'"):
        p.wait_line("never", 300)
    p.kill()


def test_the_cpu_config_is_one_the_daemon_loads(tmp_path: Path) -> None:
    cfg = load(write_toml(tmp_path / "q.toml", cpu_config(8123, watch={"hang_timeout": 7.0})))
    assert (cfg.vllm.port, cfg.vllm.dtype, cfg.vllm.enforce_eager) == (8123, "float32", True)
    assert cfg.vllm.extra_args[-2:] == ["--load-format", "dummy"]
    assert cfg.watch.hang_timeout == 7.0 and cfg.status.enabled is False
    assert "   # why" in render_toml({"vllm": {"dtype": "x"}}, {"dtype": "why"})
