"""Failures that end the service: real vLLM exiting 0, a real crash loop, bad config."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.clients import record
from tests.support.daemon import Daemon
from tests.support.runtime import REPO, cpu_config, free_port, write_toml


def run_to_exit(cfg: Path, tmp: Path, timeout: float) -> tuple[int, Daemon]:
    d = Daemon(cfg, tmp)
    t0 = time.monotonic()
    try:
        rc = d.wait_exit(timeout)
    finally:
        d.close()
    d.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    return rc, d


def test_vllm_exiting_0_is_restarted_then_budget_ends_in_75(tmp_path: Path) -> None:
    # The real vLLM, asked for --help, prints its usage and exits 0: a failure like any other.
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        free_port(), vllm={"extra_args": ["--help"]},
        restart={"budget_failures": 2, "backoff_initial": 0.2}))
    rc, d = run_to_exit(cfg, tmp_path, 180)
    assert rc == 75
    exits = [e for e in d.events if e.get("event") == "child_exited"]
    record("exit_0_loop_to_75", d.seconds, budget_failures=2)  # type: ignore[attr-defined]
    spawned = [e for e in d.events if e.get("event") == "child_spawned"]
    if len(spawned) >= 2:
        record("exit_0_seen_to_respawn", spawned[1]["_t"] - exits[0]["_t"])
    assert [e["code"] for e in exits] == [0, 0]
    assert all(e["cause"] == "exit_0" for e in exits)
    assert d.event("restart_scheduled", cause="exit_0") is not None
    final = d.event("giving_up")
    assert final is not None and final["exit_code"] == 75 and "crash loop" in final["reason"]
    assert final["_prio"] == 2
    assert d.statuses()[-1].startswith("failed: crash loop")
    assert d.survivors() == []


def test_crashing_vllm_is_a_crash_loop(tmp_path: Path) -> None:
    # A model whose architecture vLLM does not know: vLLM starts, then exits 1 every time.
    model = tmp_path / "model"
    model.mkdir()
    src = json.loads((REPO / ".runtime" / "tiny-model" / "config.json").read_text())
    src["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(src))
    for f in (REPO / ".runtime" / "tiny-model").iterdir():
        if f.name != "config.json":
            (model / f.name).write_bytes(f.read_bytes())
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        free_port(), vllm={"model": str(model)},
        restart={"budget_failures": 2, "backoff_initial": 0.2}))
    rc, d = run_to_exit(cfg, tmp_path, 240)
    assert rc == 75
    record("crash_loop_to_75", d.seconds, budget_failures=2)  # type: ignore[attr-defined]
    exits = [e for e in d.events if e.get("event") == "child_exited"]
    assert len(exits) == 2 and all(e["code"] == 1 and e["cause"] == "crash" for e in exits)
    # child_exited is logged the moment the exit is seen; vLLM's last lines may still be on
    # their way, and the verdict made from the full tail (exit_classified) then replaces it
    first = d.events.index(exits[0])
    final = d.event("exit_classified", first) or exits[0]
    if d.events.index(final) > d.events.index(exits[1]):
        final = exits[0]
    assert "NoSuchModelForCausalLM" in final["detail"], final
    assert d.notified("READY=1") is None


def test_broken_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path / "q.toml", cpu_config(free_port(), watch={"hang_timeout": -5}))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "qwen4090", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO / "daemon"), "PATH": "/usr/bin:/bin"})
    record("bad_config_to_78", time.monotonic() - t0)
    assert proc.returncode == 78
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("<3>") and "watch.hang_timeout" in lines[0]
    assert str(cfg) in lines[0] and "found -5" in lines[0]


def test_missing_model_dir_exits_78_without_starting_vllm(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        free_port(), vllm={"model": str(tmp_path / "absent")}))
    rc, d = run_to_exit(cfg, tmp_path, 60)
    assert rc == 78
    assert d.event("child_spawned") is None
    final = d.event("giving_up")
    assert final is not None and "vllm.model" in final["reason"]


def test_sigterm_while_loading_stops_without_ready(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path / "q.toml", cpu_config(free_port()))
    d = Daemon(cfg, tmp_path)
    try:
        d.wait_state("loading", 60)
        d.descendants()
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
        assert d.notified("READY=1") is None and d.notified("STOPPING=1")
        assert d.survivors() == []
    finally:
        d.close()
