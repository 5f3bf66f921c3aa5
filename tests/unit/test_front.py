"""The front's data path against a scripted upstream on loopback (front.py): pass-through,
hold, replay, the stream's error event, drain and refuse.  The proof with the real vLLM under
the real supervisor is tests/integration/test_front.py."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from test_supervisor import Harness
from tests.support.fakes import Log
from tests.support.upstream import (
    Later,
    Upstream,
    free_port,
    make_front,
    request,
    upstream,
    wait_until,
)

from qwen4090.base.states import State
from qwen4090.base.steering import Drain, Hold, Refuse, Serve
from qwen4090.engine import front as front_mod
from qwen4090.engine.front import Front
from qwen4090.engine.frontlimits import Limits

__all__ = ["upstream"]  # the fixture, imported for pytest


def test_answers_and_streams_pass_through_with_their_headers(upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        status, _, body = request(f.listen[1])
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "hello"
        status, headers, body = request(f.listen[1], stream=True)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
        assert b"error" not in body
        assert [s["auth"] for s in upstream.seen] == ["Bearer k", "Bearer k"]  # the API key
        assert wait_until(lambda: f.sample().in_flight == 0)  # its handler returns just after
        s = f.sample()
        assert (s.in_flight, s.holding, s.unanswered) == (0, 0, 0)
        assert s.bytes_from_engine > 0 and f.totals.requests == 2 and f.totals.held == 0
    finally:
        f.stop()


def test_a_request_waits_for_the_engine_and_is_answered_when_it_serves(upstream: Upstream
                                                                        ) -> None:
    f = make_front(upstream, up=False)
    try:
        later = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        time.sleep(0.3)
        assert later.result is None and upstream.seen == []  # held, not refused
        f.command(Serve(*f.engine, 1))
        status, _, _ = later.get()
        assert status == 200 and f.totals.held == 1 and f.totals.queue_seconds >= 0.3
        assert f.sample().holding == 0
    finally:
        f.stop()


def test_past_hold_timeout_a_503_with_retry_after(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=0.4)
    try:
        t0 = time.monotonic()
        status, headers, body = request(f.listen[1])
        assert status == 503 and headers["retry-after"] == str(front_mod.RETRY_AFTER)
        assert json.loads(body)["error"]["type"] == "engine_unavailable"
        assert "front.hold_timeout" in json.loads(body)["error"]["message"]
        assert time.monotonic() - t0 >= 0.4 and f.totals.hold_timeouts == 1
    finally:
        f.stop()


def test_a_request_whose_engine_died_before_answering_is_replayed_on_the_next(
        upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "die"
        later = Later(f.listen[1])
        # sent, and at once again on a new connection (nobody declared the engine dead yet)
        assert wait_until(lambda: len(upstream.seen) == 2)
        # the verdict comes within the grace: the request waits for the NEXT engine, not the
        # one that failed it
        f.command(Hold("crash"))
        assert wait_until(lambda: f.sample().holding == 1)
        upstream.mode = "ok"
        time.sleep(0.1)
        assert len(upstream.seen) == 2
        f.command(Serve(*f.engine, 2))
        status, _, body = later.get()
        assert status == 200 and json.loads(body)["n"] == 3
        assert len(upstream.seen) == 3 and f.totals.retried == 1
        assert f.totals.replayed == 1 and f.totals.failed == 0
    finally:
        f.stop()


def test_a_connection_closed_unanswered_on_a_live_engine_is_retried_at_once_on_a_new_one(
        upstream: Upstream) -> None:
    # An idle connection vLLM's server closes (uvicorn's keep-alive timeout) just as a request
    # goes out on it fails like a dead engine.  Nobody declares this engine dead, so waiting for
    # the next one would hold the request for hold_timeout and answer 503 (a CI run had a
    # stream held so on a healthy engine).
    f = make_front(upstream, hold=30.0)
    try:
        upstream.mode = "die-once"
        status, _, body = request(f.listen[1])
        assert status == 200 and json.loads(body)["n"] == 2
        first, second = (s["peer"] for s in upstream.seen)
        assert first != second  # a new connection, not another pooled one
        assert (f.totals.retried, f.totals.replayed, f.totals.held, f.totals.failed) == \
            (1, 0, 0, 0)
        # the engine that really died fails the retry too: replayed on the next (above)
    finally:
        f.stop()


def test_an_engine_nobody_declared_dead_is_retried_until_hold_timeout_then_a_503(
        upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    # its connections fail (a machine too busy to connect in time), yet it serves: each retry
    # after a grace without a verdict, never a wait for a next engine that will not come
    monkeypatch.setattr(front_mod, "REPLAY_GRACE", 0.2)
    f = make_front(upstream, hold=1.5)
    try:
        upstream.mode = "die"
        t0 = time.monotonic()
        status, headers, body = request(f.listen[1])
        waited = time.monotonic() - t0
        assert status == 503 and headers["retry-after"] == str(front_mod.RETRY_AFTER)
        error = json.loads(body)["error"]
        assert error["type"] == "engine_unavailable" and "could not be reached" in error["message"]
        assert "front.hold_timeout = 1.5s" in error["message"]
        assert waited >= 1.5 and len(upstream.seen) >= 5, (waited, len(upstream.seen))
        assert f.totals.retried == len(upstream.seen) - 1 and f.totals.replayed == 0
        assert f.totals.held == 0 and f.totals.failed == 1
    finally:
        f.stop()


def test_an_idle_connection_is_not_reused_past_keepalive(upstream: Upstream,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # below vLLM's server keep-alive (5 s): the front closes first, so it never sends on a
    # connection the server is closing
    assert front_mod.KEEPALIVE < 5.0
    monkeypatch.setattr(front_mod, "KEEPALIVE", 0.3)
    f = make_front(upstream)
    try:
        for pause in (0.0, 0.0, 0.6):
            time.sleep(pause)
            assert request(f.listen[1])[0] == 200
        peers = [s["peer"] for s in upstream.seen]
        assert peers[0] == peers[1] and peers[2] != peers[1], peers
    finally:
        f.stop()


def test_replayed_only_once(upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "die"
        later = Later(f.listen[1])
        assert wait_until(lambda: len(upstream.seen) == 2)
        f.command(Hold("crash"))
        assert wait_until(lambda: f.sample().holding == 1)
        f.command(Serve(*f.engine, 2))
        # the replay, and its retry on a new connection; then that engine is declared dead too
        assert wait_until(lambda: len(upstream.seen) == 4)
        f.command(Hold("crash again"))
        status, _, body = later.get()
        assert status == 502 and json.loads(body)["error"]["type"] == "engine_failed"
        assert len(upstream.seen) == 4 and f.totals.retried == 2
        assert f.totals.replayed == 1 and f.totals.failed == 1
    finally:
        f.stop()


def test_a_5xx_of_an_engine_declared_dead_is_replayed_any_other_passes(
        upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front_mod, "REPLAY_GRACE", 0.5)
    f = make_front(upstream)
    try:
        upstream.mode = "500"
        status, _, _ = request(f.listen[1])
        assert status == 500 and f.totals.replayed == 0  # nobody declared the engine dead
        later = Later(f.listen[1])
        assert wait_until(lambda: len(upstream.seen) == 2)
        upstream.mode = "ok"
        f.command(Hold("engine died"))
        f.command(Serve(*f.engine, 2))
        status, _, _ = later.get()
        assert status == 200 and f.totals.replayed == 1
    finally:
        f.stop()


def test_a_started_stream_that_is_cut_ends_with_an_error_event(upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "cut"
        status, _, body = request(f.listen[1], stream=True)
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 3 and b"[DONE]" not in body
        err = json.loads(events[-1][len(b"data: "):])["error"]
        assert err["type"] == "engine_restarted" and err["code"] == 503
        assert f.totals.stream_errors == 1 and len(upstream.seen) == 1  # never replayed
    finally:
        f.stop()


def test_a_stream_vllm_aborted_gets_the_error_event_before_its_done(upstream: Upstream
                                                                    ) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "abort"
        status, _, body = request(f.listen[1], stream=True)
        events = [e for e in body.split(b"\n\n") if e]
        assert status == 200 and events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][len(b"data: "):])["error"]["type"] == "engine_restarted"
        assert b"abort" in events[-3] and f.totals.stream_errors == 1
    finally:
        f.stop()


def test_drain_lets_requests_in_flight_finish_and_takes_no_new_ones(upstream: Upstream
                                                                     ) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "slow"
        later = Later(f.listen[1], stream=True)
        assert wait_until(lambda: f.sample().in_flight == 1 and f.sample().bytes_from_engine)
        f.command(Drain())
        assert wait_until(lambda: f.sample().draining)
        with pytest.raises(ConnectionRefusedError):
            wait_until(lambda: False, 0.2)
            request(f.listen[1])
        status, _, body = later.get()
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert wait_until(lambda: f.sample().in_flight == 0)  # its handler returns just after
    finally:
        f.stop()


def test_refuse_answers_held_requests_at_once(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=30.0)
    try:
        later = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        t0 = time.monotonic()
        f.command(Refuse("crash loop"))
        status, _, body = later.get(5)
        assert status == 503 and "gave up: crash loop" in json.loads(body)["error"]["message"]
        assert time.monotonic() - t0 < 5 and upstream.seen == []
    finally:
        f.stop()


def test_unanswered_requests_are_counted_for_the_hang_detector(upstream: Upstream) -> None:
    f = make_front(upstream)
    try:
        upstream.mode = "stuck"
        Later(f.listen[1])
        assert wait_until(lambda: f.sample().unanswered == 1)
        time.sleep(0.3)
        s = f.sample()
        assert s.oldest_unanswered >= 0.3 and s.in_flight == 1 and s.holding == 0
    finally:
        f.stop()


def test_steered_by_typed_commands_that_name_the_engine(upstream: Upstream) -> None:
    """Issue 29.4: the supervisor tells the front which engine serves (no guess from its
    states): Serve opens it on that engine, the same engine again is no news (no new
    generation), Hold closes it, Drain stops taking requests."""
    f = make_front(upstream, up=False, hold=30.0)
    try:
        later = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        f.command(Serve(*f.engine, 101))
        assert later.get()[0] == 200
        gen = f._gen
        f.command(Serve(*f.engine, 101))  # serving again (after DEGRADED): the same engine
        assert request(f.listen[1])[0] == 200 and f._gen == gen
        f.command(Hold("hang", 101))
        assert wait_until(lambda: not f.sample().open)
        f.command(Serve(*f.engine, 102))  # the next engine: a new generation
        assert wait_until(lambda: f.sample().open) and f._gen == gen + 1
        f.command(Drain())
        assert wait_until(lambda: f.sample().draining)
    finally:
        f.stop()


def test_counts_reach_metrics_and_status(upstream: Upstream) -> None:
    f = make_front(upstream, up=False, hold=0.2)
    try:
        assert request(f.listen[1])[0] == 503
        registry = CollectorRegistry()
        f.register(registry)
        text = generate_latest(registry).decode()
        assert "qwen4090_front_hold_timeouts_total 1.0" in text
        assert 'qwen4090_front_queue_seconds_bucket{le="+Inf"} 1.0' in text
        assert f.status()["front"]["hold_timeouts"] == 1
    finally:
        f.stop()


def test_a_taken_port_is_an_oserror(upstream: Upstream) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        f = Front(("127.0.0.1", s.getsockname()[1]), ("127.0.0.1", upstream.port),
                  Limits(hold_timeout=1.0), Log())
        with pytest.raises(OSError):
            f.start()


def test_open_front_waits_for_a_taken_client_port_then_says_who_holds_it() -> None:
    from qwen4090.commandline import cli
    from qwen4090.settings.config import from_dict

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        log = Log()
        cfg = from_dict({"vllm": {"port": port}, "restart": {"port_wait": 1.0}})
        extended: list[float] = []
        t0 = time.monotonic()
        assert cli.open_front(cfg, log, extended.append, lambda: False,
                              sleep=lambda t: time.sleep(0.2)) is None
        assert time.monotonic() - t0 >= 1.0 and extended  # systemd's start timeout extended
        assert [e for _, e, _ in log.events] == ["front_port_wait", "front_port_busy"]
        busy = log.named("front_port_busy")[0]
        assert busy["port"] == f"127.0.0.1:{port}" and "pid" in busy["holder"]
    # freed: it binds
    door = cli.open_front(cfg, log, extended.append, lambda: False)
    assert isinstance(door, Front)
    door.stop()
    off = cli.open_front(from_dict({"front": {"enabled": False}}), log, extended.append,
                         lambda: False)
    assert off is not None and off.sample() is None


def test_pointed_at_the_standby_the_next_engine_gets_the_requests(upstream: Upstream) -> None:
    """A failover (issue 21): the front is pointed at the standby's port, then opened."""
    other = Upstream()
    f = make_front(upstream)
    try:
        before = time.monotonic()
        assert request(f.listen[1])[0] == 200 and len(upstream.seen) == 1
        seen = f.sample().last_byte_at  # the hang detector dates a stall from it
        assert seen is not None and seen >= before
        f.command(Hold("engine_dead"))
        later = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        f.command(Serve("127.0.0.1", other.port, 2))  # the standby, named by its pid
        assert later.get()[0] == 200
        assert len(upstream.seen) == 1 and len(other.seen) == 1  # held, then to the standby
        assert "front_engine_moved" in f.log.names()
    finally:
        f.stop()
        other.close()


