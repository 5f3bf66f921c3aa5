"""Xid classification, and NVML's absence never crashing anything."""

from __future__ import annotations

import pytest
from tests.support.fakes import Log

from qwen4090.launching import xid
from qwen4090.probes import nvml


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68, 109])
def test_application_xids_do_not_stop_the_service(code: int) -> None:
    assert not xid.classify(code).action.fatal


@pytest.mark.parametrize("code", [48, 63, 64, 74, 79, 92, 95, 119, 120])
def test_reset_or_reboot_xids_are_fatal(code: int) -> None:
    info = xid.classify(code)
    assert info.action.fatal
    assert ("reset" in info.describe()) or ("reboot" in info.describe())


def test_unknown_xid_is_logged_not_fatal() -> None:
    assert xid.classify(9999).action is xid.Action.RESTART_APP
    assert xid.classify(79).action is xid.Action.REBOOT


def test_without_pynvml_everything_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", None)
    monkeypatch.setattr(nvml, "_initialized", False)
    for result in (nvml.init(), nvml.memory(), nvml.processes(), nvml.sample(),
                   nvml.driver_ready()):
        assert isinstance(result, str) and "pynvml" in result
    t = [0.0]
    why = nvml.wait_for_driver(2.0, clock=lambda: t[0],
                               sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert why is not None and t[0] == pytest.approx(2.0)


def sample(used_gib: float, temp: int = 40, throttle: tuple[str, ...] = (),
           ecc_u: int = 0) -> nvml.Sample:
    return nvml.Sample(int(used_gib * nvml.GIB), 140 * nvml.GIB, temp, 120.0, 700.0, 0, 0,
                       throttle, 0, ecc_u)


def test_watch_logs_changes_not_every_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    seq = iter([sample(0.6), sample(0.6), sample(25.1), sample(25.3),
                sample(25.3, temp=90), sample(25.3, temp=90, throttle=("hw_thermal",)),
                sample(25.3, temp=90, throttle=("hw_thermal",), ecc_u=1)])
    monkeypatch.setattr(nvml, "sample", lambda index=0: next(seq))
    log = Log()
    w = nvml.GpuWatch(0, 30.0, 85, log, on_xid=lambda code: None)
    for _ in range(7):
        w.sample_once()
    whys = [(lvl, kw["why"]) for lvl, e, kw in log.events if e == "gpu_sample"]
    assert whys == [("info", "first"), ("info", "memory"), ("warning", "temperature"),
                    ("warning", "throttle"), ("warning", "ecc")]
