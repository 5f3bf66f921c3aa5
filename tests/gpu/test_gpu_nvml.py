"""NVML on a real GPU: memory, samples, processes (another holder named), Xid events, the
boot wait, and the plan read from NVML.  No vLLM start: about 20 s."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lab
import pytest
from tests.support.fakes import Log

from qwen4090.decide.results import PreflightResult
from qwen4090.launching import gpu
from qwen4090.probes import nvml
from qwen4090.settings.config import load

pytestmark = pytest.mark.gpu


def test_memory_sample_driver_and_xid_watch() -> None:
    assert nvml.wait_for_driver(5.0) is None
    m = nvml.memory(0)
    assert not isinstance(m, str) and m.total > 0
    out: dict[str, Any] = {"name": m.name, "total_mib": m.total // 2**20,
                           "reserved_mib": m.reserved // 2**20, "used_mib": m.used // 2**20,
                           "usable_gib": round(m.usable / 2**30, 3)}
    try:
        import torch

        _free, total = torch.cuda.mem_get_info()
        out["cuda_total_gib"] = round(total / 2**30, 3)
    except Exception as e:  # torch is in the image; if not, say so
        out["cuda_total_gib"] = f"n/a: {e}"
    s = nvml.sample(0)
    assert not isinstance(s, str)
    out["sample"] = s.fields()
    log = Log()
    samples: list[dict[str, Any]] = []
    w = nvml.GpuWatch(0, 0.5, 85, log, on_xid=lambda code: None,
                      on_sample=lambda i, s: samples.append(s.metrics(i)))
    w.start()
    time.sleep(2.0)
    w.stop()
    out["watch_events"] = [(lvl, e, kw) for lvl, e, kw in log.events]
    out["watch_samples"] = samples[:3]
    names = [e for _, e, _ in log.events]
    assert "gpu_sample" in names
    # what the supervisor's listeners get (/status, /metrics): every sample, real numbers
    assert len(samples) >= 2 and samples[0]["memory_total_bytes"] == m.total
    assert samples[0]["temperature_celsius"] is not None
    assert "xid_watch_started" in names or "xid_events_unavailable" in names
    lab.save("nvml", out)


def test_another_process_holding_memory_is_named(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c",
                               "import torch,time,sys; x=torch.empty(4*2**30, dtype=torch.uint8,"
                               " device='cuda'); print('ok', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        procs = nvml.processes(0)
        assert not isinstance(procs, str)
        mine = [p for p in procs if p.pid == holder.pid]
        cfg = load(lab.write_config(tmp_path / "q.toml"))
        parts = gpu.GpuParts(Log(), env={})
        res = PreflightResult()
        parts.check(parts.launch(cfg), res)
        t_kill = time.monotonic()
        holder.kill()
        holder.wait()
        released = lab.wait_until(lambda: parts.held(0, [holder.pid]) is None, 30, 0.05)
        out = {"nvml_processes": [p.describe() for p in procs],
               "holder_listed": bool(mine), "preflight_warnings": res.warnings,
               "preflight_transient": res.transient,
               "released_after_kill_s": round(time.monotonic() - t_kill, 3),
               "released": released}
        lab.save("other_process", out)
        assert mine, f"NVML does not list pid {holder.pid}: {procs}"
        assert any(f"pid {holder.pid}" in w for w in res.warnings)
        assert released
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_plan_from_nvml(tmp_path: Path) -> None:
    conf = lab.write_config(tmp_path / "q.toml")
    r = subprocess.run([sys.executable, "-m", "qwen4090", "plan", "-c", str(conf), "--json"],
                       capture_output=True, text=True, env=lab.daemon_env())
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    text = subprocess.run([sys.executable, "-m", "qwen4090", "plan", "-c", str(conf)],
                          capture_output=True, text=True, env=lab.daemon_env()).stdout
    lab.save("plan_nvml", {"json": plan, "text": text})
    assert plan["kv_bytes_per_token"] == 163_840 and plan["fits"]


def test_plan_reads_the_gpu_through_vllms_venv_when_python_has_no_pynvml(tmp_path: Path
                                                                         ) -> None:
    """The installed layout (issue 9.2): Debian's python3 cannot import pynvml; the package
    finds it in the venv that vllm.command runs in (here the kit's interpreter)."""
    from qwen4090.probes import nvml_binding

    venv = nvml_binding.runtime_venv([sys.executable])
    if not nvml_binding.runtime_candidates(venv):
        pytest.skip(f"{venv} has no pynvml.py in site-packages (not a venv layout)")
    conf = lab.write_config(tmp_path / "q.toml")
    shadow = tmp_path / "no-pynvml"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError('as on Debian python3')\n")
    env = lab.daemon_env()
    env["PYTHONPATH"] = f"{shadow}:{env.get('PYTHONPATH', '')}".rstrip(":")
    r = subprocess.run([sys.executable, "-m", "qwen4090", "plan", "-c", str(conf), "--json"],
                       capture_output=True, text=True, env=env)
    lab.save("plan_venv_binding", {"venv": str(venv), "rc": r.returncode,
                                   "stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpu_memory_source"] == "NVML total - reserved"