def test_vllm_development_endpoints_are_not_served_to_clients(upstream: Upstream) -> None:
    """With restart.standby = "sleep" vLLM runs with VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up,
    /collective_rpc ... exist on the engine; a client must not put it to sleep."""
    f = make_front(upstream)
    try:
        for path in ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache"):
            conn = http.client.HTTPConnection("127.0.0.1", f.listen[1], timeout=10)
            conn.request("POST", path + "?level=1", body=b"{}")
            r = conn.getresponse()
            assert r.status == 404, path
            assert b"not served on the client port" in r.read()
            conn.close()
        assert upstream.seen == []
        assert request(f.listen[1])[0] == 200  # the API itself passes
    finally:
        f.stop()


def test_the_supervisor_steers_a_real_front_by_its_commands(upstream: Upstream) -> None:
    """The joint (issue 29.4): the state machine's commands reach a real front.  Its engine
    address starts wrong on purpose: only the supervisor's Serve points it at the engine."""
    f = Front(("127.0.0.1", free_port()), ("127.0.0.1", 9), Limits(hold_timeout=30.0), Log())
    f.start()
    try:
        h = Harness({"front": {"enabled": True, "engine_port": upstream.port}}, front=f)
        later = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        h.run_until(State.READY)
        assert later.get()[0] == 200 and f.engine == ("127.0.0.1", upstream.port)
        h.child.exit(1)  # a crash: the front holds from the supervisor's Hold
        h.step()
        assert h.sup.state is State.RESTARTING and wait_until(lambda: not f.sample().open)
        held = Later(f.listen[1])
        assert wait_until(lambda: f.sample().holding == 1)
        h.run_until(State.READY)  # the next engine (a new pid): served, the held one answered
        assert held.get()[0] == 200
        h.sup.inbox.deliver(signal.SIGTERM)
        h.step()
        assert wait_until(lambda: f.sample().draining)
    finally:
        f.stop()


