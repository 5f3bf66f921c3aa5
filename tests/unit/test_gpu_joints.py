"""The GPU joints, each crossed end to end (issue 9): the NVML binding found in vLLM's venv by
`qwen4090 plan` and the daemon's preflight; GPU samples from the watch to /status and /metrics;
the OOM ladder with gpu.enabled = "off" and oom_ladder = false; plan and daemon agreeing on the
GPU a learned setting belongs to."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_supervisor import Harness
from tests.support.clients import http_get as get
from tests.support.fakes import QWEN3_14B, FakeChild, Log
from tests.support.runtime import free_port

from qwen4090.base.states import State
from qwen4090.commandline import cli
from qwen4090.decide.policy import Cause
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import gpu
from qwen4090.launching.launchvalue import Launch
from qwen4090.probes import nvml
from qwen4090.settings.config import Config

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_pynvml.py")
FAKE_NAME = "NVIDIA H200 (fake pynvml)"
# vLLM 0.26's own text for an OOM while serving (EngineCore, H200 validation run).
CUDA_OOM = ("(EngineCore pid=4242) ERROR 11-30 17:16:14 [core.py:1010] torch.OutOfMemoryError: "
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "23.55 GiB of which 1.02 GiB is free.")
FINAL = "RuntimeError: Engine core initialization failed. See root cause above."


def fake_venv(root: Path) -> Path:
    """A runtime venv as `install-runtime` leaves it: bin/python, and pynvml in site-packages.
    Returns its interpreter, for vllm.command."""
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    shutil.copy(FAKE, site / "pynvml.py")
    (root / "bin").mkdir()
    py = root / "bin" / "python"
    py.write_text("#!/bin/sh\nexit 1\n")
    py.chmod(0o755)
    return py


def load_fake() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def debian_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's own Python has no pynvml (Debian's python3): `import pynvml` fails."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(nvml, "pynvml", None)
    monkeypatch.setattr(nvml, "_initialized", False)


@pytest.fixture
def uvm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "nvidia-uvm"
    dev.write_text("")
    monkeypatch.setattr(nvml, "UVM_DEVICE", str(dev))


def write_config(tmp: Path, command0: Path | str, vllm: str = "", gpu_keys: str = "") -> Path:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_14B))
    path = tmp / "qwen4090.toml"
    path.write_text(f"""[vllm]
