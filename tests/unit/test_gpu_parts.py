"""The GPU parts with NVML faked: the plan in preflight, the ladder, the release wait, and the
supervisor's use of them (fake clock, fake child, no processes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_supervisor import Harness
from tests.support.fakes import QWEN3_14B, FakeChild, Log

from qwen4090 import gpu, learned
from qwen4090.config import Config, from_dict
from qwen4090.contracts import NoGpu
from qwen4090.launch import Launch, configured
from qwen4090.policy import EX_GPU, Cause, ExitVerdict
from qwen4090.preflight import PreflightResult
from qwen4090.probes import nvml
from qwen4090.states import State

GIB = 1024 ** 3
CONTEXT = ("ValueError: To serve at least one request with the model's max seq len (40960), "
           "(6.25 GiB KV cache is needed, which is larger than the available KV cache memory "
           "(4.75 GiB). Based on the available memory, the estimated maximum model length is "
           "31104. Try increasing `gpu_memory_utilization`")


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"procs": [], "free": 139 * GIB}
    monkeypatch.setattr(nvml, "memory", lambda index=0: nvml.MemoryInfo(
        "NVIDIA H200", 143771 * 1024 ** 2, 615 * 1024 ** 2, 615 * 1024 ** 2, state["free"]))
    monkeypatch.setattr(nvml, "processes", lambda index=0: list(state["procs"]))
    return state


def make_cfg(tmp_path: Path, plan_check: str = "refuse", **vllm: Any) -> Config:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_14B))
    return from_dict({"vllm": {"model": str(model), "quantization": "fp8",
                               "gpu_memory_utilization": 0.16, **vllm},
                      "gpu": {"state_directory": str(tmp_path / "state"),
                              "plan_check": plan_check}})


def check(parts: gpu.GpuParts, cfg: Config) -> tuple[Launch, PreflightResult]:
    """What the daemon's preflight does: resolve the launch, then check it against the GPU."""
    launched = parts.launch(cfg)
    res = PreflightResult()
    parts.check(launched, res)
    return launched, res


def test_auto_limits_are_chosen_before_launch(tmp_path: Path, h200: dict[str, Any]) -> None:
    parts = gpu.GpuParts(Log(), env={})
    launched, res = check(parts, make_cfg(tmp_path, max_model_len="auto", max_num_seqs="auto"))
    assert res.ok
    v = launched.config.vllm
    assert isinstance(v.max_model_len, int) and 28_000 <= v.max_model_len <= 30_720
    assert v.max_num_seqs == 8
    assert res.facts["plan"]["kv_bytes_per_token"] == 163_840  # type: ignore[index]


def test_explicit_settings_that_cannot_fit_are_refused(tmp_path: Path,
                                                       h200: dict[str, Any]) -> None:
    parts = gpu.GpuParts(Log(), env={})
    _, res = check(parts, make_cfg(tmp_path, max_model_len=40960))
    assert res.fatal is not None and res.fatal.key == "vllm.max_model_len"
    assert "cannot fit" in str(res.fatal)
    launched, warn = check(parts, make_cfg(tmp_path, plan_check="warn", max_model_len=40960))
    assert warn.fatal is None and any("trying anyway" in w for w in warn.warnings)
    assert launched.config.vllm.max_model_len == 40960


def test_other_processes_holding_memory_are_named(tmp_path: Path, h200: dict[str, Any]) -> None:
    parts = gpu.GpuParts(Log(), env={})
    h200["procs"] = [nvml.GpuProcess(4321, 120 * GIB, "python3 train.py")]
    h200["free"] = 19 * GIB
    _, res = check(parts, make_cfg(tmp_path, max_model_len=8192))
    assert res.transient is not None and "pid 4321 (python3 train.py) 120.0 GiB" in res.transient
    h200["free"] = 100 * GIB
    _, res = check(parts, make_cfg(tmp_path, max_model_len=8192))
    assert res.transient is None and any("pid 4321" in w for w in res.warnings)


def test_without_nvml_the_checks_step_aside(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "memory", lambda index=0: "NVML unavailable: not found")
    log = Log()
    parts = gpu.GpuParts(log, env={})
    cfg = make_cfg(tmp_path, max_model_len=40960)
    launched, res = check(parts, cfg)
    assert res.ok and launched.config == cfg  # the launch as configured
    assert [e for _, e, _ in log.events] == ["gpu_checks_skipped"]
    req = from_dict({**{"vllm": {"model": "/m"}}, "gpu": {"enabled": "required"}})
    assert "GPU not ready" in (check(parts, req)[1].transient or "")