def test_requests_are_counted_and_routed_by_engine(upstream: Upstream) -> None:
    """Issue 29.4: the front counts requests per engine (by the name Serve gave it): a stream
    sent to the first engine stays that one's after the next is named, and new requests go to
    the next."""
    other = Upstream()
    f = make_front(upstream, up=False, hold=30.0)
    try:
        f.command(Serve(*f.engine, 101))
        upstream.mode = "slow"  # a stream of 1 s on engine 101
        slow = Later(f.listen[1], stream=True)
        assert wait_until(lambda: dict(f.sample().by_engine) == {"101": 1})
        f.command(Serve("127.0.0.1", other.port, 102))  # (a failover, without the Hold)
        assert wait_until(lambda: f.status()["front"]["engine"].endswith(str(other.port)))
        assert request(f.listen[1])[0] == 200 and len(other.seen) == 1  # new: to 102
        assert dict(f.sample().by_engine) == {"101": 1}  # the stream is still 101's
        status, _, body = slow.get()
        assert status == 200 and body.count(b"data: ") == 11 and len(upstream.seen) == 1
        assert wait_until(lambda: f.sample().by_engine == ())
        assert f.status()["front"]["by_engine"] == {}
    finally:
        f.stop()
        other.close()


def test_front_released_counts_a_replayed_requests_wait_from_its_arrival(upstream: Upstream
                                                                         ) -> None:
    # issue 30.6: a request in flight on an engine that hangs waits through the hang, is cut
    # when the engine is killed, then held and replayed; the journal's longest_wait is the
    # client's wait from its arrival (it counted from the replay: 0.54 s said for 62 s waited)
    f = make_front(upstream)
    try:
        upstream.mode = "hang-die"
        sent = time.monotonic()
        later = Later(f.listen[1])
        assert wait_until(lambda: len(upstream.seen) == 1)
        f.command(Hold("hang"))  # the verdict; the kill closes its connection (1 s after)
        assert wait_until(lambda: f.sample().holding == 1)
        upstream.mode = "ok"
        time.sleep(0.5)
        f.command(Serve(*f.engine, 2))
        status, _, _ = later.get()
        waited = time.monotonic() - sent
        assert status == 200 and f.totals.replayed == 1
        assert isinstance(f.log, Log)
        released = f.log.named("front_released")
        assert released and released[-1]["longest_wait"] >= 1.4  # held only ~0.5 s of it
        assert released[-1]["longest_wait"] <= waited + 0.05
    finally:
        f.stop()


