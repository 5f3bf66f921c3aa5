"""The startup and recovery timelines of the real supervisor over the real CPU vLLM."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from qwen4090.engine.timeline import MARKS, RECOVERY_MARKS
from qwen4090.launching.kvbudget import FLAG
from tests.support.daemon import Daemon
from tests.support.runtime import cpu_config, free_port, write_toml


def get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def phase_counts(text: str, family: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_count"):
                    out[s.labels["phase"]] = s.value
    return out


def ordered(at: dict[str, float], marks: tuple[str, ...]) -> bool:
    ranks = [marks.index(k) for k in at]
    return ranks == sorted(ranks) and list(at.values()) == sorted(at.values())


def test_startup_and_recovery_timelines_metrics_and_the_fixed_kv_budget(tmp_path: Path) -> None:
    status_port = free_port()
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        free_port(), status={"enabled": True, "host": "127.0.0.1", "port": status_port},
        restart={"fixed_kv_budget": True, "backoff_initial": 0.2},
        gpu={"enabled": "off", "state_directory": str(tmp_path / "state")}))
    d = Daemon(cfg, tmp_path)
    try:
        d.wait_state("ready", 300)
        first: dict[str, Any] = d.wait_event("startup_timeline", 10)
        assert first["outcome"] == "ready"
        at = first["at"]
        assert ordered(at, MARKS)
        assert {"spawn", "first_output", "api_up", "engine_up", "weights_loaded", "kv_sized",
                "engine_ready", "api_listening", "health", "ready"} <= set(at)
        assert first["kv_tokens"] and first["kv_bytes"] == 1024 ** 3  # VLLM_CPU_KVCACHE_SPACE=1
        assert d.wait_event("kv_budget_recorded", 10)["kv_bytes"] == 1024 ** 3
        counts = phase_counts(get(status_port, "/metrics"), "qwen4090_startup_phase_seconds")
        assert counts["total"] == 1 and counts["engine_up"] == 1 and counts["ready"] == 1
        assert json.loads(get(status_port, "/status"))["startup_timeline"]["at"] == at

        # A crash: the API server killed (no error line from vLLM: the fault is when the loop
        # saw the exit, the supervisor's child_exit_seen). The relaunch gets the KV budget.
        mark = d.mark()
        os.kill(d.last_child_pid(), signal.SIGKILL)
        rec: dict[str, Any] = d.wait_event("recovery_timeline", 300, after=mark)
        assert rec["fault_source"] == "child_exit_seen" and rec["cause"] == "signal"
        assert ordered(rec["at"], RECOVERY_MARKS)
        # every mark of a restart ("woken" belongs to a failover to the standby, issue 21)
        assert list(rec["at"]) == [m for m in RECOVERY_MARKS if m != "woken"]
        assert rec["failover"] is False
        assert rec["total"] == rec["at"]["ready"] > 0
        spawned = d.event("child_spawned", after=mark)
        assert spawned is not None and f"{FLAG} {1024 ** 3}" in spawned["argv"]
        second = d.event("startup_timeline", after=mark)
        assert second is not None and second["kv_tokens"] == first["kv_tokens"]
        assert ordered(second["at"], MARKS)
        counts = phase_counts(get(status_port, "/metrics"), "qwen4090_recovery_phase_seconds")
        assert counts["total"] == 1 and counts["start"] == 1
        assert json.loads(get(status_port, "/status"))["recovery_timeline"]["at"] == rec["at"]
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    finally:
        d.close()
