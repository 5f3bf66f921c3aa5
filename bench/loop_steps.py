#!/usr/bin/env python3
"""How long the supervisor's loop steps take under client load (issue 28, item 5).

One real supervisor (tests/support/daemon.py) over the CPU vLLM and the tiny model, its front on
the client port and its status endpoint on; once READY, ``--streams`` long streamed completions
run through the front (each started again when it ends) and ``--scrapers`` clients fetch the
status endpoint's /metrics and /status in turn, each as fast as it can, for ``--seconds``.
The loop's steps in that window come from the daemon's own histogram,
``qwen4090_loop_step_seconds`` (read at the start and at the end of the window: the difference),
with the ``loop_stalled`` lines (steps over 2 s) logged meanwhile; what the scrapers got too
(answers per second, codes, the slowest).

    .venv/bin/python bench/loop_steps.py [--seconds 60] [--out FILE]
    # another checkout's supervisor (the "before" of a change), same load:
    .venv/bin/python bench/loop_steps.py --daemon-src /tmp/before/daemon
    # where the long steps are spent: a stack sampler in the daemon (bench/loop_sampler.py)
    .venv/bin/python bench/loop_steps.py --sample

Needs scripts/setup-runtime.sh (.runtime/venv and .runtime/tiny-model).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))

from tests.support.clients import http_get  # noqa: E402 (the path above first)

READY_TIMEOUT = 600.0
SCRAPER_GRACE = 300.0  # seconds past the window a scraper may take to report (2 busy cores)
TARGET = 0.5  # seconds: the longest step allowed under this load (issue 28.5)
STEP_FAMILY = "qwen4090_loop_step_seconds"


# --- the histogram, read from /metrics ------------------------------------------------------


def step_buckets(metrics_text: str) -> dict[float, float] | None:
    """The cumulative buckets of qwen4090_loop_step_seconds ({upper bound: count}), or None
    when the daemon has no such family (a checkout older than it)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == STEP_FAMILY:
            return {float(s.labels["le"]): s.value for s in fam.samples
                    if s.name.endswith("_bucket")}
    return None


@dataclass(frozen=True)
class StepSummary:
    count: int
    p50: float | None
    p99: float | None
    max_bound: float | None  # the upper bound of the highest bucket with a step in it
    over_target: int  # steps longer than TARGET

    def row(self) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else ("+Inf" if v == math.inf else f"{v:.4f}")
        return (f"steps {self.count}, p50 {s(self.p50)} s, p99 {s(self.p99)} s, "
                f"max <= {s(self.max_bound)} s, over {TARGET} s: {self.over_target}")


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket where the rank falls (from 0
    for the first), the last finite bound for a rank in +Inf."""
    total = cumulative[-1][1] if cumulative else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, n in cumulative:
        if n >= rank:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * ((rank - below) / (n - below) if n > below else 0)
        lower, below = bound, n
    return lower


def summarize(before: dict[float, float], after: dict[float, float]) -> StepSummary:
    """The steps between two reads of the histogram."""
    cumulative = sorted((b, after[b] - before.get(b, 0.0)) for b in after)
    count = int(cumulative[-1][1]) if cumulative else 0
    top = next((b for b, n in cumulative if n >= count), None) if count else None
    at_target = next((n for b, n in cumulative if b >= TARGET), 0.0)
    return StepSummary(count, quantile(cumulative, 0.5), quantile(cumulative, 0.99), top,
                       int(count - at_target))


# --- the load ---------------------------------------------------------------------------------


def scrape(port: int, seconds: float, results: Any) -> None:
    """One scraper (a process of its own, as a client is): /metrics and /status in turn, as
    fast as answers come, for ``seconds``; (codes, slowest answer) to ``results``."""
    paths = ("/metrics", "/status")
    codes: dict[str, int] = {}
    slowest = 0.0
    end = time.monotonic() + seconds
    i = 0
    while (t0 := time.monotonic()) < end:
        try:
            code = str(http_get(port, paths[i % 2], 10.0)[0])
        except OSError as e:
            code = type(e).__name__
        codes[code] = codes.get(code, 0) + 1
        slowest = max(slowest, time.monotonic() - t0)
        i += 1
    results.put((codes, slowest))


def stream(port: int, model: str, i: int, stop: threading.Event, started: threading.Semaphore,
           tokens: list[int]) -> None:
    """Long streamed completions, one after the other, until ``stop``."""
    first = True
    n = 0
    while not stop.is_set():
        n += 1
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": model, "prompt": [20 + i, 30 + n % 500] * 8, "max_tokens": 1500,
                 "ignore_eos": True, "stream": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            while not stop.is_set() and (line := r.readline()):
                if line.startswith(b"data: {"):
                    tokens[i] += 1
                    if first:
                        started.release()
                        first = False
        except OSError:
            time.sleep(0.5)
        finally:
            conn.close()


def cpu_list(spec: str) -> list[int]:
    """taskset's list form: "0", "0,2", "0-3" -> the cores."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