def test_the_gaps_of_a_streamed_answer_are_the_engines_steps(upstream: Upstream) -> None:
    # mode "slow": ten chunks 0.1 s apart; the front keeps the longest gap between two chunks
    # of one answer (the hang bound follows it: issue 30.3), not the wait for the first one
    f = make_front(upstream)
    try:
        request(f.listen[1])  # not streamed: no gap
        assert f.sample().longest_gap is None
        upstream.mode = "slow"
        status, _, body = request(f.listen[1], stream=True)
        assert status == 200 and body.count(b"data: ") == 11
        gap = f.sample().longest_gap
        assert gap is not None and 0.08 <= gap < 1.0, gap
    finally:
        f.stop()


def test_gaps_are_a_sliding_window_maximum() -> None:
    g = front_mod.Gaps(10.0)
    assert g.longest(0.0) is None
    g.add(0.0, 2.0)
    g.add(1.0, 0.5)
    g.add(2.0, 1.0)
    assert g.longest(5.0) == 2.0
    assert g.longest(10.5) == 1.0  # the 2 s gap left the window; the 1 s one is the longest
    assert g.longest(12.5) is None
    g.add(20.0, 0.3)
    g.add(21.0, 0.4)
    assert g.longest(21.0) == 0.4 and len(g._q) == 1  # smaller, older gaps are dropped


