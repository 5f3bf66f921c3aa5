"""Issue 20: faults that clients do not see.  One real supervisor, its front on the client port
and the real CPU vLLM behind it, under a steady load of short requests (and a few long
streams) while the EngineCore is SIGKILLed, while it is SIGSTOPped (a hang), and across a
[vllm] reload: no client is refused, no request that arrived during the restart fails, the
unstarted ones are answered after a replay, and a stream that had started ends with the
error event.  Each test records what the clients saw (``record``) for docs/reliability.md.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.clients import record
from tests.support.daemon import Daemon
from tests.support.runtime import cpu_config, free_port, write_toml

START_TIMEOUT = 240.0
RESTART_TIMEOUT = 180.0
CLIENTS = 4  # client threads sending short requests back to back (CI has 2 cores)


@dataclass
class Outcome:
    sent: float
    ended: float
    status: int | None  # None: no HTTP answer (refused, reset)
    error: str = ""
    stream: bool = False
    body: bytes = b""


@dataclass
class Load:
    """``CLIENTS`` threads of short completions (4 tokens), back to back, plus ``streams`` long
    streamed ones started at once; every outcome is kept."""

    port: int
    streams: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    streaming: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    def start(self) -> Load:
        for i in range(CLIENTS):
            self.threads.append(threading.Thread(target=self.short, args=(i,), daemon=True))
        for i in range(self.streams):
            self.threads.append(threading.Thread(target=self.long, args=(i,), daemon=True))
        for t in self.threads:
            t.start()
        return self

    def finish(self, timeout: float = 200.0) -> list[Outcome]:
        self.stop.set()
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a client never returned"
        return self.outcomes

    def one(self, body: dict[str, Any], stream: bool) -> None:
        sent = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=RESTART_TIMEOUT)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if stream:  # line by line: the test injects its fault once every stream runs
                data = b""
                while line := r.readline():
                    data += line
                    if data.count(b"data: ") == 5:
                        self.streaming.release()
            else:
                data = r.read()
            out = Outcome(sent, 0.0, r.status, stream=stream, body=data)
        except OSError as e:
            out = Outcome(sent, 0.0, None, f"{type(e).__name__}: {e}", stream)
        finally:
            conn.close()
        out.ended = time.monotonic()
        with self.lock:
            self.outcomes.append(out)

    def wait_streaming(self, timeout: float = 60.0) -> None:
        """Every long stream has its first tokens."""
        for _ in range(self.streams):
            assert self.streaming.acquire(timeout=timeout), "a stream never started"

    def short(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            self.one({"model": "tiny", "prompt": [10 + (i * 31 + n) % 900] * 8,
                      "max_tokens": 4, "ignore_eos": True}, stream=False)

    def long(self, i: int) -> None:
        self.one({"model": "tiny", "prompt": [20 + i] * 16, "max_tokens": 2000,
                  "ignore_eos": True, "stream": True}, stream=True)


def summary(outcomes: list[Outcome], fault_at: float) -> dict[str, Any]:
    shorts = [o for o in outcomes if not o.stream]
    during = [o for o in shorts if o.sent >= fault_at]
    return {
        "requests": len(shorts),
        "refused_or_reset": sum(o.status is None for o in outcomes),
        "not_200": sum(o.status not in (200, None) for o in shorts),
        "sent_after_fault": len(during),
        "longest_wait_s": round(max((o.ended - o.sent for o in during), default=0.0), 1),
        "errors": sorted({o.error or str(o.status) for o in outcomes
                          if o.status != 200})[:5],
    }


def stream_endings(outcomes: list[Outcome]) -> list[str]:
    """How each long stream ended: "done", "error event", or "silent cut"."""
    out = []
    for o in outcomes:
        if not o.stream:
            continue
        events = [e for e in o.body.split(b"\n\n") if e.startswith(b"data: ")]
        errors = [e for e in events if e.startswith(b'data: {"error"')]
        if errors:  # vLLM's own (then [DONE]), or the front's when the stream was cut
            out.append("error event")
        elif events and events[-1] == b"data: [DONE]":
            out.append("done")
        else:
            out.append(f"silent cut ({o.status}, {o.error or len(o.body)})")
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("front")
    port = free_port()
    cfg = write_toml(tmp / "qwen4090.toml", cpu_config(
        port, front={"enabled": True, "engine_port": free_port(), "hold_timeout": 150.0},
        watch={"poll_interval": 1.0, "hang_timeout": 8.0, "canary_interval": 5.0,
               "canary_timeout": 10.0, "unhealthy_timeout": 15.0}))
    (tmp / "conf.d").mkdir()
    d = Daemon(cfg, tmp, port=port, log_path=tmp / "daemon.log")
    yield d
    d.close()


def restarted(d: Daemon, mark: int) -> dict[str, Any]:
    d.wait_event("state_changed", 60, after=mark, to="restarting")
    return d.wait_event("state_changed", RESTART_TIMEOUT, after=mark, to="ready")


def test_ready_behind_the_front(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    listening = daemon.event("front_listening")
    assert listening is not None and listening["url"].endswith(f":{daemon.port}")
    # vLLM itself is not on the client port
    spawned = daemon.event("child_spawned")
    assert spawned is not None and f"--port {daemon.port} " not in spawned["argv"] + " "


def check_fault(daemon: Daemon, fault: str, inject: Any, streams: int,
                streams_cut: bool = True) -> None:
    """``streams_cut``: the fault ends the streams in flight (a SIGKILL); a hung engine is
    continued when its group is stopped and may finish them in its last seconds."""
    load = Load(daemon.port, streams=streams).start()
    load.wait_streaming()  # the long streams are under way (2000 tokens: seconds more)
    mark = daemon.mark()
    fault_at = time.monotonic()
    inject()
    ready = restarted(daemon, mark)
    time.sleep(3.0)  # served again for a while
    outcomes = load.finish()
    s = summary(outcomes, fault_at)
    endings = stream_endings(outcomes)
    released = daemon.event("front_released", after=mark)
    record(f"front_{fault}", ready["_t"] - fault_at, **s, streams=endings,
           front_released={k: v for k, v in (released or {}).items()
                           if not k.startswith("_")})
    assert s["refused_or_reset"] == 0, s
    assert s["not_200"] == 0, s  # held, or replayed: answered
    assert s["sent_after_fault"] > 0 and s["requests"] > 2 * CLIENTS, s
    assert released is not None and released["held"] > 0, released
    assert all(e in ("done", "error event") for e in endings), endings  # never a silent cut
    # a stream still open at the fault ends with the error event (vLLM's or the front's)
    open_then = [e for o, e in zip([o for o in outcomes if o.stream], endings, strict=True)
                 if o.ended > fault_at]
    assert len(open_then) == streams, (endings, open_then)
    if streams_cut:
        assert open_then.count("error event") == streams, (endings, open_then)


def test_engine_sigkill_under_load_is_a_blip(daemon: Daemon) -> None:
    engine = daemon.engine_core()
    check_fault(daemon, "engine_sigkill", lambda: os.kill(engine.pid, signal.SIGKILL),
                streams=2)
    replayed = daemon.event("front_released", after=0)
    assert replayed is not None


def test_hung_engine_under_load_is_a_blip(daemon: Daemon) -> None:
    engine = daemon.engine_core()
    check_fault(daemon, "engine_sigstop", lambda: os.kill(engine.pid, signal.SIGSTOP),
                streams=1, streams_cut=False)
    hang = daemon.event("hang_detected")
    canary = daemon.event("canary_failed")
    assert hang is not None or canary is not None


def test_vllm_reload_under_load_is_a_blip(daemon: Daemon) -> None:
    drop = daemon.tmp / "conf.d" / "50-seqs.toml"
    drop.write_text("[vllm]\nmax_num_seqs = 6\n")
    check_fault(daemon, "vllm_reload", lambda: daemon.signal(signal.SIGHUP), streams=0)
    assert daemon.event("restart_for_reload") is not None


def test_sigterm_drains_through_the_front(daemon: Daemon) -> None:
    load = Load(daemon.port, streams=0).start()
    time.sleep(2.0)
    mark = daemon.mark()
    stop_at = time.monotonic()
    daemon.signal(signal.SIGTERM)
    drained = daemon.wait_event("drained", 60, after=mark)
    outcomes = load.finish(60)
    assert daemon.wait_exit(60) == 0
    assert drained["busy"] is False and drained["in_flight"] == 0, drained
    # those taken before the stop were answered; later ones were refused at the door
    taken = [o for o in outcomes if o.sent < stop_at - 0.5]
    assert taken and all(o.status == 200 for o in taken), summary(outcomes, stop_at)
    assert daemon.event("front_draining", after=mark) is not None
