"""Issue 28: the client port is the edge.  One real supervisor, its front on the client port, the
real CPU vLLM behind it with its development endpoints on (VLLM_SERVER_DEV_MODE=1, as
restart.standby = "sleep" turns them on) and an API key; the daemon starts with a soft file
limit of 400 under a hard one of 4096.  What a hostile or careless client tries:

- every spelling of the engine-only endpoints (the hole: ``/./pause?mode=abort`` paused vLLM);
- the paths vLLM's key does not guard (``/version``, ``/metrics``, ``/invocations`` ...);
- malformed requests (aiohttp's tracebacks on stderr, outside the journal's priorities);
- an outage: holds within front.max_held and the body bounds, STATUS and /metrics say so,
  and a reload of a shorter hold_timeout reaches the requests already held;
- a flood of connections past front.max_connections and past the starting soft file limit,
  with the engine killed in the middle: the daemon keeps serving, heals, exits 0 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import psutil
import pytest

from tests.support.attacks import call, spellings
from tests.support.clients import record
from tests.support.daemon import Daemon
from tests.support.runtime import REPO, cpu_config, cpu_vllm, free_port, write_toml

START_TIMEOUT = 240.0
RESTART_TIMEOUT = 240.0
KEY = "edge-test-key-28"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_HELD = 6
MAX_CONNECTIONS = 100
NOFILE = (400, 4096)  # soft, hard: the supervisor raises the soft one to the hard at start
FLOOD = 450  # connections kept open by the flood: past the cap, and past the soft limit


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("edge")
    key_file = tmp / "api_key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port, status_port = free_port(), free_port()
    env = {**cpu_vllm(port)["env"], "VLLM_SERVER_DEV_MODE": "1"}
    cfg = write_toml(tmp / "qwen4090.toml", cpu_config(
        port, vllm={"api_key_file": str(key_file), "env": env},
        front={"enabled": True, "engine_port": free_port(), "hold_timeout": 150.0,
               "max_held": MAX_HELD, "max_connections": MAX_CONNECTIONS,
               "header_timeout": 3.0, "max_body_mib": 0.5, "body_budget_mib": 1.0},
        status={"enabled": True, "port": status_port},
        watch={"poll_interval": 1.0, "hang_timeout": 8.0, "canary_interval": 5.0,
               "canary_timeout": 10.0, "unhealthy_timeout": 15.0}))
    (tmp / "conf.d").mkdir()
    d = Daemon(cfg, tmp, port=port, log_path=tmp / "daemon.log", nofile=NOFILE)
    d.status_port = status_port  # type: ignore[attr-defined]
    yield d
    d.close()


def complete(port: int, timeout: float = 120.0) -> tuple[int, bytes]:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
    status, _, data = call(port, "POST", "/v1/completions", body, AUTH, timeout)
    return status, data


def engine(d: Daemon) -> int:
    spawned = d.event("child_spawned")
    assert spawned is not None
    return int(re.search(r"--port (\d+)", spawned["argv"]).group(1))  # type: ignore[union-attr]


def status_doc(d: Daemon) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.status_port, timeout=10)  # type: ignore
    try:
        conn.request("GET", "/status")
        return dict(json.loads(conn.getresponse().read()))
    finally:
        conn.close()


def front_metrics(d: Daemon) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", d.status_port, timeout=10)  # type: ignore
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def wait(cond: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := cond():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def test_ready_with_the_soft_file_limit_raised(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    listening = daemon.event("front_listening")
    assert listening is not None and listening["api_key"] is True
    assert listening["max_connections"] == MAX_CONNECTIONS
    # prlimit exec'd the daemon: its pid is the daemon's
    assert psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (NOFILE[1],
                                                                             NOFILE[1])


def test_engine_only_endpoints_are_unreachable_in_every_spelling(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    port = engine(daemon)
    # the development endpoints are really there, on vLLM's own port
    status, _, body = call(port, "GET", "/is_paused")
    assert status == 200 and json.loads(body)["is_paused"] is False, body
    answers: Counter[int] = Counter()
    for path in ("/pause?mode=abort", "/sleep?level=1", "/server_info", "/collective_rpc",
                 "/reset_prefix_cache", "/is_paused", "/resume", "/start_profile"):
        name, _, query = path.partition("?")
        for target in spellings(name):
            if query and "?" not in target and "#" not in target:
                target += "?" + query
            for headers in ({}, AUTH):  # a key opens the API, never these
                status, _, body = call(daemon.port, "POST", target, b"{}", headers)
                answers[status] += 1
                assert status in (400, 404), (target, status, body[:200])
                assert json.loads(body)["error"]["code"] == status, (target, body)  # ours
    assert set(answers) <= {400, 404} and sum(answers.values()) > 300, answers
    status, _, body = call(port, "GET", "/is_paused")
    assert json.loads(body)["is_paused"] is False  # nothing paused it
    assert complete(daemon.port)[0] == 200
    text = front_metrics(daemon)
    assert re.search(r'qwen4090_front_rejected_total\{reason="bad_target"\} [1-9]', text)


def test_with_a_key_every_path_but_health_needs_it_at_the_front(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    for method, path in (("GET", "/version"), ("GET", "/metrics"), ("POST", "/tokenize"),
                         ("POST", "/invocations"), ("GET", "/v1/models"),
                         ("POST", "/v1/completions"), ("GET", "/load")):
        status, _, body = call(daemon.port, method, path, b"{}")
        assert status == 401, (path, status, body[:200])
        assert json.loads(body)["error"]["type"] == "invalid_api_key"
    assert call(daemon.port, "GET", "/health")[0] == 200
    status, _, body = call(daemon.port, "GET", "/version", headers=AUTH)
    assert status == 200 and b"version" in body


MALFORMED = [
    b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n"
    b"\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(300)) + b"\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: \x00\x01\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + os.urandom(64),  # TLS to a plain port
]


def test_malformed_requests_write_no_traceback_and_every_line_has_a_priority(
        daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    before = len(daemon.raw)
    for _ in range(3):
        for garbage in MALFORMED:
            with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s, \
                    contextlib.suppress(OSError):  # a reset after the 400 is the client's luck
                s.sendall(garbage)
                while s.recv(65536):
                    pass
    assert complete(daemon.port)[0] == 200
    time.sleep(1.0)  # the daemon's last lines reach its pipe
    lines = daemon.raw[before:]
    unprefixed = [ln for ln in lines if not re.match(r"<\d>", ln)]
    assert unprefixed == [], unprefixed[:20]
    assert not [ln for ln in lines if "Traceback" in ln], lines[:20]
    bad = [ev for ev in daemon.events if ev.get("event") == "front_bad_request"]
    assert 0 < len(bad) <= 3 * len(MALFORMED), len(bad)


def test_an_outage_is_held_within_its_limits_and_a_reload_reaches_the_held(
        daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    mark = daemon.mark()
    os.kill(daemon.engine_core().pid, signal.SIGKILL)
    daemon.wait_event("state_changed", 60, after=mark, to="restarting")
    results: list[tuple[int, bytes, float]] = []
    held = [threading.Thread(target=lambda: results.append(
        (*complete(daemon.port, 300), time.monotonic())), daemon=True)
        for _ in range(MAX_HELD)]
    for t in held:
        t.start()
    wait(lambda: status_doc(daemon)["front"]["holding"] == MAX_HELD, 30, "6 held requests")
    # one more would wait: 503 at once, with the key it names
    t0 = time.monotonic()
    status, headers, body = call(daemon.port, "POST", "/v1/completions", b"{}", AUTH, 30)
    assert status == 503 and headers["retry-after"] == "5", (status, body)
    assert b"front.max_held" in body and time.monotonic() - t0 < 10
    # a body past front.max_body_mib: 413, never read into memory whole
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                  b"Authorization: Bearer %s\r\n\r\n" % (600 << 10, KEY.encode()))
        answer = b""  # the body is never sent: the length alone is refused, and closed
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ") and b"front.max_body_mib" in answer, answer
    assert "refusing clients" in status_doc(daemon)["front"]["shedding"]
    wait(lambda: any("refusing clients" in s for s in daemon.statuses()), 30,
         "STATUS= saying that clients are refused")
    assert re.search(r'qwen4090_front_shed_total\{limit="max_held"\} [1-9]',
                     front_metrics(daemon))
    assert daemon.event("front_shedding", after=mark, limit="front.max_held") is not None
    # a reload of a shorter hold_timeout ends the holds already past it, before the engine
    # is back
    time.sleep(3.0)
    drop = daemon.tmp / "conf.d" / "50-hold.toml"
    drop.write_text("[front]\nhold_timeout = 2.0\n")
    reload_at = time.monotonic()
    daemon.signal(signal.SIGHUP)
    try:
        for t in held:
            t.join(60)
        assert len(results) == MAX_HELD, results
        for status, body, at in results:
            assert status == 503 and b"front.hold_timeout = 2s" in body, (status, body)
            assert at - reload_at < 20, at - reload_at
        ready = daemon.event("state_changed", after=mark, to="ready")
        assert ready is None or ready["_t"] > min(at for _, _, at in results)
    finally:
        drop.unlink()
        daemon.signal(signal.SIGHUP)
    daemon.wait_state("ready", RESTART_TIMEOUT, after=mark)
    assert complete(daemon.port)[0] == 200


class Flood:
    """tests/support/flood.py in a process of its own, until ``end()``."""

    def __init__(self, port: int, n: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.flood", str(port), str(n)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def end(self) -> Counter[str]:
        out, _ = self.proc.communicate("", timeout=120)  # stdin closed: the flood stops
        return Counter(json.loads(out))


def test_a_connection_flood_past_the_cap_with_the_engine_killed(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    mark = daemon.mark()
    flood = Flood(daemon.port, FLOOD)
    try:
        wait(lambda: status_doc(daemon)["front"]["connections"] >= MAX_CONNECTIONS - 5, 60,
             "the flood at the cap")
        killed_at = time.monotonic()
        os.kill(daemon.engine_core().pid, signal.SIGKILL)
        daemon.wait_event("state_changed", 60, after=mark, to="restarting")
        ready = daemon.wait_state("ready", RESTART_TIMEOUT, after=mark)
        time.sleep(3.0)
    finally:
        answers = flood.end()
    # _t: the time.monotonic() at which the line was read
    record("edge_flood", ready["_t"] - killed_at, answers=dict(answers),
           connections_cap=MAX_CONNECTIONS, flood=FLOOD)
    assert answers["HTTP/1.1 503"] > 0 and answers["HTTP/1.1 408"] > 0, answers
    resets = sum(n for what, n in answers.items() if not what.startswith("HTTP/1.1"))
    assert resets <= sum(answers.values()) // 100, answers  # the refusal is read, not a reset
    restarts = [ev for ev in daemon.events[mark:] if ev.get("event") == "state_changed"
                and ev.get("to") == "restarting"]
    assert len(restarts) == 1, restarts  # the kill, and no verdict of the flood's making
    # the cap kept the supervisor's own files in reach: it never even ran short
    for name in ("internal_error", "fd_pressure"):
        assert daemon.event(name, after=mark) is None, (name, daemon.event(name, after=mark))
    assert complete(daemon.port)[0] == 200
    assert re.search(r'qwen4090_front_shed_total\{limit="max_connections"\} [1-9]',
                     front_metrics(daemon))


def test_sigterm_after_all_of_it_exits_0(daemon: Daemon) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(120) == 0