def test_the_engine_surely_has_small_requests_and_answers_under_way(upstream: Upstream
                                                                    ) -> None:
    # a small request sent to a wedged engine is the engine's (at_engine), a 400 KB one may
    # still be in vLLM's tokenizer (not counted); both are in flight and unanswered
    upstream.mode = "stuck"
    f = make_front(upstream)
    try:
        small = Later(f.listen[1])
        assert wait_until(lambda: f.sample().unanswered == 1)
        assert f.sample().at_engine == 1
        big = Later(f.listen[1], body={"model": "m", "prompt": "w " * 200_000})
        assert wait_until(lambda: f.sample().unanswered == 2)
        s = f.sample()
        assert (s.in_flight, s.unanswered, s.at_engine) == (2, 2, 1)
        del small, big
    finally:
        f.stop()


def test_each_request_is_one_debug_line_with_the_clients_own_address(upstream: Upstream
                                                                     ) -> None:
    # issue 31.6: vLLM's access lines behind the front name only 127.0.0.1 and go at debug;
    # the front's line names the client, at debug too (off by default)
    f = make_front(upstream)
    try:
        assert request(f.listen[1])[0] == 200
        assert wait_until(lambda: f.log.named("request"))
        (line,) = f.log.named("request")
        levels = [lvl for lvl, e, _ in f.log.events if e == "request"]
        assert levels == ["debug"]
        assert line["client"] == "127.0.0.1" and line["method"] == "POST"
        assert line["path"] == "/v1/completions" and line["status"] == 200
        assert line["seconds"] >= 0
    finally:
        f.stop()

