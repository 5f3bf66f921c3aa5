#!/usr/bin/env python3
"""The false-hang soak (issue 30.3): mixed load through a real supervisor for ``--minutes``,
no fault injected; every hang verdict, failover and restart it causes is a false one.

The fast hang verdict (a busy engine is hung after 3 x its longest step, within
watch.hang_floor and watch.hang_timeout) is only worth having if it never fires on an engine
that is merely slow.  This bench runs the load that makes engines slow, all at once:

- ``--clients`` threads of short completions back to back, and ``--streams`` long streams
  (the steady load; a stream restarts when it ends);
- every ``--burst-every`` s, a burst of ``--burst`` clients sent at once (64);
- every ``--long-every`` s, one prompt of max_model_len - 64 tokens (a max-length prefill,
  streamed: its chunks land between the steady streams' steps);
- every ``--text-every`` s, one tokenizer-heavy request: a prompt of ``--text-chars`` characters
  of text that the API server must tokenize before vLLM sees it (the front counts it in
  flight, vLLM's gauges do not); vLLM may refuse it as too long (400): that is expected;
- every ``--starve-every`` s for ``--starve-for`` s, a CPU-starved API server: one busy-loop
  process per CPU the serving API server may run on, pinned to those CPUs.

Counted at the end, from the daemon's journal lines and /status: ``hang_detected``,
``failover_started``, ``vllm_failed`` and restarts by cause; the clients' outcomes (a request
with no HTTP answer, or a 5xx, is a failure; the tokenizer-heavy request's 400 is not).
PASS: no hang verdict, no failover, no restart, no failed request.  JSON (``--out``, rewritten
every minute) and a summary on stdout.

CPU (the tiny model; ~35 min with the default 30 minutes):
    flock /tmp/qwen4090-vllm.lock .venv/bin/python bench/soak.py --base cpu --minutes 30 \\
        --out docs/soak/cpu.json
GPU (H200/H100 with the kit; not run yet: a 30-minute run outlasts one device call, so start
it in the background as scripts/gpu/standby.sh does its faults):
    . scripts/gpu/kit.sh; python3 bench/soak.py --base gpu --minutes 30 --out $OUT/soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from bench.failover import get_json, serving_pid  # noqa: E402
from bench.recovery import apply_sets, base_config  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402
from tests.support.runtime import free_port, write_toml  # noqa: E402

FALSE = ("hang_detected", "failover_started", "vllm_failed")  # journal events that must not be
READY_TIMEOUT = 900.0
REQUEST_TIMEOUT = 600.0


# --- the pure part: the verdict (tests/unit/test_bench.py) -----------------------------------


def verdict(events: dict[str, int], outcomes: dict[str, int], restarts: dict[str, int]
            ) -> tuple[str, list[str]]:
    """PASS when nothing false happened: no hang verdict, failover or failed vLLM in the
    journal, no restart by any cause, no failed request."""
    why = [f"{n} x {name}" for name, n in events.items() if n]
    why += [f"{n} restart(s) for {cause}" for cause, n in restarts.items() if n]
    if outcomes.get("failed"):
        why.append(f"{outcomes['failed']} failed request(s)")
    return ("FAIL" if why else "PASS"), why


# --- the load ---------------------------------------------------------------------------------


class Clients:
    """Every request the soak sends, and what came of it."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {"ok": 0, "failed": 0, "refused_expected": 0}
        self.failures: list[str] = []
        self.threads: list[threading.Thread] = []

    def send(self, body: dict[str, Any], expect_400: bool = False) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        what = "ok"
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({"model": self.model,
                                                                     **body}),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = b""
            while chunk := r.read(65536):
                data += chunk
            if r.status == 400 and expect_400:
                what = "refused_expected"
            elif r.status != 200 or (body.get("stream") and b"data: [DONE]" not in data) \
                    or b'"error"' in data[-2000:]:
                what = "failed"
                self.note(f"HTTP {r.status}: {data[-300:]!r}")
        except OSError as e:
            what = "failed"
            self.note(f"{type(e).__name__}: {e}")
        finally:
            conn.close()
        with self.lock:
            self.counts[what] += 1

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {text}")

    def loop(self, make: Any) -> threading.Thread:
        def run() -> None:
            while not self.stop.is_set():
                self.send(make())
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def once(self, body: dict[str, Any], expect_400: bool = False) -> None:
        t = threading.Thread(target=self.send, args=(body, expect_400), daemon=True)
        t.start()
        self.threads.append(t)

    def finish(self, timeout: float) -> None:
        self.stop.set()
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))


