"""The GPU parts with NVML faked: the plan in preflight, the ladder, the release wait, and the
supervisor's use of them (fake clock, fake child, no processes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_supervisor import Harness
from tests.support.fakes import QWEN3_14B, FakeChild, Log, NoGpu

from qwen4090.base.states import State
from qwen4090.decide.policy import EX_GPU, Cause, ExitVerdict
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import gpu, launchvalue, learned, plan
from qwen4090.launching.launch import configured
from qwen4090.launching.launchvalue import Launch
from qwen4090.probes import nvml
from qwen4090.settings.config import Config, from_dict

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
    # as configured, restart.standby = "auto" resolved: no GPU, no sleeping standby
    assert res.ok and launched.config == dataclasses.replace(
        cfg, restart=dataclasses.replace(cfg.restart, standby="off"))
    assert [e for _, e, _ in log.events] == ["standby_auto", "gpu_checks_skipped"]
    assert log.named("standby_auto")[0]["why"].startswith("no GPU (NVML unavailable")
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


# --- which GPU: CUDA_VISIBLE_DEVICES by UUID (issue 19.6) -------------------------------------


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """tests/unit/fake_pynvml.py as the binding (a fresh copy), with two GPUs."""
    spec = importlib.util.spec_from_file_location("fake_pynvml_two_gpus",
                                                  Path(__file__).with_name("fake_pynvml.py"))
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    fake.STATE["count"] = 2
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_initialized", False)
    return fake


def _uuid_cfg(tmp_path: Path, unit_env: dict[str, str], **vllm_env: str
              ) -> tuple[gpu.GpuParts, Config, Log]:
    log = Log()
    cfg = make_cfg(tmp_path, plan_check="warn", max_model_len=8192,
                   **({"env": vllm_env} if vllm_env else {}))
    return gpu.GpuParts(log, env=unit_env), cfg, log


def test_a_gpu_uuid_in_the_units_environment_is_watched_by_its_nvml_index(
        tmp_path: Path, two_gpus: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=GPU-<uuid> left NVML watching index 0: the plan, the checks, the
    release wait and the watch all asked about another GPU than the one vLLM ran on."""
    second = two_gpus.UUIDS[1]
    parts, cfg, log = _uuid_cfg(tmp_path, {"CUDA_VISIBLE_DEVICES": f"{second},{two_gpus.UUIDS[0]}"})
    assert cfg.gpu.device == 0  # the config cannot know: only NVML can map a UUID
    launched = parts.launch(cfg)
    assert launched.config.gpu.device == 1  # the plan's GPU; the supervisor's release wait
    assert parts.device(cfg) == 1
    assert log.named("gpu_device_resolved") == [
        {"cuda_visible_devices": f"{second},{two_gpus.UUIDS[0]}", "index": 1}]
    parts.start_watch(cfg, on_fatal=lambda why: None)
    try:
        assert parts.watch is not None and parts.watch.index == 1
    finally:
        parts.stop_watch()
    asked: list[int] = []
    real_memory = nvml.memory

    def processes(index: int = 0) -> list[nvml.GpuProcess]:
        asked.append(index)
        return []

    def memory(index: int = 0) -> nvml.MemoryInfo | str:
        asked.append(index)
        return real_memory(index)

    monkeypatch.setattr(nvml, "processes", processes)
    parts.wait_released(cfg, [77], sleep=lambda s: None)
    monkeypatch.setattr(nvml, "wait_for_driver", lambda *a, **kw: None)
    monkeypatch.setattr(nvml, "memory", memory)
    assert parts.wait_for_driver(cfg, extend=lambda s: None) is None
    assert asked == [1, 1] and log.named("gpu_found")  # the release wait, the driver wait
    assert not log.named("gpu_device_unresolved")


