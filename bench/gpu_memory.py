#!/usr/bin/env python3
"""Where supervised vLLM's extra GPU memory goes (issue 18.6): raw `vllm serve` and qwen4090 side
by side, in one sitting, on the same argv and KV size.

Stages, one after the other on the same GPU (each stops its processes before the next):
1. ``raw``: vLLM started with the very argv qwen4090 renders (child.render_argv), no warmup;
   GPU memory per process (NVML) at /health; then the same warmup traffic qwen4090 sends
   (warmup.run against it), and the memory again: what the warmup itself leaves behind.
2. ``supervised``: ``qwen4090 run`` on the same config, at READY (after its warmup).
3. ``supervised-nopre``: the same with ``restart.preimport = false`` (is the pre-imported
   interpreter on the GPU?).
The fixed KV budget is off in every stage so that each start profiles the same way.

Each sample: the device's used MiB, and each process with a CUDA context (pid, MiB, name).
Results go to ``$QWEN4090_GPU_RESULTS/gpu-memory.json`` and stdout.

    H200 (after the kit's install; carry .whl):
        . scripts/gpu/kit.sh && python3 bench/gpu_memory.py
    CPU dry run of the harness (no NVML numbers):
        QWEN4090_GPU_DRYRUN_CPU=1 .venv/bin/python bench/gpu_memory.py --stages raw
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import lab  # noqa: E402

from qwen4090.engine import warmup  # noqa: E402
from qwen4090.engine.child import BASE_ENV  # noqa: E402
from qwen4090.launching.launch import render_argv  # noqa: E402
from qwen4090.probes import nvml  # noqa: E402
from qwen4090.probes.http import VllmProbe  # noqa: E402
from qwen4090.settings.config import load  # noqa: E402

MIB = 1024 ** 2


def sample(label: str) -> dict[str, Any]:
    """The device's used memory and every process with a CUDA context, now."""
    nvml.bind([sys.executable])
    mem = nvml.memory(0)
    procs = nvml.processes(0)
    out: dict[str, Any] = {
        "label": label,
        "device_used_mib": None if isinstance(mem, str) else round(mem.used / MIB),
        "processes": procs if isinstance(procs, str) else [
            {"pid": p.pid, "mib": None if p.used_bytes is None else round(p.used_bytes / MIB),
             "name": p.name} for p in procs]}
    print(json.dumps(out), flush=True)
    return out


def wait_released(timeout: float = 60.0) -> dict[str, Any]:
    """Until no process holds the GPU (the previous stage's are gone)."""
    lab.wait_until(lambda: not isinstance(p := nvml.processes(0), str) and not p, timeout)
    return sample("idle")


def health() -> bool:
    try:
        return lab.get("/health", timeout=2)[0] == 200
    except OSError:
        return False


def raw(conf: Path) -> dict[str, Any]:
    cfg = load(conf)
    argv = render_argv(cfg.vllm)
    proc = lab.Proc(argv, lab.RESULTS / "mem-raw-vllm.log", env={**BASE_ENV, **lab.VLLM_ENV})
    out: dict[str, Any] = {"argv": argv, "idle": wait_released()}
    proc.start()
    try:
        assert lab.wait_until(lambda: health() or proc.proc.poll() is not None, 540, 0.25)
        assert proc.proc.poll() is None, f"vLLM exited {proc.proc.returncode}"
        out["health_s"] = round(proc.elapsed(), 1)
        out["kv_lines"] = [ln[-200:] for _, ln in proc.lines if "KV cache" in ln][:4]
        out["at_health"] = sample("raw at /health")
        probe = VllmProbe(cfg.vllm.host, cfg.vllm.port, cfg.vllm.served_model_name, None)
        res = warmup.run(cfg, probe)
        out["warmup"] = {"ok": res.ok, "seconds": round(res.seconds, 1), "table": res.table()}
        out["after_warmup"] = sample("raw after qwen4090's warmup traffic")
    finally:
        out["exit"] = proc.stop(signal.SIGTERM, 60)
    return out


def supervised(conf: Path, name: str) -> dict[str, Any]:
    out: dict[str, Any] = {"idle": wait_released()}
    sup = lab.supervisor(conf, lab.RESULTS / f"mem-{name}.log")
    try:
        t_ready, _ = sup.wait_line(r'"event":"ready_notified"', 540, fail=r'"event":"giving_up"')
        out["ready_s"] = round(t_ready, 1)
        time.sleep(2.0)  # the pre-imported interpreter, if any, has started
        out["at_ready"] = sample(f"{name} at READY")
        out["pids"] = {"preimport": [ev.get("pid") for _, ev in lab.events(sup,
                                                                             "preimport_started")],
                       "child": [ev.get("pid") for _, ev in lab.events(sup, "child_spawned")]}
        out["kv_lines"] = [ln[-200:] for _, ln in sup.lines if "KV cache" in ln][:4]
    finally:
        out["exit"] = sup.stop(signal.SIGTERM, 60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="raw,supervised,supervised-nopre")
    args = ap.parse_args()
    lab.RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = lab.RESULTS / "mem-conf"
    tmp.mkdir(exist_ok=True)
    common = {"restart": {"fixed_kv_budget": False}}
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "model": lab.MODEL, "eager": os.environ.get("QWEN4090_GPU_EAGER")}
    for stage in args.stages.split(","):
        if stage == "raw":
            result[stage] = raw(lab.write_config(tmp / "raw.toml", **common))
        elif stage == "supervised":
            result[stage] = supervised(lab.write_config(tmp / "sup.toml", **common), stage)
        elif stage == "supervised-nopre":
            result[stage] = supervised(lab.write_config(
                tmp / "nopre.toml", restart={"fixed_kv_budget": False, "preimport": False}),
                stage)
        else:
            raise SystemExit(f"unknown stage {stage}")
        lab.save("gpu-memory", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
