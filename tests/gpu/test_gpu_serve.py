"""Real vLLM 0.26 on the GPU: raw `vllm serve` vs the supervisor (startup timeline, first-request
TTFT with and without qwen4090's warmup, warm TTFT), a real hang healed, the plan's KV tokens vs
vLLM's.  Run one test per device call (scripts/gpu/validate.sh raw|supervised)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import lab
import pytest

from qwen4090.engine.child import BASE_ENV
from qwen4090.launching.launch import render_argv
from qwen4090.settings.config import load

pytestmark = pytest.mark.gpu

# vLLM's log lines that mark the start-up timeline
MARKS = {
    "api_log_up": r"vLLM API server version|non-default args",
    "weights_loaded": r"Model loading took",
    "torch_compile_done": r"torch.compile took",
    "kv_sized": r"GPU KV cache size",
    "graphs_captured": r"Graph capturing finished",
    "engine_ready": r"init engine \(profile, create kv cache",
    "app_startup": r"Application startup complete",
}


def timeline(proc: lab.Proc, after: float = -1.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, rx in MARKS.items():
        hit = proc.find(rx, after)
        out[key] = None if hit is None else round(hit[0], 2)
    for key, rx in (("weights_line", r"Model loading took"), ("kv_line", r"GPU KV cache size"),
                    ("kv_memory_line", r"Available KV cache memory"),
                    ("concurrency_line", r"Maximum concurrency for"),
                    ("compile_line", r"torch.compile took"),
                    ("graph_line", r"Graph capturing finished"),
                    ("usage_line", r"Actual usage is")):
        hit = proc.find(rx, after)
        out[key] = None if hit is None else hit[1][-400:]
    return out


def kv_tokens_reported(proc: lab.Proc, after: float = -1.0) -> int | None:
    hit = proc.find(r"GPU KV cache size: [\d,]+ tokens", after)
    if not hit:
        return None
    import re

    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", hit[1])
    return int(m[1].replace(",", "")) if m else None


def test_raw_vllm_serve_without_warmup(tmp_path: Path) -> None:
    """The baseline: vLLM started with the very argv qwen4090 renders, no warmup."""
    conf = lab.write_config(tmp_path / "q.toml")
    cfg = load(conf)
    argv = render_argv(cfg.vllm)
    before = lab.nvml_used_mib()
    proc = lab.Proc(argv, lab.RESULTS / "raw-vllm.log", env={**BASE_ENV, **lab.VLLM_ENV})
    lab.RESULTS.mkdir(parents=True, exist_ok=True)
    proc.start()
    try:
        assert lab.wait_until(lambda: _health() or proc.proc.poll() is not None, 540, 0.25)
        assert proc.proc.poll() is None, f"vLLM exited {proc.proc.returncode}: {proc.lines[-3:]}"
        t_health = proc.elapsed()
        first = lab.ttft_series(seed=1)  # the very first requests: no warmup ran
        warm = lab.ttft_series(seed=2)
        used = lab.nvml_used_mib()
        lab.save("raw", {"argv": argv, "health_s": round(t_health, 2),
                         "timeline": timeline(proc), "kv_tokens_reported": kv_tokens_reported(proc),
                         "ttft_first": first, "ttft_warm": warm,
                         "nvml_used_mib_before": before, "nvml_used_mib_serving": used})
    finally:
        rc = proc.stop(signal.SIGTERM, 30)
        print("raw vllm exit", rc)


def _health() -> bool:
    try:
        return lab.get("/health", timeout=2)[0] == 200
    except OSError:
        return False


def test_supervised_ready_ttft_and_hang_healed(tmp_path: Path) -> None:
    conf = lab.write_config(tmp_path / "q.toml")
    sup = lab.supervisor(conf, lab.RESULTS / "supervised.log")
    res: dict[str, Any] = {}
    try:
        t_ready, _ = sup.wait_line(r'"event":"ready_notified"', 540, fail=r'"event":"giving_up"')
        res["ready_s"] = round(t_ready, 2)
        res["health_ok_s"] = next((round(t, 2) for t, _ in lab.events(sup, "health_ok")), None)
        res["timeline"] = timeline(sup)
        res["kv_tokens_reported"] = kv_tokens_reported(sup)
        plans = [ev for _, ev in lab.events(sup, "kv_plan")]
        res["plan"] = plans[0] if plans else None
        res["warmup"] = [ev for _, ev in lab.events(sup, "warmup_finished")]
        res["ttft_first_after_ready"] = lab.ttft_series(seed=1)
        res["ttft_warm"] = lab.ttft_series(seed=2)
        res["nvml_used_mib_serving"] = lab.nvml_used_mib()
        # --- a real hang: SIGSTOP the EngineCore while requests stream -----------------------
        stop = threading.Event()
        lab.load(4, 1400 if lab.DRYRUN else 3000, stop)
        assert lab.wait_until(lambda: (lab.metric("vllm:num_requests_running") or 0) > 0, 30,
                              0.2)
        tokens_before = lab.metric("vllm:generation_tokens_total")
        engines = lab.engine_pids()
        assert engines, "no EngineCore process found"
        t_stop = sup.elapsed()
        for pid in engines:
            lab.os.kill(pid, signal.SIGSTOP)
        t_hang, hang_line = sup.wait_line(r'"event":"hang_detected"', 120, after=t_stop)
        t_back, _ = sup.wait_line(r'"to":"ready"', 400, after=t_hang,
                                 fail=r'"event":"giving_up"')
        res["hang"] = {"engine_pids": engines, "tokens_before_stop": tokens_before,
                       "sigstop_at_s": round(t_stop, 2),
                       "detected_after_s": round(t_hang - t_stop, 2),
                       "ready_again_after_s": round(t_back - t_stop, 2),
                       "hang_line": hang_line[-300:],
                       "events": [ev for t, ev in lab.events(sup) if t >= t_stop and ev.get(
                           "event") in ("hang_detected", "vllm_failed", "group_signalled",
                                        "group_kill", "group_gone", "gpu_released",
                                        "gpu_not_released", "restart_scheduled",
                                        "state_changed", "kv_plan")]}
        res["ttft_after_heal"] = lab.ttft_series(seed=3)
        res["nvml_samples"] = [ev for _, ev in lab.events(sup, "gpu_sample")][:12]
        # the samples reach the supervisor's own endpoint (issue 9.3): /status and /metrics
        _, status_body = lab.get("/status", port=lab.STATUS_PORT)
        res["status_gpu"] = json.loads(status_body).get("gpu")
        _, metrics_body = lab.get("/metrics", port=lab.STATUS_PORT)
        res["status_gpu_metrics"] = [line for line in metrics_body.decode().splitlines()
                                     if line.startswith("qwen4090_gpu_")]
        res["xid_watch"] = [ev.get("event") for _, ev in lab.events(sup)
                            if str(ev.get("event", "")).startswith("xid_")]
    finally:
        t_term = sup.elapsed()
        rc = sup.stop(signal.SIGTERM, 60)
        res["sigterm_exit_code"] = rc
        res["stop_s"] = round(sup.elapsed() - t_term, 2)
        res["nvml_used_mib_after_stop"] = lab.nvml_used_mib()
        lab.save("supervised", res)
    assert res["hang"]["detected_after_s"] <= 15 + 2 * 2 + 3
    assert rc == 0
    if not lab.DRYRUN:  # the CPU dry run has no GPU to sample
        assert res["status_gpu"] and res["status_gpu"]["memory_used_bytes"] > 0
        assert any(m.startswith("qwen4090_gpu_memory_used_bytes{") for m in
                   res["status_gpu_metrics"])
