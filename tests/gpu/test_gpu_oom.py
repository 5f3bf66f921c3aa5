"""A real OOM on the GPU: a context that does not fit, refused by the plan before launch, then
(plan_check = "warn") let through to vLLM, which fails; the ladder steps down, the next start is
READY, and a new supervisor reuses the learned setting.  enforce_eager keeps starts short."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lab
import pytest

pytestmark = pytest.mark.gpu


def oom_config(tmp_path: Path, plan_check: str) -> Path:
    return lab.write_config(
        tmp_path / f"oom-{plan_check}.toml",
        vllm={"max_model_len": 40960, "max_num_seqs": "auto", "max_num_batched_tokens": "auto",
              "enforce_eager": True},
        warmup={"lengths": [16, 1024, 4096], "concurrency": [1, 4]},
        gpu={"plan_check": plan_check, "state_directory": str(tmp_path / "state")})


def test_plan_refuses_before_launch(tmp_path: Path) -> None:
    conf = oom_config(tmp_path, "refuse")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "qwen4090", "run", "-c", str(conf)],
                       capture_output=True, text=True, timeout=120,
                       env=lab.daemon_env())
    took = time.monotonic() - t0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "giving_up" in ln]
    lab.save("oom_refused", {"exit_code": r.returncode, "seconds": round(took, 2),
                             "giving_up": lines})
    assert r.returncode == 78 and "max_model_len" in lines[0]


def test_real_oom_healed_by_the_ladder_and_learned(tmp_path: Path) -> None:
    conf = oom_config(tmp_path, "warn")
    res: dict[str, Any] = {}
    sup = lab.supervisor(conf, lab.RESULTS / "oom-run1.log")
    try:
        t_ready, _ = sup.wait_line(r'"event":"ready_notified"', 560, fail=r'"event":"giving_up"')
        res["run1_ready_s"] = round(t_ready, 2)
        res["run1"] = [ev for _, ev in lab.events(sup) if ev.get("event") in (
            "kv_plan", "preflight_warning", "child_exited", "oom_step_down", "learned_saved",
            "learned_applied", "restart_scheduled", "gpu_released", "child_spawned",
            "ready_notified")]
        res["run1_vllm_oom_line"] = next((ln[-500:] for _, ln in sup.lines
                                          if "To serve at least one request" in ln or
                                          "No available memory" in ln), None)
        res["run1_kv_lines"] = [ln[-200:] for _, ln in sup.lines if "GPU KV cache size" in ln]
    finally:
        res["run1_exit"] = sup.stop(signal.SIGTERM, 60)
    learned = json.loads((tmp_path / "state" / "learned.json").read_text())
    res["learned_json"] = learned
    sup2 = lab.supervisor(conf, lab.RESULTS / "oom-run2.log")
    try:
        t2, _ = sup2.wait_line(r'"event":"ready_notified"', 300, fail=r'"event":"giving_up"')
        res["run2_ready_s"] = round(t2, 2)
        res["run2"] = [ev for _, ev in lab.events(sup2) if ev.get("event") in (
            "learned_applied", "kv_plan", "child_spawned", "child_exited", "ready_notified")]
        res["run2_kv_lines"] = [ln[-200:] for _, ln in sup2.lines if "GPU KV cache size" in ln]
        res["run2_ttft"] = [lab.ttft(n, seed=5) for n in (16, 1024, 8000)]
    finally:
        res["run2_exit"] = sup2.stop(signal.SIGTERM, 60)
        lab.save("oom", res)
    names1 = [ev["event"] for ev in res["run1"]]
    assert "oom_step_down" in names1 and "ready_notified" in names1
    names2 = [ev["event"] for ev in res["run2"]]
    assert "learned_applied" in names2 and "child_exited" not in names2