def _spin(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        x += 1


def starve(pid: int | None, seconds: float) -> int:
    """Busy-loop processes, one per CPU the process ``pid`` may run on, pinned there, for
    ``seconds``; returns how many ran."""
    if pid is None:
        return 0
    try:
        cpus = psutil.Process(pid).cpu_affinity() or []
    except (psutil.Error, AttributeError):
        cpus = list(range(os.cpu_count() or 1))
    until = time.monotonic() + seconds
    procs = []
    ctx = multiprocessing.get_context("fork")
    for cpu in cpus:
        p = ctx.Process(target=_spin, args=(until,), daemon=True)
        p.start()
        with contextlib.suppress(psutil.Error, AttributeError):
            psutil.Process(p.pid).cpu_affinity([cpu])
        procs.append(p)
    for p in procs:
        p.join(seconds + 10)
        if p.is_alive():
            p.kill()
    return len(procs)


# --- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace, cfg: dict[str, Any], tmp: Path, out: dict[str, Any],
        save: Any) -> None:
    port = int(cfg["vllm"]["port"])
    status_port = int(cfg["status"]["port"])
    model = str(cfg["vllm"].get("served_model_name", "tiny"))
    max_len = int(cfg["vllm"].get("max_model_len") or 2048)
    path = write_toml(tmp / "qwen4090.toml", cfg)
    d = Daemon(path, tmp, port=port, log_path=args.log or tmp / "daemon.log")
    try:
        ready = d.wait_state("ready", READY_TIMEOUT)
        out["ready_s"] = round(ready["_t"] - d.t0, 1) if hasattr(d, "t0") else None
        mark = d.mark()
        c = Clients(port, model)
        rnd = random.Random(args.seed)
        for i in range(args.clients):
            c.loop(lambda i=i: {"prompt": [10 + (i * 31 + rnd.randrange(900)) % 900] * 8,
                                "max_tokens": 4, "ignore_eos": True})
        for i in range(args.streams):
            c.loop(lambda i=i: {"prompt": [20 + i] * 16, "max_tokens": args.stream_tokens,
                                "ignore_eos": True, "stream": True})
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        due = {"burst": t0 + args.burst_every / 2, "long": t0 + args.long_every / 3,
               "text": t0 + args.text_every / 4, "starve": t0 + args.starve_every / 2}
        counts = {"bursts": 0, "long_prompts": 0, "text_requests": 0, "starved": 0}
        next_save = t0 + 60
        starving: threading.Thread | None = None
        while time.monotonic() < end:
            now = time.monotonic()
            if d.proc.poll() is not None:
                raise AssertionError(f"the daemon exited (rc={d.proc.poll()})")
            if now >= due["burst"]:
                for k in range(args.burst):
                    c.once({"prompt": [30 + k % 500] * 32, "max_tokens": 16,
                            "ignore_eos": True})
                counts["bursts"] += 1
                due["burst"] = now + args.burst_every
            if now >= due["long"]:
                c.once({"prompt": [40 + counts["long_prompts"] % 700] * (max_len - 64),
                        "max_tokens": 32, "ignore_eos": True, "stream": True})
                counts["long_prompts"] += 1
                due["long"] = now + args.long_every
            if now >= due["text"]:
                words = " ".join(f"w{rnd.randrange(10**6)}" for _ in range(args.text_chars // 8))
                c.once({"prompt": words[:args.text_chars], "max_tokens": 1}, expect_400=True)
                counts["text_requests"] += 1
                due["text"] = now + args.text_every
            if now >= due["starve"] and (starving is None or not starving.is_alive()):
                pid = serving_pid(get_json(status_port, "/status"))
                starving = threading.Thread(target=starve, args=(pid, args.starve_for),
                                            daemon=True)
                starving.start()
                counts["starved"] += 1
                due["starve"] = now + args.starve_every
            if now >= next_save:
                out.update(tally(d, mark, c, status_port, counts, now - t0))
                save()
                next_save = now + 60
            time.sleep(0.2)
        c.finish(REQUEST_TIMEOUT)
        if starving is not None:
            starving.join(args.starve_for + 15)
        out.update(tally(d, mark, c, status_port, counts, time.monotonic() - t0))
    finally:
        d.close()


def tally(d: Daemon, mark: int, c: Clients, status_port: int, counts: dict[str, int],
          seconds: float) -> dict[str, Any]:
    events = {name: sum(1 for e in d.events[mark:] if e.get("event") == name) for name in FALSE}
    doc = get_json(status_port, "/status") or {}
    restarts = {str(k): int(v) for k, v in (doc.get("restarts_by_cause") or {}).items()}
    with c.lock:
        outcomes = dict(c.counts)
        failures = list(c.failures)
    result, why = verdict(events, outcomes, restarts)
    return {"seconds": round(seconds, 1), "events": events, "restarts_by_cause": restarts,
            "outcomes": outcomes, "failures": failures, "load": dict(counts),
            "hang": doc.get("hang"), "verdict": result, "why": why}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--base", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=1500)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--burst-every", type=float, default=60.0)
    ap.add_argument("--long-every", type=float, default=45.0)
    ap.add_argument("--text-every", type=float, default=75.0)
    ap.add_argument("--text-chars", type=int, default=400_000)
    ap.add_argument("--starve-every", type=float, default=120.0)
    ap.add_argument("--starve-for", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=JSON")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="qwen4090-soak-"))
    cfg: dict[str, Any] = base_config(args.base, tmp)
    cfg.setdefault("front", {})["enabled"] = True
    cfg["status"] = {"enabled": True, "port": free_port()}
    if args.base == "cpu":
        cfg["watch"]["load_timeout"] = 400.0
    # the shipped [watch] unless --set says otherwise: the soak judges the defaults' verdicts
    for key in ("hang_timeout", "hang_floor", "poll_interval", "canary_interval",
                "health_timeout", "unhealthy_timeout"):
        cfg.get("watch", {}).pop(key, None)
    apply_sets(cfg, args.set, args.env)
    out: dict[str, Any] = {"bench": "soak", "argv": list(argv if argv is not None
                                                       else sys.argv[1:]),
                           "machine": platform.node(), "cpus": os.cpu_count(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "config": cfg, "verdict": "NO DATA"}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        run(args, cfg, tmp, out, save)
    except BaseException as e:  # whatever happened, the JSON keeps what was counted
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        out["verdict"] = "FAIL"
        if not isinstance(e, (Exception, KeyboardInterrupt)):
            raise
    finally:
        save()
        print(json.dumps({k: out.get(k) for k in ("seconds", "events", "restarts_by_cause",
                                                  "outcomes", "load", "hang", "verdict",
                                                  "why", "error")}, indent=1))
    return 0 if out["verdict"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