@pytest.mark.parametrize("unit_env,vllm_env,expected", [
    # [vllm.env] is what vLLM gets, over the unit's Environment=
    ({"CUDA_VISIBLE_DEVICES": "GPU-0e6b2b1c-7d1a-4c3e-9f00-a1b2c3d4e5f0"},
     "GPU-1e6b2b1c-7d1a-4c3e-9f00-a1b2c3d4e5f1", 1),
    ({}, "GPU-1e6b", 1),  # a unique prefix, which CUDA accepts too
    ({}, "MIG-7f2c9e11-0000-4000-8000-00000000mig1", 1),  # a MIG instance: its GPU
    ({}, "MIG-GPU-1e6b2b1c-7d1a-4c3e-9f00-a1b2c3d4e5f1/2/0", 1),  # before driver R470
])
def test_uuids_and_mig_names_in_vllm_env_are_resolved(
        tmp_path: Path, two_gpus: ModuleType, unit_env: dict[str, str], vllm_env: str,
        expected: int) -> None:
    two_gpus.STATE["migs"] = {"MIG-7f2c9e11-0000-4000-8000-00000000mig1": 1}
    parts, cfg, log = _uuid_cfg(tmp_path, unit_env, CUDA_VISIBLE_DEVICES=vllm_env)
    assert parts.launch(cfg).config.gpu.device == expected
    assert parts.device(cfg) == expected
    assert not log.named("gpu_device_unresolved")


def test_index_lists_keep_todays_behaviour(tmp_path: Path, two_gpus: ModuleType) -> None:
    # in [vllm.env]: gpu.device follows the first index (derived.py, when the config loads)
    parts, cfg, log = _uuid_cfg(tmp_path, {}, CUDA_VISIBLE_DEVICES="1,0")
    assert cfg.gpu.device == 1 and parts.launch(cfg).config.gpu.device == 1
    # in the unit's environment: gpu.device as configured, as before
    parts, cfg, log = _uuid_cfg(tmp_path, {"CUDA_VISIBLE_DEVICES": "1"})
    assert parts.launch(cfg).config.gpu.device == 0
    assert not any(e.startswith("gpu_device") for e in log.names())


@pytest.mark.parametrize("value", [
    "GPU-ffffffff-0000-4000-8000-000000000000",  # no such GPU
    "GPU-",  # a prefix of both
    "nonsense",
])
def test_an_unresolvable_value_is_warned_about_once_and_gpu_device_watched(
        tmp_path: Path, two_gpus: ModuleType, value: str) -> None:
    parts, cfg, log = _uuid_cfg(tmp_path, {"CUDA_VISIBLE_DEVICES": value})
    assert parts.launch(cfg).config.gpu.device == 0
    assert parts.launch(cfg).config.gpu.device == 0
    warned = log.named("gpu_device_unresolved")
    assert len(warned) == 1, warned  # once, not at every launch
    assert warned[0]["cuda_visible_devices"] == value and warned[0]["device"] == 0
    assert "nvidia-smi -L" in warned[0]["hint"] and warned[0]["reason"]


def test_without_nvml_a_uuid_is_warned_about_and_gpu_device_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", None)
    monkeypatch.setattr(nvml, "bind", lambda command: "no NVML binding")
    parts, cfg, log = _uuid_cfg(tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-1e6b2b1c"})
    assert parts.launch(cfg).config.gpu.device == 0
    assert "no NVML binding" in log.named("gpu_device_unresolved")[0]["reason"]
    quiet = Log()
    off = gpu.GpuParts(quiet, env={"CUDA_VISIBLE_DEVICES": "GPU-1e6b2b1c"})
    cfg_off = from_dict({"vllm": {"model": "/m"}, "gpu": {"enabled": "off", "device": 2}})
    assert off.device(cfg_off) == 2 and quiet.events == []


# --- the supervisor with these hooks --------------------------------------------------------


class FakeGpu(NoGpu):
    """A GPU part whose ladder lowers max_model_len once."""

    def __init__(self) -> None:
        self.calls: list[tuple[Config, ExitVerdict, list[str]]] = []
        self.len = 40960

    def launch(self, cfg: Config, beside: launchvalue.Endpoint | None = None,
               host: plan.HostMemory | str | None = None) -> Launch:
        return configured(from_dict({"vllm": {"max_model_len": self.len}}), beside)

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
    h.sup.inbox.gpu_fault("Xid 79 (GPU has fallen off the bus): the machine needs a reboot")
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
    h.sup.inbox.gpu_fault("Xid 48 (double-bit ECC error)")
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
