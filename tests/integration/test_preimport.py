"""restart.preimport on the real supervisor and the real CPU vLLM: the interpreter started beside
a spawn (so that it has imported by READY, issue 18.7) becomes the next vLLM after a fault soon
after READY, a new one is started at the relaunch, and none is left behind at the stop."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests.support.clients import http_get, metrics_value, record
from tests.support.daemon import Daemon
from tests.support.runtime import API_SERVER, cpu_config, free_port, write_toml


def complete(port: int) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def index(d: Daemon, name: str, after: int = 0) -> int:
    """Where the first ``name`` event after ``after`` is in the daemon's log (waited for: the
    log reader may not have it yet)."""
    d.wait_event(name, 30, after)
    return next(i for i, ev in enumerate(d.events) if i >= after and ev.get("event") == name)


def test_the_next_vllm_starts_in_the_preimported_interpreter(tmp_path: Path) -> None:
    port, status_port = free_port(), free_port()
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        port, restart={"preimport": True, "backoff_initial": 0.2},
        status={"enabled": True, "host": "127.0.0.1", "port": status_port},
        gpu={"enabled": "off", "state_directory": str(tmp_path / "state")}))
    d = Daemon(cfg, tmp_path, port=port)
    try:
        d.wait_state("ready", 300)
        first = d.wait_event("startup_timeline", 10)
        started = d.wait_event("preimport_started", 30)
        zygote = int(started["pid"])
        assert started["module"] == API_SERVER and zygote != d.last_child_pid()
        assert os.getpgid(zygote) == zygote  # its own group, like every vLLM child
        # started beside the loading vLLM, not at READY (a fault soon after READY found it
        # still importing for 14-20 s on the H200)
        assert index(d, "preimport_started") < index(d, "ready_notified")
        assert d.wait_preimported(120) == zygote  # imported, waiting for vLLM's arguments
        # where a sysadmin looks: /status and /metrics of the status endpoint
        shown = json.loads(http_get(status_port, "/status")[1])["preimport"]
        assert shown["pid"] == zygote and shown["rss_bytes"] > 0
        assert metrics_value(status_port, "qwen4090_preimport_ready") == 1.0

        mark = d.mark()
        os.kill(d.engine_core().pid, signal.SIGKILL)
        used = d.wait_event("preimport_used", 60, after=mark)
        assert used["pid"] == zygote
        spawned = d.wait_event("child_spawned", 10, after=mark)
        assert spawned["pid"] == zygote  # the relaunch is the waiting interpreter
        d.wait_event("recovery_timeline", 300, after=mark)
        assert d.state() == "ready"
        # its own line, among vLLM's, says the imports were done before the fault
        assert any(str(ev.get("event", "")).startswith("qwen4090-preimport: "
                                                       f"{API_SERVER} imported in")
                   for ev in d.events[mark:]), d.where()
        second = d.event("startup_timeline", after=mark)
        assert second is not None and second["outcome"] == "ready"
        record("preimport_api_up", second["at"]["api_up"], before=first["at"]["api_up"],
               first_output_before=first["at"]["first_output"],
               first_output_after=second["at"]["first_output"])
        assert complete(port)["choices"][0]["text"] is not None

        # the relaunch starts a new one beside it, before its READY
        again = d.wait_event("preimport_started", 30, after=mark)
        successor = int(again["pid"])
        assert successor not in (zygote, d.last_child_pid()) and alive(successor)
        # (recovery_timeline is logged at the relaunch's READY)
        assert index(d, "preimport_started", mark) < index(d, "recovery_timeline", mark)

        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
        deadline = time.monotonic() + 10
        while alive(successor) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(successor) and not alive(zygote)
        assert d.event("preimport_discarded", after=mark, reason="stopping") is not None
    finally:
        d.close()
