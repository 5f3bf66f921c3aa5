"""SIGHUP: READY=1 exactly once per start and the reload protocol only once ready (issue 8.1);
what a reload changes live (issue 9.5).  Fake clock and fake parts, as in test_supervisor."""

from __future__ import annotations

import dataclasses
import signal
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import structlog
from test_gpu_joints import CUDA_OOM, FINAL, debian_python, fake_venv, free_port  # noqa: F401
from test_gpu_parts import GpuHolding, GpuLadder
from test_supervisor import Harness
from tests.support.fakes import CheckedGpu

from qwen4090.base import logs
from qwen4090.base.states import State
from qwen4090.commandline import cli
from qwen4090.decide.policy import Cause
from qwen4090.launching import gpu
from qwen4090.launching.launch import configured
from qwen4090.parts.contracts import NoFront
from qwen4090.settings.config import ConfigError, from_dict
from qwen4090.surfaces import httpapi

BASE = {"restart": {"backoff_initial": 1.0, "backoff_max": 4.0, "jitter": 0.0,
                    "budget_failures": 3, "budget_window": 600.0},
        "watch": {"poll_interval": 1.0, "hang_timeout": 10.0, "canary_interval": 5.0,
                  "canary_timeout": 2.0, "load_timeout": 100.0, "unhealthy_timeout": 3.0},
        "stop": {"drain_timeout": 5.0, "term_timeout": 3.0}}


def cfg_with(**sections: dict[str, Any]) -> Any:
    raw = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return from_dict(raw)


def protocol(h: Harness) -> list[str]:
    return [m for m in h.notifier.sent if m in ("READY=1", "RELOADING=1")]


def hup(h: Harness, to: Any) -> None:
    h.reload_to = to
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)


# --- 8.1: before the first READY=1 ----------------------------------------------------------


def test_sighup_while_loading_is_no_reload_and_ready_comes_once_after_warmup() -> None:
    h = Harness()
    h.run_until(State.LOADING)
    child = h.child
    hup(h, cfg_with(watch={"hang_timeout": 7.0}))
    assert protocol(h) == []  # still activating: no RELOADING=1, no READY=1
    assert h.sup.cfg.watch.hang_timeout == 7.0 and h.sup.state == State.LOADING
    assert h.child is child and "reloaded" in h.log.names()
    h.run_until(State.READY)
    assert protocol(h) == ["READY=1"]
    names = h.log.names()
    assert names.index("warmup_finished") < names.index("ready_notified")


