"""Clients of a served vLLM for the integration tests and benches: streamed completions on
threads of their own, one /metrics value, and the measured numbers for docs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.support.daemon import DAEMON_SRC, Daemon


class Stream(threading.Thread):
    """One streamed /v1/completions request on a thread of its own; records what it got.

    ``started`` is set once the first token arrived; ``done`` says whether the stream ended
    with vLLM's ``data: [DONE]``; ``ended_wall`` is the wall-clock second it ended (to compare
    with the daemon's log timestamps); ``last_chunk_at`` the monotonic second its last chunk
    came (None before the first).
    """

    def __init__(self, port: int, prompt: Any, max_tokens: int, timeout: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.port, self.prompt, self.max_tokens, self.timeout = port, prompt, max_tokens, timeout
        self.started = threading.Event()
        self.chunks = 0
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ended_wall: float | None = None
        self.last_chunk_at: float | None = None

    def run(self) -> None:
        import http.client

        body = json.dumps({"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens,
                           "ignore_eos": True, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read(300)!r}"
                return
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
                self.chunks += 1
                self.last_chunk_at = time.monotonic()
                self.started.set()
        except Exception as e:  # what a client sees: recorded, never raised
            self.error = repr(e)
        finally:
            self.ended_wall = time.time()  # before the close a drain waits for
            conn.close()
            self.started.set()

    def outcome(self) -> str:
        return (f"done={self.done} chunks={self.chunks} finish={self.finish_reason} "
                f"error={self.error}")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """One GET on 127.0.0.1: (status, body)."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def metrics_value(port: int, name: str, timeout: float = 5.0) -> float | None:
    """One sample of vLLM's /metrics (summed over labels), or None when it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total = (total or 0.0) + float(line.rsplit(None, 1)[-1])
    return total


def start_streams(port: int, first_token: int, n: int = 8, max_tokens: int = 2000,
                  context: Callable[[], str] = lambda: "") -> list[Stream]:
    """``n`` streams of ``max_tokens`` each (prompt: 16 x one token id, a different one per
    stream), each past its first token.  ``context`` says more when one never starts (a CI run
    had one stream without a first token for 60 s, and nothing to tell why)."""
    streams = [Stream(port, [first_token + i] * 16, max_tokens, timeout=120) for i in range(n)]
    for st in streams:
        st.start()
    for st in streams:
        assert st.started.wait(60), (f"{st.outcome()}; all: "
                                     + "; ".join(s.outcome() for s in streams) + context())
    return streams


def sigterm_while_streaming(daemon: Daemon, streams: list[Stream], exit_timeout: float,
                            join: float) -> tuple[int, float, float]:
    """SIGTERM to the supervisor with ``streams`` in flight: asserts it exits 0 within
    ``exit_timeout``; returns (the log mark before the signal, time.monotonic() at the signal,
    at the exit) once the streams have ended (or ``join`` seconds each passed)."""
    mark = daemon.mark()
    t0 = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(exit_timeout) == 0
    t_exit = time.monotonic()
    for st in streams:
        st.join(join)
    return mark, t0, t_exit


def log_wall(ev: dict[str, Any]) -> float:
    """The wall-clock second of a JSON log event (its ISO timestamp)."""
    from datetime import datetime

    return datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


def record(name: str, seconds: float, **facts: Any) -> None:
    """A measured number for docs/reliability.md: printed, and appended as a JSON line to
    $QWEN4090_MEASUREMENTS when set (tests never assert on speed)."""
    row = {"name": name, "seconds": round(seconds, 2), "daemon": str(DAEMON_SRC), **facts}
    print(f"MEASURED {json.dumps(row)}")
    path = os.environ.get("QWEN4090_MEASUREMENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
