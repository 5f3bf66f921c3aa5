"""A steady client load through the client port, and what the clients saw (issue 20): short
completions back to back on ``CLIENTS`` threads, and long streams read line by line, every
outcome kept.  For tests/integration/test_front.py, test_balancer.py and bench/front_faults.py
(standard library only: it runs in the GPU image too)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

CLIENTS = 4  # client threads sending short requests back to back (CI has 2 cores)
TIMEOUT = 600.0  # one request, held across a restart included
LONG_TOKENS = 2000  # a long stream's max_tokens: 16 + 2000 fit the tiny model's 2048


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
    clients: int = CLIENTS
    model: str = "tiny"
    host: str = "127.0.0.1"
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # per long-stream thread: (events so far, first event at, last event at) of its current
    # stream; None between streams
    progress: dict[int, tuple[int, float, float] | None] = field(default_factory=dict)
    armed: threading.Event = field(default_factory=threading.Event)  # no new long streams

    def start(self) -> Load:
        for i in range(self.clients):
            self.threads.append(threading.Thread(target=self.short, args=(i,), daemon=True))
        for i in range(self.streams):
            self.threads.append(threading.Thread(target=self.long, args=(i,), daemon=True))
        for t in self.threads:
            t.start()
        return self

    def abandon(self) -> None:
        """Stop sending (a test that failed midway): its threads must not load the tests after
        it."""
        self.stop.set()

    def finish(self, timeout: float = 200.0) -> list[Outcome]:
        self.stop.set()
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a client never returned"
        return self.outcomes

    def one(self, body: dict[str, Any], stream: bool, slot: int = -1) -> None:
        sent = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if stream:  # line by line: the test injects its fault once every stream flows
                data, events, first = b"", 0, 0.0
                while line := r.readline():
                    data += line
                    if line.startswith(b"data: "):
                        events += 1
                        now = time.monotonic()
                        first = first or now
                        self.progress[slot] = (events, first, now)
            else:
                data = r.read()
            out = Outcome(sent, 0.0, r.status, stream=stream, body=data)
        except OSError as e:
            out = Outcome(sent, 0.0, None, f"{type(e).__name__}: {e}", stream)
        finally:
            conn.close()
            if stream:
                self.progress[slot] = None
        out.ended = time.monotonic()
        with self.lock:
            self.outcomes.append(out)

    def wait_streaming(self, timeout: float = 120.0) -> None:
        """Every long stream is under way, its tokens flowing, and no new one starts after this
        (the caller injects its fault next).  Flowing: over the last quarter second the current
        stream got tokens, the last within half a second, and at that pace a second of it is
        left.  First tokens alone do not tell: on 2 busy cores vLLM's API server may hold a
        stream's tokens back and send them in one burst at its end (two CI runs saw both
        streams "in progress" end in [DONE] after the EngineCore's SIGKILL; the pace of a burst
        leaves milliseconds); a thread whose stream ended before it flowed starts another."""
        end = time.monotonic() + timeout
        looks: list[tuple[float, list[tuple[int, float, float] | None]]] = []
        while True:
            now = time.monotonic()
            seen = [self.progress.get(i) for i in range(self.streams)]
            looks.append((now, seen))
            before = [(t, old) for t, old in looks if now - t >= 0.25]
            if before and all(flowing(old, new, now - before[-1][0], now)
                              for old, new in zip(before[-1][1], seen, strict=True)):
                self.armed.set()
                return
            assert now < end, f"the long streams never flowed together: {seen}"
            del looks[:max(0, len(before) - 1)]  # the newest look old enough is kept
            time.sleep(0.05)  # poll interval of a wait bounded by ``timeout``

    def short(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            self.one({"model": self.model, "prompt": [10 + (i * 31 + n) % 900] * 8,
                      "max_tokens": 4, "ignore_eos": True}, stream=False)

    def long(self, i: int) -> None:
        while True:  # until wait_streaming saw every thread's stream flow
            self.one({"model": self.model, "prompt": [20 + i] * 16, "max_tokens": LONG_TOKENS,
                      "ignore_eos": True, "stream": True}, stream=True, slot=i)
            if self.armed.is_set() or self.stop.is_set():
                return


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


def flowing(old: tuple[int, float, float] | None, new: tuple[int, float, float] | None,
            took: float, now: float) -> bool:
    """(events so far, first at, last at) of a long stream ``took`` seconds ago and now: the
    same stream got tokens meanwhile, the last within half a second, and at that pace a second
    of it is left."""
    if old is None or new is None or old[1] != new[1] or new[0] <= old[0]:
        return False
    pace = (new[0] - old[0]) / took
    return now - new[2] <= 0.5 and (LONG_TOKENS - new[0]) / pace >= 1.0


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