def test_oom_ladder_is_learned_and_used_at_the_next_start(tmp_path: Path,
                                                         h200: dict[str, Any]) -> None:
    parts = gpu.GpuParts(Log(), env={})
    cfg = make_cfg(tmp_path, plan_check="warn", max_model_len=40960)
    launch, _ = check(parts, cfg)
    changes = parts.step_down(
        launch, cfg, ExitVerdict(Cause.OOM, CONTEXT[:200], True), ["noise", CONTEXT])
    assert changes == ["max_model_len 40960 -> 30976 (vLLM estimated at most 31104 tokens fit)"]
    saved = json.loads((tmp_path / "state" / "learned.json").read_text())
    assert saved["settings"] == {"max_model_len": 30976}
    again, _ = check(parts, cfg)  # the next start: learned value applied before the plan
    assert again.config.vllm.max_model_len == 30976
    assert learned.LearnedStore(tmp_path / "state").reset() == ["max_model_len"]


def test_gpu_held_names_the_old_processes(h200: dict[str, Any]) -> None:
    parts = gpu.GpuParts(Log(), env={})
    h200["procs"] = [nvml.GpuProcess(77, 20 * GIB, "VLLM::EngineCore")]
    assert parts.held(0, [77]) == "pid 77 (VLLM::EngineCore) 20.0 GiB"
    assert parts.held(0, [78]) is None


# --- the supervisor with these hooks --------------------------------------------------------


class FakeGpu(NoGpu):
    """A GPU part whose ladder lowers max_model_len once."""

    def __init__(self) -> None:
        self.calls: list[tuple[Config, ExitVerdict, list[str]]] = []
        self.len = 40960

    def launch(self, cfg: Config) -> Launch:
        return configured(from_dict({"vllm": {"max_model_len": self.len}}))

    def step_down(self, launched: Launch, cfg: Config, v: ExitVerdict, tail: list[str]
                  ) -> list[str] | None:
        self.calls.append((launched.config, v, tail))
        self.len = 30976
        return ["max_model_len 40960 -> 30976"]


def test_oom_exit_steps_down_and_relaunches_with_the_new_setting() -> None:
    h = Harness()
    fake = FakeGpu()
    calls = fake.calls
    launches: list[Config] = []

    orig_spawn = h.spawn

    def spawn(launch: Launch) -> FakeChild:
        launches.append(launch.config)
        return orig_spawn(launch)

    h.sup.p.gpu = fake
    h.sup.p.spawn = spawn
    h.run_until(State.LOADING)
    h.child.exit(1, [CONTEXT, "RuntimeError: Engine core initialization failed."])
    h.step(0.1)
    h.run_until(State.READY)
    assert calls and calls[0][0].vllm.max_model_len == 40960 and CONTEXT in calls[0][2]
    assert calls[0][1].cause is Cause.OOM
    assert [c.vllm.max_model_len for c in launches] == [40960, 30976]
    assert "oom_step_down" in h.log.names()
    assert "ctx=30976" in h.sup.status_line(h.clock.t)


def test_fatal_xid_while_ready_stops_the_loop_with_its_own_exit_code() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.sup.report_gpu_fault("Xid 79 (GPU has fallen off the bus): the machine needs a reboot")
    h.run_until(State.FAILED)
    assert h.sup.exit_code == EX_GPU == 69
    assert len(h.children) == 1  # never relaunched
    assert "Xid 79" in h.sup.state_reason


def test_fatal_xid_while_restarting_ends_in_failed() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.child.exit(0)
    h.step(0.1)
    assert h.sup.state == State.RESTARTING
    h.sup.report_gpu_fault("Xid 48 (double-bit ECC error)")
    h.step(0.1)
    assert h.sup.state == State.FAILED and h.sup.exit_code == EX_GPU


class GpuHolding(NoGpu):
    """A GPU part that says which old pids hold memory."""

    def __init__(self, held: Callable[[list[int]], str | None]) -> None:
        self._held = held

    def held(self, device: int, pids: list[int]) -> str | None:
        return self._held(pids)


class GpuLadder(NoGpu):
    """A GPU part whose step-down is `step(current config, verdict, tail)`."""

    def __init__(self, step: Callable[[Config, ExitVerdict, list[str]], list[str] | None]
                 ) -> None:
        self._step = step

    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None:
        return self._step(cfg, verdict, tail)


def test_relaunch_waits_for_the_old_gpu_memory_bounded() -> None:
    h = Harness(raw={"gpu": {"release_timeout": 10.0}})
    held = {"until": 0.0}
    h.sup.p.gpu = GpuHolding(lambda pids: "pid 1 (old) 20.0 GiB" if h.clock.t < held["until"]
                       else None)
    h.run_until(State.READY)
    held["until"] = h.clock.t + 3.0
    h.child.exit(0)
    h.run_until(State.STARTING)
    assert h.clock.t >= held["until"]  # waited for the release
    assert "gpu_released" in h.log.names()
    # never released: relaunch after release_timeout, naming the holder
    held["until"] = 1e18
    h.run_until(State.READY)
    h.child.exit(0)
    t0 = h.clock.t
    h.run_until(State.STARTING)
    assert 10.0 <= h.clock.t - t0 < 30.0  # gpu.release_timeout, not the default 30 s
    ev = [kw for _, e, kw in h.log.events if e == "gpu_not_released"]
    assert ev and "pid 1 (old)" in ev[0]["holders"]
