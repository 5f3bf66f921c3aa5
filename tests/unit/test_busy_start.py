"""Issue 18, items 4 and 5 without processes: the pure judgements (a warmup queued behind
clients, hang_timeout against the longest engine step), and the store of that step in the state
directory (the joints in the Run and the supervisor: test_supervisor.py)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import Log

from qwen4090.base import atomicfile
from qwen4090.decide.policy import (
    SAFE_STEP_MULTIPLE,
    hang_timeout_risk,
    queued_behind_work,
    serving_clients,
    warmup_request_wait,
)
from qwen4090.launching import preflight, steptime
from qwen4090.settings.config import Config, from_dict

# --- the pure judgements --------------------------------------------------------------------


def test_a_timed_out_request_while_the_tokens_moved_was_queued_behind_work() -> None:
    assert queued_behind_work(True, 100.0, 180.0)
    assert not queued_behind_work(True, 100.0, 100.0)  # flat: hung, not busy
    assert not queued_behind_work(True, None, 180.0)  # cannot tell: not busy
    assert not queued_behind_work(True, 100.0, None)
    assert not queued_behind_work(False, 100.0, 180.0)  # an error answer is an error


def test_a_warmup_request_waits_hang_timeout_when_clients_are_queued() -> None:
    assert warmup_request_wait(120.0, 900.0, 60.0, clients_queued=True) == 60.0
    assert warmup_request_wait(120.0, 900.0, 60.0, clients_queued=False) == 120.0
    assert warmup_request_wait(120.0, 30.0, 60.0, clients_queued=True) == 30.0  # the deadline
    assert warmup_request_wait(10.0, 900.0, 60.0, clients_queued=True) == 10.0


def test_clients_are_served_when_requests_are_in_and_the_tokens_move() -> None:
    assert serving_clients(8.0, 24.0, 10.0, 500.0)
    assert serving_clients(0.0, 1.0, 10.0, 11.0)
    assert not serving_clients(0.0, 0.0, 10.0, 500.0)  # our own requests moved them
    assert not serving_clients(8.0, 24.0, 10.0, 10.0)
    assert not serving_clients(8.0, 24.0, None, 10.0)


def test_hang_timeout_below_a_safe_multiple_of_the_longest_step_is_a_warning() -> None:
    assert SAFE_STEP_MULTIPLE == 3.0
    risk = hang_timeout_risk(4.0, 1.5)
    assert risk is not None
    assert risk.startswith("watch.hang_timeout = 4 is below 3 x the longest engine step "
                           "measured by the warmup (1.50s")
    assert "raise hang_timeout to at least 4.5" in risk
    assert hang_timeout_risk(4.5, 1.5) is None
    assert hang_timeout_risk(60.0, 1.5) is None
    assert hang_timeout_risk(0.2, None) is None  # nothing measured: nothing to say
    assert hang_timeout_risk(0.2, 0.0) is None


# --- the store --------------------------------------------------------------------------------


def cfg(tmp_path: Path, **watch: Any) -> Config:
    return from_dict({"vllm": {"model": "/m", "max_num_batched_tokens": 4096},
                      "watch": {"poll_interval": 0.5, "health_timeout": 0.5, **watch},
                      "gpu": {"state_directory": str(tmp_path / "state")}})


def test_the_longest_step_is_kept_for_the_same_settings_only(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    store = steptime.StepStore.of(c, Log())
    assert store.measured(c) is None
    assert store.record(c, 1.23456, 4096)
    data = json.loads((tmp_path / "state" / steptime.FILE_NAME).read_text())
    assert data["seconds"] == 1.2346 and data["prompt_tokens"] == 4096
    assert steptime.StepStore.of(c).measured(c) == 1.2346
    other = from_dict({"vllm": {"model": "/m", "max_num_batched_tokens": 2048},
                       "gpu": {"state_directory": str(tmp_path / "state")}})
    assert store.measured(other) is None  # measured for another step size
    (tmp_path / "state" / steptime.FILE_NAME).write_text("{torn")
    assert store.measured(c) is None


def test_a_full_disk_keeps_the_step_here_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = cfg(tmp_path)
    log = Log()
    store = steptime.StepStore.of(c, log)
    assert store.record(c, 1.0, 4096)

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomicfile, "write_text", full)
    assert not store.record(c, 2.0, 4096)
    assert not store.record(c, 3.0, 4096)
    said = log.named("state_not_saved")
    assert len(said) == 1 and said[0]["cause"] == "disk full (ENOSPC)", said
    assert said[0]["path"] == str(tmp_path / "state" / steptime.FILE_NAME)
    assert store.measured(c) == 3.0  # kept in this process
    assert json.loads(store.path.read_text())["seconds"] == 1.0  # the old file, whole
    monkeypatch.undo()
    assert store.record(c, 4.0, 4096)
    assert log.named("state_saved") and store.measured(c) == 4.0


def test_check_config_warns_against_the_step_on_disk(tmp_path: Path) -> None:
    c = cfg(tmp_path, hang_timeout=2.0)
    res = preflight.PreflightResult()
    preflight.check_hang_timeout(c, res)
    assert res.warnings == []  # nothing measured yet
    steptime.StepStore.of(c).record(c, 1.0, 4096)
    preflight.check_hang_timeout(c, res)
    assert len(res.warnings) == 1 and "watch.hang_timeout = 2 is below 3 x" in res.warnings[0]
    res = preflight.PreflightResult()
    preflight.check_hang_timeout(cfg(tmp_path, hang_timeout=3.0), res)
    assert res.warnings == []