class Held:
    """Runs tasks at once, except while ``hold`` is set: then they wait for ``release()``."""

    def __init__(self) -> None:
        self.hold = False
        self.waiting: list[tuple[Any, Future[Any]]] = []

    def submit(self, fn: Any, /, *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        if self.hold:
            self.waiting.append((lambda: fn(*args), f))
        else:
            f.set_result(fn(*args))
        return f

    def release(self) -> None:
        self.hold = False
        for fn, f in self.waiting:
            f.set_result(fn())
        self.waiting.clear()


def test_sighup_while_warming_does_not_end_the_start_early() -> None:
    h = Harness()
    ex = Held()
    h.sup.p.executor = ex
    h.run_until(State.LOADING)
    h.step(0.1)  # /health answers
    ex.hold = True
    h.step(0.1)  # -> WARMING, the warmup is running
    assert h.sup.state == State.WARMING
    hup(h, cfg_with(watch={"canary_interval": 9.0}))
    assert protocol(h) == [] and h.sup.state == State.WARMING
    ex.release()
    h.run_until(State.READY)
    assert protocol(h) == ["READY=1"] and h.sup.cfg.watch.canary_interval == 9.0


def test_refused_reload_while_loading_logs_and_sends_nothing() -> None:
    h = Harness()
    h.run_until(State.LOADING)
    hup(h, ConfigError("/etc/q.toml", "vllm.port", "found 0, expected an integer from 1"))
    assert protocol(h) == [] and "reload_refused" in h.log.names()
    h.run_until(State.READY)
    assert protocol(h) == ["READY=1"]


def test_vllm_change_while_loading_restarts_and_ready_once_for_the_new_one() -> None:
    h = Harness()
    h.run_until(State.LOADING)
    first = h.child
    hup(h, cfg_with(vllm={"max_num_seqs": 4}))
    assert h.sup.state == State.RESTARTING and h.sup.restarts.failure is not None
    assert h.sup.restarts.failure.cause is Cause.RELOAD and protocol(h) == []
    h.run_until(State.READY)
    assert h.child is not first and h.sup.launch.config.vllm.max_num_seqs == 4
    assert protocol(h) == ["READY=1"]


# --- 8.1: after the first READY=1 -----------------------------------------------------------


def test_reload_when_ready_is_reloading_then_ready() -> None:
    h = Harness()
    h.run_until(State.READY)
    hup(h, cfg_with(watch={"hang_timeout": 7.0}))
    assert protocol(h) == ["READY=1", "RELOADING=1", "READY=1"]
    hup(h, ConfigError("/etc/q.toml", "vllm.port", "found 0"))  # refused: still ends the reload
    assert protocol(h)[-2:] == ["RELOADING=1", "READY=1"]
    assert h.notifier.sent[-1].startswith("STATUS=ready") and "reload refused" in \
        h.notifier.sent[-1]


def test_reload_that_restarts_vllm_ends_with_ready_and_no_second_start_ready() -> None:
    h = Harness()
    h.run_until(State.READY)
    hup(h, cfg_with(vllm={"max_num_seqs": 4}))
    assert h.sup.state == State.RESTARTING  # the restart is under way, the reload is done
    assert protocol(h) == ["READY=1", "RELOADING=1", "READY=1"]
    h.run_until(State.READY)
    assert protocol(h) == ["READY=1", "RELOADING=1", "READY=1"]  # none for the new warmup


class Runtime(CheckedGpu):
    """Launches that say which vLLM the venv held, and where (launch.read_facts does, for
    real)."""

    def __init__(self, version: list[str], where: list[str] | None = None) -> None:
        super().__init__()
        self.version = version
        self.where = where or [""]

    def launch(self, cfg: Any, beside: Any = None, host: Any = None) -> Any:
        return dataclasses.replace(super().launch(cfg, beside), runtime=self.version[0],
                                   runtime_dir=self.where[0])


def test_a_reload_after_a_runtime_upgrade_restarts_vllm_on_it() -> None:
    # qwen4090 install-runtime switched the venv: the config is the same, vLLM is not (20.6)
    h = Harness()
    version = ["vllm 0.26.0"]
    h.sup.p.gpu = Runtime(version)
    h.run_until(State.READY)
    hup(h, cfg_with())
    assert h.sup.state == State.READY  # nothing changed
    version[0] = "vllm 0.27.0"
    hup(h, cfg_with())
    assert h.sup.state == State.RESTARTING and h.failure.cause is Cause.RELOAD
    assert "vllm 0.26.0 -> vllm 0.27.0" in h.failure.detail
    h.run_until(State.READY)
    assert h.sup.launch.runtime == "vllm 0.27.0"
    assert h.sup.restarts.crashes.budget.count(h.clock.t) == 0  # not a failure


def test_a_reload_after_a_reinstall_of_the_same_version_restarts_vllm_on_it() -> None:
    # issue 31.7: `install-runtime --force` builds the same version in a new directory and
    # points /opt/qwen4090/venv at it; the reload said changed=nothing and kept the old one
    h = Harness()
    version, where = ["vllm 0.32.0"], ["/opt/qwen4090/venvs/vllm-0.32.0-20261206T101010Z"]
    h.sup.p.gpu = Runtime(version, where)
    h.run_until(State.READY)
    hup(h, cfg_with())
    assert h.sup.state == State.READY  # nothing changed
    where[0] = "/opt/qwen4090/venvs/vllm-0.32.0-20261206T111111Z"
    hup(h, cfg_with())
    assert h.sup.state == State.RESTARTING and h.failure.cause is Cause.RELOAD
    assert h.failure.detail == ("vLLM runtime changed: vllm 0.32.0 now in "
                                "/opt/qwen4090/venvs/vllm-0.32.0-20261206T111111Z (was "
                                "/opt/qwen4090/venvs/vllm-0.32.0-20261206T101010Z)")
    h.run_until(State.READY)
    assert h.sup.launch.runtime_dir == where[0]


def test_the_runtimes_directory_is_the_venvs_real_one(tmp_path: Any) -> None:
    from qwen4090.launching import runtime
    real = tmp_path / "venvs" / "vllm-0.32.0-1"
    (real / "bin").mkdir(parents=True)
    (real / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "venv").symlink_to("venvs/vllm-0.32.0-1")
    assert runtime.runtime_dir([str(tmp_path / "venv" / "bin" / "python"), "-m", "x"]) == \
        str(real)
    assert runtime.runtime_dir(["/usr/bin/vllm"]) == ""


class Capped(CheckedGpu):
    """Launches capped at max_num_seqs 4, as a learned OOM limit caps them (learned.py)."""

    def launch(self, cfg: Any, beside: Any = None, host: Any = None) -> Any:
        v = dataclasses.replace(cfg.vllm, max_num_seqs=min(cfg.vllm.max_num_seqs, 4))
        return configured(dataclasses.replace(cfg, vllm=v), beside)


def test_a_reload_restarts_vllm_iff_its_next_launch_differs() -> None:
    """Issue 29.5: one rule, the launch's argv and environment compared on the same facts; not
    "[vllm] changed" (a change that the learned cap hides launches the same vLLM)."""
    h = Harness()
    h.sup.p.gpu = Capped()
    h.run_until(State.READY)
    hup(h, cfg_with(vllm={"max_num_seqs": 6}))  # capped at 4 either way
    assert h.sup.state == State.READY and h.sup.cfg.vllm.max_num_seqs == 6
    assert not h.log.named("restart_for_reload")
    hup(h, cfg_with(vllm={"max_num_seqs": 2}))
    assert h.sup.state == State.RESTARTING and h.failure.cause is Cause.RELOAD
    assert h.failure.detail == "vLLM's launch changed: --max-num-seqs 4 -> 2"
    h.run_until(State.READY)
    hup(h, cfg_with(vllm={"max_num_seqs": 2, "env": {"OMP_NUM_THREADS": "1"}}))
    assert h.sup.state == State.RESTARTING and h.failure.detail.endswith(": vllm.env")


def test_the_sleep_flag_is_a_launch_change_like_any_other() -> None:
    """restart.standby = "sleep" renders --enable-sleep-mode: no rule of its own."""
    h = Harness({"front": {"enabled": True}})
    h.run_until(State.READY)
    hup(h, cfg_with(restart={"standby": "sleep"}, front={"enabled": True}))
    assert h.sup.state == State.RESTARTING
    assert "--enable-sleep-mode (none) -> on" in h.failure.detail


def test_a_reload_that_moves_the_client_port_is_refused_behind_the_front() -> None:
    h = Harness()
    h.run_until(State.READY)
    child = h.child
    hup(h, cfg_with(vllm={"port": 9001}))
    refused = h.log.named("reload_refused")
    assert refused and "vllm.port" in refused[-1]["error"] and "restart" in refused[-1]["error"]
    assert h.sup.cfg.vllm.port == 8000 and h.child is child and h.sup.state == State.READY


# --- 9.5: applied live ---------------------------------------------------------------------


def test_release_timeout_from_a_reload_applies_to_the_next_relaunch() -> None:
    h = Harness()
    h.sup.p.gpu = GpuHolding(lambda pids: "pid 1 (old) 20.0 GiB")  # never released
    h.run_until(State.READY)
    hup(h, cfg_with(gpu={"release_timeout": 2.0}))
    h.child.exit(0)
    t0 = h.clock.t
    assert h.step(0.1) == State.RESTARTING
    h.run_until(State.STARTING)
    assert h.clock.t - t0 < 5.0  # 2 s (+ backoff 1 s), not the 30 s it started with
    assert "gpu_not_released" in h.log.names()


def test_ladder_switched_off_by_a_reload_applies_to_the_next_oom() -> None:
    h = Harness()
    calls: list[Any] = []
    def adjust(c: Any, v: Any, t: Any) -> list[str]:
        calls.append(c)
        return ["x 2 -> 1"]

    h.sup.p.gpu = GpuLadder(adjust)
    h.run_until(State.READY)
    hup(h, cfg_with(gpu={"ladder_min_util": 0.7}))
    h.child.exit(1, [CUDA_OOM, FINAL])
    assert h.step(0.1) == State.RESTARTING
    h.run_until(State.READY)
    assert calls and calls[0].gpu.ladder_min_util == 0.7  # the floors in effect now
    hup(h, cfg_with(gpu={"oom_ladder": False}))
    h.child.exit(1, [CUDA_OOM, FINAL])
    assert h.step(0.1) == State.RESTARTING
    h.run_until(State.READY)
    assert len(calls) == 1 and "oom_not_stepped_down" in h.log.names()


def unserved(h: Harness) -> httpapi.StatusApi:
    """A status endpoint that is not listening (the reloads of these tests leave [status])."""
    return httpapi.StatusApi(lambda: {}, clock=h.clock, log=h.log)


def test_reload_fanout_reconfigures_logging(capsys: pytest.CaptureFixture[str]) -> None:
    h = Harness(raw={"log": {"level": "info", "format": "keyvalue"}})
    logs.setup("keyvalue", "info")
    try:
        log = logs.get_logger(source="vllm")  # made before the reload, like cli's loggers
        h.sup.p.listeners.append(cli.reload_fanout(h.sup, gpu.GpuParts(h.log, env={}),
                                                   unserved(h), lambda d: None))
        h.run_until(State.READY)
        log.debug("before_reload")
        hup(h, cfg_with(log={"level": "debug", "format": "json"}))
        log.debug("after_reload")
        err = capsys.readouterr().err
        assert "before_reload" not in err
        assert '<7>{"source":"vllm","event":"after_reload"' in err
        ev = [kw for _, e, kw in h.log.events if e == "logging_reconfigured"]
        assert ev == [{"format": "json", "log_level": "debug"}]
    finally:
        structlog.reset_defaults()


@pytest.mark.usefixtures("debian_python")
def test_reload_fanout_restarts_the_gpu_watch(tmp_path: Path) -> None:
    py = fake_venv(tmp_path / "venv")
    h = Harness(raw={"vllm": {"command": [str(py)]}, "gpu": {"sample_interval": 3600.0}})
    parts = gpu.GpuParts(h.log, env={})
    parts.start_watch(h.sup.cfg, h.sup.inbox.gpu_fault, h.sup.inbox.gpu_sample)
    h.sup.p.listeners.append(cli.reload_fanout(h.sup, parts, unserved(h), h.sup.inbox.gpu_fault))
    try:
        first = parts.watch
        assert first is not None and first.interval == 3600.0
        h.run_until(State.READY)
        hup(h, cfg_with(vllm={"command": [str(py)]},
                        gpu={"sample_interval": 1800.0, "temperature_warn": 60}))
        assert parts.watch is not None and parts.watch is not first
        assert (parts.watch.interval, parts.watch.temperature_warn) == (1800.0, 60)
        assert first._stop.is_set()  # the old watch's threads end
        hup(h, cfg_with(vllm={"command": [str(py)]}, gpu={"enabled": "off"}))
        assert parts.watch is None
    finally:
        parts.stop_watch()


def _status_answers(port: int) -> bool:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/livez")
        return c.getresponse().status == 200
    except ConnectionRefusedError:
        return False
    finally:
        c.close()


def test_reload_fanout_moves_the_status_endpoint() -> None:
    """[status] changed: the endpoint cmd_run started moves to the new address; a reload of
    another section leaves it alone."""
    first, second = free_port(), free_port()
    h = Harness(raw={"status": {"enabled": True, "host": "127.0.0.1", "port": first}})
    api = cli.start_status(h.sup, h.log)
    h.sup.p.listeners.append(cli.reload_fanout(h.sup, gpu.GpuParts(h.log, env={}), api,
                                               lambda d: None))
    try:
        assert api.address == ("127.0.0.1", first) and _status_answers(first)
        h.run_until(State.READY)
        status = {"enabled": True, "host": "127.0.0.1", "port": first}
        server = api.server
        hup(h, cfg_with(status=status, watch={"hang_timeout": 7.0}))
        assert api.server is server  # [watch] only: the endpoint stays as it is
        hup(h, cfg_with(status={**status, "port": second}))
        assert api.address == ("127.0.0.1", second) and _status_answers(second)
        assert not _status_answers(first)
        assert [kw["url"] for _, e, kw in h.log.events if e == "status_endpoint"] == [
            f"http://127.0.0.1:{first}/", f"http://127.0.0.1:{second}/"]
        hup(h, cfg_with(status={**status, "enabled": False}))
        assert api.server is None and not _status_answers(second)
        assert "status_endpoint_off" in h.log.names()
    finally:
        api.stop()


class RecordingFront(NoFront):
    """A FrontLike that records what the root asks of it at a reload."""

    def __init__(self) -> None:
        self.configured: list[tuple[Any, str | None]] = []

    def configure(self, limits: Any, key: str | None) -> None:
        self.configured.append((limits, key))


def test_reload_fanout_reconfigures_the_front_through_its_interface(tmp_path: Path) -> None:
    """The root asks any FrontLike, no isinstance (issue 29.4): with the front on, a [front]
    change reaches it; with it off (NoFront) nothing is read for it, an unreadable key file
    included (vLLM's preflight says that, not a front_key_kept)."""
    on = {"enabled": True, "engine_port": free_port()}
    h = Harness(raw={"front": on})
    door = RecordingFront()
    h.sup.p.listeners.append(cli.reload_fanout(h.sup, gpu.GpuParts(h.log, env={}),
                                               unserved(h), lambda d: None, door))
    h.run_until(State.READY)
    hup(h, cfg_with(front={**on, "max_held": 7}))
    assert [lim.max_held for lim, _ in door.configured] == [7]
    off = Harness(raw={"front": {"enabled": False}})
    nothing = RecordingFront()
    off.sup.p.listeners.append(cli.reload_fanout(off.sup, gpu.GpuParts(off.log, env={}),
                                                 unserved(off), lambda d: None, nothing))
    off.run_until(State.READY)
    hup(off, cfg_with(front={"enabled": False, "max_held": 7},
                      vllm={"api_key_file": str(tmp_path / "missing")}))
    assert "reloaded" in off.log.names() and "reload_refused" not in off.log.names()
    assert nothing.configured == [] and "front_key_kept" not in off.log.names()