command = ["{command0}", "-m", "vllm.entrypoints.openai.api_server"]
model = "{model}"
quantization = "fp8"
max_model_len = 8192
max_num_seqs = 32
gpu_memory_utilization = 0.5
port = {free_port()}
{vllm}
[gpu]
state_directory = "{tmp / 'state'}"
{gpu_keys}
[status]
enabled = false
""")
    return path


# --- 9.2: NVML from the package ---------------------------------------------------------------


def test_plan_finds_nvml_in_vllms_venv_without_its_own_pynvml(tmp_path: Path) -> None:
    """A fresh `qwen4090 plan` process whose Python cannot import pynvml, as on Debian."""
    py = fake_venv(tmp_path / "venv")
    conf = write_config(tmp_path, py)
    shadow = tmp_path / "no-pynvml"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError('not on Debian python3')\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow}:{REPO / 'daemon'}"}
    r = subprocess.run([sys.executable, "-m", "qwen4090", "plan", "-c", str(conf), "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["gpu"] == FAKE_NAME and out["gpu_memory_source"] == "NVML total - reserved"
    assert out["gpu_memory_bytes"] == (143771 - 615) * 1024 ** 2


def test_without_any_binding_plan_says_what_to_run(tmp_path: Path, debian_python: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-venv" / "bin" / "python"
    conf = write_config(tmp_path, empty)
    assert cli.main(["plan", "-c", str(conf)]) == 1
    err = capsys.readouterr().err
    assert "qwen4090 install-runtime" in err and str(tmp_path / "empty-venv") in err
    assert "pip install" not in err


def test_daemon_preflight_and_driver_wait_use_the_venvs_binding(
        tmp_path: Path, debian_python: None, uvm: None) -> None:
    py = fake_venv(tmp_path / "venv")
    from qwen4090.settings.config import load

    cfg = load(write_config(tmp_path, py, gpu_keys='enabled = "required"'))
    log = Log()
    parts = gpu.GpuParts(log, env={})
    assert parts.wait_for_driver(cfg, lambda s: True) is None
    found = [kw for _, e, kw in log.events if e == "gpu_found"]
    assert found and found[0]["name"] == FAKE_NAME
    assert found[0]["binding"] == str(tmp_path / "venv/lib/python3.11/site-packages/pynvml.py")
    res = parts.preflight(parts.launch(cfg))  # what cli.cmd_run hands the supervisor
    assert res.ok, (res.fatal, res.transient)
    assert res.facts["plan"]["gpu"] == FAKE_NAME  # type: ignore[index]
    assert [kw["gpu"] for _, e, kw in log.events if e == "kv_plan"] == [FAKE_NAME]


# --- 9.3: GPU samples reach /status and /metrics -------------------------------------------


def gpu_families(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("qwen4090_gpu_") and
            s.labels.get("gpu") == "0"}


@pytest.fixture
def served(tmp_path: Path, debian_python: None) -> Iterator[tuple[Harness, int, gpu.GpuParts]]:
    py = fake_venv(tmp_path / "venv")
    port = free_port()
    h = Harness(raw={"vllm": {"command": [str(py)]},
                     "status": {"enabled": True, "host": "127.0.0.1", "port": port},
                     "gpu": {"sample_interval": 3600.0}})
    h.run_until(State.READY)
    api = cli.start_status(h.sup, h.log)
    parts = gpu.GpuParts(h.log, env={})
    try:
        yield h, port, parts
    finally:
        parts.stop_watch()
        api.stop()


def step_until_gpu(h: Harness, port: int, want: Any = None) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        h.step(0.1)
        doc = json.loads(get(port, "/status")[1])
        if doc["gpu"] is not None and (want is None or want(doc["gpu"])):
            return dict(doc["gpu"])
        assert time.monotonic() < deadline, f"no GPU sample in /status: {doc['gpu']}"
        time.sleep(0.02)  # the watch's thread takes its first sample meanwhile


def test_watch_samples_reach_status_and_metrics(served: tuple[Harness, int, gpu.GpuParts]
                                                ) -> None:
    h, port, parts = served
    parts.start_watch(h.sup.cfg, h.sup.inbox.gpu_fault, h.sup.inbox.gpu_sample)
    doc = step_until_gpu(h, port)
    assert doc["index"] == 0 and doc["memory_used_bytes"] == 20480 * 1024 ** 2
    assert doc["temperature_celsius"] == 41 and doc["throttle"] == "none"
    status, body = get(port, "/metrics")
    assert status == 200
    m = gpu_families(body.decode())
    assert m["qwen4090_gpu_memory_used_bytes"] == 20480 * 1024 ** 2
    assert m["qwen4090_gpu_memory_total_bytes"] == 143771 * 1024 ** 2
    assert m["qwen4090_gpu_temperature_celsius"] == 41
    assert m["qwen4090_gpu_power_watts"] == 123.0 and m["qwen4090_gpu_power_limit_watts"] == 700
    assert m["qwen4090_gpu_utilization_percent"] == 37
    # the next sample replaces it: a hot GPU shows at once
    assert parts.watch is not None
    nvml.pynvml.STATE["temperature"] = 90
    parts.watch.sample_once()
    assert step_until_gpu(h, port, lambda g: g["temperature_celsius"] == 90)
    assert gpu_families(get(port, "/metrics")[1].decode())[
        "qwen4090_gpu_temperature_celsius"] == 90
    nvml.pynvml.STATE["temperature"] = 41


# --- 9.4: the OOM ladder ----------------------------------------------------------------------


def oom_harness(tmp_path: Path, **gpu_keys: Any) -> tuple[Harness, list[Config]]:
    """The supervisor with the real GPU parts (preflight + ladder) and a fake vLLM."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_14B))
    h = Harness(raw={"vllm": {"command": [sys.executable], "model": str(model),
                              "max_num_seqs": 32, "port": free_port()},
                     "gpu": {"state_directory": str(tmp_path / "state"), **gpu_keys}})
    parts = gpu.GpuParts(h.log, env={})
    launches: list[Config] = []

    def spawn(launch: Launch) -> FakeChild:
        launches.append(launch.config)
        return h.spawn(launch)

    h.sup.p.gpu = parts
    h.sup.p.spawn = spawn
    return h, launches