# --- one run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import psutil
    from tests.support.daemon import Daemon
    from tests.support.runtime import cpu_config, free_port, require_runtime, write_toml

    require_runtime()
    status_port = free_port()
    cfg = cpu_config(free_port(), status={"enabled": True, "host": "127.0.0.1",
                                          "port": status_port},
                     front={"enabled": True, "engine_port": free_port()},
                     gpu={"enabled": "off", "state_directory": str(tmp / "state")},
                     log={"format": "json", "level": "info", "vllm_level": "warning"})
    if args.engine_cpus:  # the CPU vLLM on these cores only, one OpenMP thread per core
        v = cfg["vllm"]
        v["command"] = ["taskset", "-c", args.engine_cpus, *v["command"]]
        v["env"] = {**v["env"], "OMP_NUM_THREADS": str(len(cpu_list(args.engine_cpus)))}
    path = write_toml(tmp / "qwen4090.toml", cfg)
    d = Daemon(path, tmp, port=int(cfg["vllm"]["port"]), log_path=tmp / "daemon.log")
    stop_streams = threading.Event()
    threads: list[threading.Thread] = []
    try:
        d.wait_state("ready", READY_TIMEOUT)
        tokens = [0] * args.streams
        started = threading.Semaphore(0)
        for i in range(args.streams):
            threads.append(threading.Thread(target=stream, args=(
                d.port, "tiny", i, stop_streams, started, tokens), daemon=True))
            threads[-1].start()
        for _ in range(args.streams):
            if not started.acquire(timeout=120):
                raise RuntimeError("a stream never started")
        before = step_buckets(http_get(status_port, "/metrics", 30.0)[1].decode())
        mark = d.mark()
        sup = psutil.Process(d.proc.pid)
        cpu0, t0 = sup.cpu_times(), time.monotonic()
        tokens0 = sum(tokens)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        scrapers = [ctx.Process(target=scrape, args=(status_port, args.seconds, results),
                                daemon=True) for _ in range(args.scrapers)]
        for p in scrapers:
            p.start()
        threads_seen = 0
        codes: dict[str, int] = {}
        slowest = 0.0
        # each ends after args.seconds and its last answer (<= 10 s), if the machine lets it run
        done, deadline = 0, t0 + args.seconds + SCRAPER_GRACE
        while done < len(scrapers) or time.monotonic() - t0 < args.seconds:
            threads_seen = max(threads_seen, sup.num_threads())
            try:
                got, worst = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    break  # said in the result: scrapers_lost
                continue
            done += 1
            for k, n in got.items():
                codes[k] = codes.get(k, 0) + n
            slowest = max(slowest, worst)
        for p in scrapers:
            p.join(10)
            if p.is_alive():
                p.kill()
        lost = len(scrapers) - done
        wall = time.monotonic() - t0
        cpu1 = sup.cpu_times()
        stream_tokens = sum(tokens) - tokens0
        after = step_buckets(http_get(status_port, "/metrics", 30.0)[1].decode())
        stalls = [ev.get("seconds") for ev in d.events[mark:]
                  if ev.get("event") == "loop_stalled"]
        stop_streams.set()
        for t in threads:
            t.join(70)
        steps = None if before is None or after is None else summarize(before, after)
        return {
            "daemon_src": args.daemon_src or str(ROOT / "daemon"),
            "seconds": round(wall, 1), "scrapers": args.scrapers, "streams": args.streams,
            "steps": None if steps is None else steps.__dict__,
            "loop_stalled": stalls,
            "scrapes_per_second": round(sum(codes.values()) / wall, 1),
            "scrape_codes": codes, "scrapers_lost": lost,
            "slowest_scrape_seconds": round(slowest, 3),
            "stream_tokens_per_second": round(stream_tokens / wall, 1),
            "supervisor_cores": round((cpu1.user - cpu0.user + cpu1.system - cpu0.system)
                                      / wall, 2),
            "supervisor_threads_max": threads_seen,
            "verdict": "PASS" if steps is not None and steps.over_target == 0 and not stalls
            else "MISS",
        }
    finally:
        stop_streams.set()
        d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the loaded window")
    ap.add_argument("--scrapers", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--daemon-src", help="the daemon/ folder of the checkout to run "
                                         "(default: this one's)")
    ap.add_argument("--sample", action="store_true",
                    help="sample the daemon's main thread during long steps "
                         "(bench/loop_sampler.py); the tally is printed")
    ap.add_argument("--engine-cpus", default="",
                    help="run the CPU vLLM on these cores only (taskset -c LIST, one OpenMP "
                         "thread per core), e.g. 0: the GPU box's engine does not spin the "
                         "host's cores; on the 2-vCPU VM an unconfined CPU vLLM pauses every "
                         "process for seconds (docs/loop-steps.md)")
    ap.add_argument("--label", default="", help="a name for this run in the output")
    ap.add_argument("--out", type=Path, help="append the result as one JSON line")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="qwen4090-loop-steps-"))
    if args.daemon_src:  # read by tests.support.daemon at its import
        os.environ["QWEN4090_DAEMON_SRC"] = str(Path(args.daemon_src).resolve())
    sampled = tmp / "sampler.json"
    if args.sample:
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("import loop_sampler\nloop_sampler.start()\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
        os.environ["LOOP_SAMPLER_OUT"] = str(sampled)
    result = run(args, tmp)
    result.update(label=args.label, command=" ".join(["bench/loop_steps.py",
                                                      *(argv or sys.argv[1:])]),
                  machine=f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  log=str(tmp / "daemon.log"))
    if args.sample and sampled.exists():
        result["sampler"] = json.loads(sampled.read_text())
    steps = result["steps"]
    print(f"{args.label or result['daemon_src']}: "
          + ("no qwen4090_loop_step_seconds in /metrics" if steps is None
             else StepSummary(**steps).row())
          + f"; loop_stalled {result['loop_stalled']}; {result['scrapes_per_second']} "
            f"scrapes/s {result['scrape_codes']}; {result['verdict']}", flush=True)
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
