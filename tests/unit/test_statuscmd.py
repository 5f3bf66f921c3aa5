"""`qwen4090 status`: summary text and exit codes against a served document (no vLLM)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline import cli, statuscmd
from qwen4090.decide.policy import EXIT_CODES
from qwen4090.surfaces.httpapi import StatusApi

DOC: dict[str, Any] = {
    "state": "ready", "state_reason": "warmed up", "state_seconds": 75.0, "child_pid": 42,
    "model": "tiny", "endpoint": "http://127.0.0.1:8000/v1", "max_model_len": 2048,
    "max_num_seqs": 8, "status": "ready: tiny ctx=2048", "restarts": 1,
    "failures_in_window": 1, "hangs": 0, "time_to_ready_seconds": 21.4,
    "history": [{"wall_time": 1000.0, "cause": "signal", "detail": "killed by SIGKILL",
                 "counted": True}],
    "warmup": {"ok": True, "seconds": 2.0, "rows": [
        {"length": 1024, "concurrency": 1, "ttft_ms": 85.0, "ttft_max_ms": 85.0, "seconds": 1},
        {"length": 256, "concurrency": 8, "ttft_ms": 120.0, "ttft_max_ms": 150.0,
         "seconds": 1}]},
    "vllm_metrics": {"vllm:num_requests_running": 3.0, "vllm:kv_cache_usage_perc": 0.5},
    "gpu": {"index": 0, "memory_used_mib": 20000, "temperature_c": 61.5},
    "preimport": {"pid": 77, "age_s": 30.0, "rss_bytes": 536870912},
    "front": {"open": True, "draining": False, "in_flight": 5, "holding": 0, "requests": 900,
              "held": 12, "replayed": 3, "hold_timeouts": 0, "stream_errors": 1},
}


def test_summary_is_compact_and_has_the_facts() -> None:
    text = statuscmd.summary(DOC, now=1060.0)
    assert text.splitlines()[0] == "qwen4090: READY for 75s (warmed up)"
    assert "1024:85ms" in text and "x8:120ms" in text
    assert "3 running, 0 waiting, KV cache 50% used" in text
    assert "gpu0" in text and "temperature_c=61.5" in text
    assert "60s ago  signal: killed by SIGKILL" in text
    assert "vLLM pre-imported in pid 77 for 30s, 0.5 GiB RAM" in text
    assert "pre-imported" not in statuscmd.summary({**DOC, "preimport": None}, now=1060.0)
    assert "clients   open: 5 in flight, 0 held now; since start 900 requests, 12 held, " \
           "3 replayed, 0 timed out, 1 streams ended by an error" in text
    assert "clients" not in statuscmd.summary({**DOC, "front": None}, now=1060.0)
    assert len(text.splitlines()) <= 13


@pytest.mark.parametrize(("state", "code"), [("ready", 0), ("degraded", 1), ("warming", 1),
                                              ("restarting", 1), ("stopping", 1),
                                              ("failed", 3), ("stopped", 3)])
def test_exit_code_by_state(state: str, code: int) -> None:
    assert statuscmd.exit_code({"state": state}) == code


def test_exit_codes_are_documented() -> None:
    assert {0, 1, 3} <= set(EXIT_CODES)


@pytest.fixture
def served() -> Iterator[tuple[StatusApi, dict[str, Any]]]:
    doc = dict(DOC)
    api = StatusApi(lambda: doc)
    api.start("127.0.0.1", 0)
    yield api, doc
    api.stop()


def config_for(tmp_path: Path, port: int) -> str:
    p = tmp_path / "q.toml"
    p.write_text(f"[status]\nport = {port}\n")
    return str(p)


def test_command_reads_the_config_and_exits_by_state(
        served: tuple[StatusApi, dict[str, Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    api, doc = served
    cfg = config_for(tmp_path, api.address[1])
    assert cli.main(["status", "--config", cfg]) == 0
    assert "READY" in capsys.readouterr().out
    doc["state"] = "loading"
    api.renders.forget()  # what the loop does after a step that changed the state
    assert cli.main(["status", "--config", cfg, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "loading"


def test_not_running_is_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nobody listens
    assert cli.main(["status", "--url", f"http://127.0.0.1:{port}"]) == 3
    assert "not running" in capsys.readouterr().out
    assert cli.main(["status", "--url", f"http://127.0.0.1:{port}", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["running"] is False


def test_unreadable_config_falls_back_to_the_default_endpoint(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(url=None, config=str(tmp_path / "missing.toml"))
    host, port, note = statuscmd.endpoint(args)
    assert (host, port) == ("127.0.0.1", 8090) and note and "missing.toml" in note