def test_gpu_off_the_ladders_setting_is_used_by_the_next_launch(tmp_path: Path) -> None:
    h, launches = oom_harness(tmp_path, enabled="off")
    h.run_until(State.LOADING)
    h.child.exit(1, ["noise", CUDA_OOM, FINAL])
    h.step(0.1)
    assert h.sup.restarts.failure is not None and h.sup.restarts.failure.cause is Cause.OOM
    h.run_until(State.READY)
    assert [c.vllm.max_num_seqs for c in launches] == [32, 16]
    assert "oom_step_down" in h.log.names() and "learned_applied" in h.log.names()


def test_oom_with_the_ladder_off_says_so(tmp_path: Path) -> None:
    h, launches = oom_harness(tmp_path, enabled="off", oom_ladder=False)
    h.run_until(State.LOADING)
    h.child.exit(1, [CUDA_OOM, FINAL])
    h.run_until(State.READY)
    assert [c.vllm.max_num_seqs for c in launches] == [32, 32]
    assert "oom_ladder_exhausted" not in h.log.names()
    ev = [kw for _, e, kw in h.log.events if e == "oom_not_stepped_down"]
    assert ev and "oom_ladder is off" in ev[0]["reason"]


def test_plan_shows_what_the_daemon_learned_with_memory_gib_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qwen4090.settings.config import load

    conf = write_config(tmp_path, sys.executable, gpu_keys="memory_gib = 140")
    cfg = load(conf)
    parts = gpu.GpuParts(Log(), env={})  # the daemon: preflight, then an OOM
    launched = parts.launch(cfg)
    res = PreflightResult()
    parts.check(launched, res)
    assert res.ok
    from qwen4090.decide.policy import classify_exit

    verdict = classify_exit(1, [CUDA_OOM, FINAL])
    assert parts.step_down(launched, cfg, verdict, [CUDA_OOM, FINAL]) == [
        "max_num_seqs 32 -> 16 (out of memory: fewer sequences at once)"]
    again = parts.launch(cfg)  # the daemon's next launch
    parts.check(again, PreflightResult())
    assert again.config.vllm.max_num_seqs == 16
    assert cli.main(["plan", "-c", str(conf)]) == 0  # the user asks what the next launch does
    out = capsys.readouterr().out
    assert "learned   max_num_seqs 32 -> 16" in out, out
    assert "ignored" not in out
    assert cli.main(["plan", "-c", str(conf), "--gpu-memory", "140"]) == 0  # same card
    assert "learned   max_num_seqs 32 -> 16" in capsys.readouterr().out


