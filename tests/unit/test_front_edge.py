"""The client port as the edge (issue 28): what a hostile or careless client can reach and
what it can cost, against the front with a scripted upstream on loopback.  The same behaviours
against the real CPU vLLM under the real supervisor: tests/integration/test_edge.py."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import socket
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tests.support.attacks import call
from tests.support.fakes import Log
from tests.support.upstream import Later, Upstream, make_front, request, upstream, wait_until

from qwen4090.base.fdlimit import FD_RESERVE
from qwen4090.base.steering import Serve
from qwen4090.engine import frontlimits
from qwen4090.engine.front import Front
from qwen4090.engine.frontlimits import LINGER_MAX, LINGER_MIN, Limits, LineQuota, limits_of
from qwen4090.settings.config import FrontConfig

__all__ = ["upstream"]  # the fixture, imported for pytest


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection; everything the front answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def metrics(f: Front) -> str:
    registry = CollectorRegistry()
    f.register(registry)
    return generate_latest(registry).decode()


# --- 28.1: one path, one decision -----------------------------------------------------------


def test_the_engine_gets_exactly_the_target_decided_on(upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        for target, raw in (("/v1/%63ompletions", "/v1/completions"),
                            ("/v1/completions/", "/v1/completions"),
                            ("/v1/completions?a=%2e%2e/b", "/v1/completions?a=%2e%2e/b")):
            status, _, _ = call(f.listen[1], "POST", target, b"{}")
            assert status == 200, target
            assert upstream.seen[-1]["raw"] == raw, (target, upstream.seen[-1])
        for target in ("/./pause?mode=abort", "/v1/../collective_rpc", "//sleep",
                       "/%2e/server_info", "/v1/..%2fsleep", "/SLEEP", "/sleep/"):
            status, _, body = call(f.listen[1], "POST", target, b"{}")
            assert status in (400, 404), (target, status)
            assert json.loads(body)["error"]["message"], target
        assert len(upstream.seen) == 3  # none of the refused reached the engine
        text = metrics(f)
        assert 'qwen4090_front_rejected_total{reason="bad_target"}' in text
    finally:
        f.stop()


def test_with_a_key_every_path_but_health_needs_it_at_the_front(upstream: Upstream) -> None:
    f = Front(("127.0.0.1", _free()), ("127.0.0.1", upstream.port), Limits(hold_timeout=5),
              Log(), key="s3cret", engine_up=True)
    f.start()
    try:
        for path in ("/v1/completions", "/v1/models", "/tokenize", "/metrics", "/version",
                     "/invocations", "/pooling"):
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, _, body = call(f.listen[1], "POST", path, b"{}", auth)
                assert status == 401, (path, auth)
                assert json.loads(body)["error"]["type"] == "invalid_api_key"
        assert upstream.seen == []
        assert call(f.listen[1], "GET", "/health")[0] == 200
        assert call(f.listen[1], "POST", "/v1/completions", b"{}",
                    {"Authorization": "Bearer s3cret"})[0] == 200
        assert [s["path"] for s in upstream.seen] == ["/health", "/v1/completions"]
        assert f.status()["front"]["rejected"]["unauthorized"] == 21
    finally:
        f.stop()


# --- 28.2: bounded cost per client and in all ----------------------------------------------


def test_past_max_connections_a_503_is_written_and_read_never_a_reset(upstream: Upstream
                                                                    ) -> None:
    f = make_front(upstream, max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", f.listen[1])) for _ in range(3)]
    try:
        assert wait_until(lambda: f.sample().connections == 3)
        # the client sends its whole request first: a close with it unread would be a reset
        answer = raw_exchange(f.listen[1], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Length: 2\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"Retry-After: 5" in answer and b"front.max_connections" in answer
        assert upstream.seen == []
        assert 'qwen4090_front_shed_total{limit="max_connections"} 1.0' in metrics(f)
        assert "front.max_connections" in f.sample().shedding  # STATUS says it
        for s in idle:
            s.close()
        assert wait_until(lambda: f.sample().connections == 0)
        assert request(f.listen[1])[0] == 200
        assert f.log.named("front_shedding")[0]["limit"] == "front.max_connections"
    finally:
        for s in idle:
            s.close()
        f.stop()


def test_a_head_that_does_not_come_within_header_timeout_gets_408(upstream: Upstream) -> None:
    f = make_front(upstream, header_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", f.listen[1]), timeout=10) as slow, \
                socket.create_connection(("127.0.0.1", f.listen[1]), timeout=10) as idle:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            t0 = time.monotonic()
            answer = b""
            while chunk := slow.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"front.header_timeout" in answer
            assert idle.recv(4096) == b""  # an idle connection is closed without a word
            assert time.monotonic() - t0 < 5
        assert f.status()["front"]["rejected"]["header_timeout"] == 1
        assert request(f.listen[1])[0] == 200  # real clients are not slowed
    finally:
        f.stop()


def test_past_max_held_a_503_at_once(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=30.0, max_held=2)
    try:
        held = [Later(f.listen[1]) for _ in range(2)]
        assert wait_until(lambda: f.sample().holding == 2)
        t0 = time.monotonic()
        status, headers, body = request(f.listen[1])
        assert status == 503 and headers["retry-after"] == "5"
        assert "front.max_held" in json.loads(body)["error"]["message"]
        assert time.monotonic() - t0 < 5
        f.command(Serve(*f.engine, 1))
        assert [h.get()[0] for h in held] == [200, 200]
        assert 'qwen4090_front_shed_total{limit="max_held"} 1.0' in metrics(f)
    finally:
        f.stop()


def test_request_bodies_in_memory_are_bounded_in_all_and_each(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=30.0, body_budget=3000, max_body=2000)
    try:
        big = b'{"prompt": "' + b"x" * 1500 + b'"}'
        first = Later(f.listen[1])  # a small one held
        assert wait_until(lambda: f.sample().holding == 1)
        conn = http.client.HTTPConnection("127.0.0.1", f.listen[1], timeout=10)
        conn.request("POST", "/v1/completions", body=big)  # held too: 1500+ bytes in memory
        assert wait_until(lambda: f.sample().holding == 2)
        status, headers, body = call(f.listen[1], "POST", "/v1/completions", big)
        assert status == 503 and "front.body_budget_mib" in body.decode()
        assert headers["retry-after"] == "5"
        status, _, body = call(f.listen[1], "POST", "/v1/completions", b"x" * 2500)
        assert status == 413 and "front.max_body_mib" in body.decode()
        assert f.status()["front"]["body_bytes"] > 1500
        f.command(Serve(*f.engine, 1))
        assert first.get()[0] == 200 and conn.getresponse().status == 200
        conn.close()
        assert wait_until(lambda: f.status()["front"]["body_bytes"] == 0)
    finally:
        f.stop()


def test_a_compressed_body_passes_as_sent_and_is_never_inflated(upstream: Upstream) -> None:
    bomb = gzip.compress(b"0" * (8 << 20))  # 8 MiB of zeros in about 8 KiB
    f = make_front(upstream, max_body=1 << 20, body_budget=1 << 20)
    try:
        status, _, _ = call(f.listen[1], "POST", "/v1/completions", bomb,
                            {"Content-Encoding": "gzip"})
        assert status == 200  # the stand-in engine does not read JSON from it
        assert upstream.seen[-1]["raw_body"] == bomb
    finally:
        f.stop()


def test_the_connection_cap_stays_below_the_file_limit() -> None:
    f = FrontConfig(max_connections=1024)
    shipped = limits_of(f, 65536)
    assert shipped.max_connections == 1024 and shipped.linger_max == LINGER_MAX
    small = limits_of(f, 1024)
    assert small.max_connections == (1024 - FD_RESERVE - LINGER_MIN) // 2
    assert small.configured_connections == 1024 and small.fd_limit == 1024
    assert small.linger_max == LINGER_MIN
    # every file is counted: the cap's two per connection, the linger's one, the reserve
    for limit in (400, 1024, 4096, 65536):
        lim = limits_of(f, limit)
        assert 2 * lim.max_connections + lim.linger_max + FD_RESERVE <= limit, limit
    assert limits_of(f, None).max_connections == 1024


# --- 28.4: reloaded limits reach held requests ----------------------------------------------


def test_a_shorter_hold_timeout_ends_the_holds_already_past_it(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=120.0)
    try:
        held = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        time.sleep(1.5)
        t0 = time.monotonic()
        f.configure(Limits(hold_timeout=1.0), None)
        status, _, body = held.get(10)
        assert status == 503 and "front.hold_timeout = 1s" in body.decode()
        assert time.monotonic() - t0 < 3
        assert f.log.named("front_reconfigured")[0]["hold_timeout"] == 1.0
    finally:
        f.stop()


# --- 28.6: every line structured ------------------------------------------------------------


@pytest.mark.parametrize("garbage", [
    b"GARBAGE\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nxx\r\n0\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    # a head past MAX_HEAD (64 KiB): 431 from the front whatever aiohttp's own bounds (3.8,
    # Debian 12's, parsed and forwarded 20,000 fields)
    b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"y" * 50)
                                              for i in range(2000)) + b"\r\n",
])
def test_malformed_requests_get_400_and_at_most_a_structured_line(
        upstream: Upstream, garbage: bytes, capfd: pytest.CaptureFixture[str]) -> None:
    f = make_front(upstream)
    try:
        answer = raw_exchange(f.listen[1], garbage)
        assert re.match(rb"HTTP/1\.[01] 4\d\d ", answer), answer[:80]
        assert upstream.seen == []
        assert request(f.listen[1])[0] == 200  # the front is still up
    finally:
        f.stop()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Error handling request" not in out + err
    said = [e for e in f.log.events if e[1].startswith("front_") and e[1] not in (
        "front_listening",)]
    assert len(said) <= 1, said
    for _level, _event, fields in said:
        assert "\n" not in json.dumps(fields), fields


def test_a_fault_of_ours_is_one_error_line_and_a_500(upstream: Upstream,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    f = make_front(upstream)

    async def broken(request: Any) -> Any:
        raise ValueError("a bug\nover two lines")

    f._admit = broken  # type: ignore[method-assign]
    try:
        status, _, _ = call(f.listen[1], "GET", "/v1/models")
        assert status == 500
    finally:
        f.stop()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    errors = [(lvl, fields) for lvl, e, fields in f.log.events if e == "front_error"]
    assert len(errors) == 1 and errors[0][0] == "error", f.log.events
    assert "ValueError: a bug over two lines" in errors[0][1]["error"]


def test_a_flood_of_lines_costs_the_journal_a_few_and_a_count() -> None:
    now = [0.0]
    q = LineQuota(lines=3, window=10.0, clock=lambda: now[0])
    assert [q.take() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 10.5
    assert q.take() == 2  # the next line says how many were dropped


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_status_says_while_a_limit_refuses_clients() -> None:
    from qwen4090.base.states import State
    from qwen4090.decide.results import FrontSample
    from qwen4090.parts import statusline
    from qwen4090.settings.config import VllmConfig

    def line(shedding: str) -> str:
        front = FrontSample(0, 0, 0, 0.0, 0, True, False, shedding=shedding)
        return statusline.render(statusline.Facts(
            State.READY, "warmed up", 5.0, VllmConfig(), 0, None, 1, 5.0, "", None, "", 0, 3,
            "", "127.0.0.1:8000", "", front=front))

    assert "refusing" not in line("")
    assert line("refusing clients: 7 over front.max_connections").endswith(
        "; refusing clients: 7 over front.max_connections")


@pytest.mark.parametrize("split", [None, 3, 1000])
def test_a_large_body_sent_right_behind_its_head_is_not_a_large_head(
        upstream: Upstream, split: int | None) -> None:
    # the soak's tokenizer-heavy request (issue 30.3): a 400 KB text prompt sent in one write
    # with its head got 431 "head larger than 64 KiB" -- the body arrived before the handler
    # had started, and every byte counted as head.  ``split``: the blank line cut across two
    # writes at this offset from its start (None: one write)
    f = make_front(upstream)
    try:
        body = json.dumps({"model": "m", "prompt": "w " * 200_000}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        with socket.create_connection(("127.0.0.1", f.listen[1]), timeout=10) as s:
            if split is None:
                s.sendall(head + body)
            else:
                at = len(head) - 4 + min(split, 3)
                s.sendall(head[:at])
                time.sleep(0.05)
                s.sendall(head[at:] + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert len(upstream.seen) == 1
    finally:
        f.stop()


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = b"", False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


@pytest.mark.parametrize("sent,timed_out", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", True)])
def test_only_a_head_still_coming_is_timed_not_one_waiting_for_its_handler(
        sent: bytes, timed_out: bool) -> None:
    # the CPU soak (issue 30.3): on a starved box, requests whose heads had come whole got
    # 408 because their handler had not started within header_timeout of the connection
    now = [0.0]
    rejected: list[str] = []
    doors = frontlimits.Doors(lambda: frontlimits.Limits(header_timeout=10.0),
                              lambda limit: None, rejected.append, lambda: now[0])
    door = doors.protocol(asyncio.Protocol)()
    t = _Transport()
    door.connection_made(t)
    door.data_received(sent)
    now[0] = 11.0
    doors.sweep()
    assert t.closed is timed_out and (b" 408 " in t.written) is timed_out
    assert rejected == (["header_timeout"] if timed_out else [])