def test_the_configured_venv_wins_over_the_default_one_found_at_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in the system test's guest: /opt/qwen4090/venv (another runtime) had a binding, and
    the venv that vllm.command names was never asked."""
    from types import SimpleNamespace

    from qwen4090.probes import nvml, nvml_binding

    default = tmp_path / "opt-venv"
    monkeypatch.setattr(nvml_binding, "DEFAULT_VENV", default)
    stale = SimpleNamespace(__file__=str(default / "lib" / "pynvml.py"))
    monkeypatch.setattr(nvml, "pynvml", stale)
    monkeypatch.setattr(nvml, "_initialized", False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable, as on Debian's python3
    py = fake_venv(tmp_path / "venv")
    assert nvml.bind([str(py), "-m", "vllm.entrypoints.openai.api_server"]) is None
    assert nvml.pynvml is not stale
    assert str(nvml.pynvml.__file__).startswith(str(tmp_path / "venv"))


# --- issue 11.1: one resolver for the daemon and `plan` -------------------------------------


@pytest.mark.parametrize("source", ["memory_gib", "nvml"])
def test_daemon_and_plan_resolve_the_same_launch(
        source: str, tmp_path: Path, debian_python: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On the same inputs (config, GPU, learned.json, kv_budget.json) the daemon's preflight,
    the launch its supervisor spawns and `qwen4090 plan` agree: same argv, same fingerprint,
    and each limit from the same place."""
    from qwen4090.decide.policy import classify_exit
    from qwen4090.launching.launch import KV_KEY, render_argv
    from qwen4090.launching.launchvalue import Origin
    from qwen4090.settings.config import load, tomllib

    py = fake_venv(tmp_path / "venv") if source == "nvml" else Path(sys.executable)
    conf = write_config(tmp_path, py, gpu_keys="memory_gib = 140" if source == "memory_gib"
                        else "")
    conf.write_text(conf.read_text().replace("max_model_len = 8192", 'max_model_len = "auto"')
                    + "[restart]\nfixed_kv_budget = true\n")
    cfg = load(conf)
    parts = gpu.GpuParts(Log(), env={})
    # the daemon's history: an OOM taught max_num_seqs 16, then a good start sized the KV cache
    first = parts.launch(cfg)
    assert parts.step_down(first, cfg, classify_exit(1, [CUDA_OOM, FINAL]), [CUDA_OOM, FINAL])
    second = parts.launch(cfg)
    assert second.kv_budget is None
    assert parts.remember_kv(second, 20000, 3 * 1024 ** 3)
    daemon = parts.launch(cfg)
    assert parts.preflight(daemon).ok
    s = daemon.settings
    assert (s["max_num_seqs"].value, s["max_num_seqs"].origin) == (16, Origin.LEARNED)
    assert s["max_model_len"].origin is Origin.PLAN and isinstance(s["max_model_len"].value, int)
    assert s["gpu_memory_utilization"].origin is Origin.CONFIGURED
    assert (s[KV_KEY].value, s[KV_KEY].origin) == (3 * 1024 ** 3, Origin.KV_BUDGET)
    at = daemon.engine  # behind the front: the engine's own loopback port, not vllm.port
    assert daemon.argv == tuple(render_argv(daemon.config.vllm, (at.host, at.port)))
    assert "--kv-cache-memory-bytes" in daemon.argv and "--max-model-len" in daemon.argv

    assert cli.main(["plan", "-c", str(conf), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["argv"] == list(daemon.argv)
    assert out["fingerprint"] == daemon.fingerprint
    assert out["settings"] == {k: v.as_json() for k, v in s.items()}
    assert cli.main(["plan", "-c", str(conf)]) == 0
    assert f"argv      {' '.join(daemon.argv)}" in capsys.readouterr().out.splitlines()

    # ... and the supervisor spawns exactly that
    h = Harness(raw=tomllib.loads(conf.read_text()))
    launches: list[Launch] = []

    def spawn(launch: Launch) -> FakeChild:
        launches.append(launch)
        return h.spawn(launch)

    h.sup.p.gpu, h.sup.p.spawn = parts, spawn
    h.run_until(State.STARTING)
    assert [list(c.argv) for c in launches] == [out["argv"]]
    assert h.sup.launch.fingerprint == out["fingerprint"]


def test_with_the_gpu_off_plan_shows_the_account_but_the_daemons_argv(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpu.enabled = "off": the daemon never plans, so "auto" stays vLLM's; `plan` still shows
    the account for a given size, and says that the launch does not use its choices."""
    from qwen4090.launching.launchvalue import Origin
    from qwen4090.settings.config import load

    conf = write_config(tmp_path, sys.executable, gpu_keys='enabled = "off"')
    conf.write_text(conf.read_text().replace("max_model_len = 8192", 'max_model_len = "auto"'))
    daemon = gpu.GpuParts(Log(), env={}).launch(load(conf))
    assert daemon.plan is None and "--max-model-len" not in daemon.argv
    assert daemon.settings["max_model_len"].origin is Origin.CONFIGURED
    assert cli.main(["plan", "-c", str(conf), "--gpu-memory", "140", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_model_len"] > 0 and out["chosen"]["max_model_len"]  # the account
    assert out["argv"] == list(daemon.argv) and out["fingerprint"] == daemon.fingerprint
    assert cli.main(["plan", "-c", str(conf), "--gpu-memory", "140"]) == 0
    assert 'gpu.enabled = "off"' in capsys.readouterr().out
