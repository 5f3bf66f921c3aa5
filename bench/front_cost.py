#!/usr/bin/env python3
"""What a front costs, side by side: one running vLLM reached directly and through proxies.

Issue 20, item 8: with the front / raw vLLM, output throughput >= 0.99 at c=1 and c=32, TTFT
p50 at most 1 ms and p99 at most 3 ms higher, the front under one core at c=32.

One vLLM OpenAI server (the engine) is already running, and each proxy in front of it too; this
script starts nothing. For each concurrency level it runs rounds in ABBA order (direct, p1, p2 |
p2, p1, direct | ...), so that a drift of the machine (thermal, a neighbour, the engine's own
caches) hits every path alike. A round is N streaming /v1/completions requests, c at a time,
from c workers with one keep-alive connection each (opened before the round's clock starts).
Every request has its own exact-length prompt of token ids, drawn from a seeded generator and
never repeated across the run, so prefix caching flatters no path; ``max_tokens`` with
``ignore_eos`` fixes the output length. Per request: TTFT (request sent -> the first SSE event
that carries a choice) and output tokens (the usage chunk, ``stream_options.include_usage``).
Per round: output tokens / round wall time. Per proxy: utime+stime of its process tree
(/proc/PID/stat, all threads and child processes) over its rounds / their wall time = cores.

Standard library only (threads + http.client), so it runs under any python3 >= 3.10, e.g. the
venv of the vLLM it measures; the same client code serves every path.

    python3 bench/front_cost.py --engine http://127.0.0.1:8000 --model tiny \\
        --proxy haproxy http://127.0.0.1:8100 "$(pgrep -o haproxy)" \\
        --concurrency 1 32 --requests 32 256 --rounds 4 --control --out front-cost.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DIRECT = "direct"
CONTROL = "direct-again"


# --- the pure part: statistics, the bar and the verdict (tests/unit/test_front_cost.py) -------

@dataclass(frozen=True)
class Bar:
    """Issue 20 item 8, as numbers: proxy against direct at the same concurrency."""

    min_throughput_ratio: float = 0.99
    max_p50_delta_ms: float = 1.0
    max_p99_delta_ms: float = 3.0
    max_cores: float = 1.0      # the front's CPU, in cores, strictly below


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float | None        # None: no token came back
    tokens: int
    error: str = ""             # "" = ok


@dataclass
class RoundResult:
    path: str
    concurrency: int
    wall_s: float
    requests: list[RequestResult]
    cpu_s: float | None = None  # the proxy's CPU seconds during the round; None for direct

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests if not r.error)

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.requests if r.error]


@dataclass(frozen=True)
class PathSummary:
    path: str
    concurrency: int
    rounds: int
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tok_per_s: float            # all tokens of its rounds / all their wall time
    round_tok_per_s: list[float]
    cores: float | None         # proxies only
    first_errors: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default), so p50 of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(rounds: Sequence[RoundResult]) -> PathSummary:
    """One path at one concurrency, pooled over its rounds."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    path, c = rounds[0].path, rounds[0].concurrency
    if any((r.path, r.concurrency) != (path, c) for r in rounds):
        raise ValueError("rounds of different paths or concurrencies")
    ttfts = [q.ttft_s * 1000 for r in rounds for q in r.requests
             if not q.error and q.ttft_s is not None]
    errors = [e for r in rounds for e in r.errors]
    wall = sum(r.wall_s for r in rounds)
    cpu = [r.cpu_s for r in rounds if r.cpu_s is not None]
    return PathSummary(
        path=path, concurrency=c, rounds=len(rounds),
        requests=sum(len(r.requests) for r in rounds), errors=len(errors),
        ttft_p50_ms=percentile(ttfts, 50) if ttfts else None,
        ttft_p99_ms=percentile(ttfts, 99) if ttfts else None,
        tok_per_s=sum(r.tokens for r in rounds) / wall if wall > 0 else 0.0,
        round_tok_per_s=[r.tokens / r.wall_s if r.wall_s > 0 else 0.0 for r in rounds],
        cores=sum(cpu) / wall if cpu and wall > 0 else None,
        first_errors=sorted(set(errors))[:3])


@dataclass(frozen=True)
class Comparison:
    proxy: str
    concurrency: int
    throughput_ratio: float | None
    ttft_p50_delta_ms: float | None
    ttft_p99_delta_ms: float | None
    cores: float | None
    checks: dict[str, bool]
    verdict: str                # PASS or MISS


def compare(direct: PathSummary, proxy: PathSummary, bar: Bar, control: bool = False
            ) -> Comparison:
    """The proxy against direct at one concurrency. A check that cannot be computed (no
    tokens, no CPU figure) fails: a MISS is never hidden by a missing number. ``control``: the
    engine measured again as if it were a proxy (the noise floor); it has no CPU to check."""
    if direct.concurrency != proxy.concurrency:
        raise ValueError("comparing different concurrencies")
    ratio = proxy.tok_per_s / direct.tok_per_s if direct.tok_per_s > 0 else None
    d50 = (proxy.ttft_p50_ms - direct.ttft_p50_ms
           if proxy.ttft_p50_ms is not None and direct.ttft_p50_ms is not None else None)
    d99 = (proxy.ttft_p99_ms - direct.ttft_p99_ms
           if proxy.ttft_p99_ms is not None and direct.ttft_p99_ms is not None else None)
    checks = {
        "no_errors": direct.errors == 0 and proxy.errors == 0,
        "throughput": ratio is not None and ratio >= bar.min_throughput_ratio,
        "ttft_p50": d50 is not None and d50 <= bar.max_p50_delta_ms,
        "ttft_p99": d99 is not None and d99 <= bar.max_p99_delta_ms,
        "cores": proxy.cores is not None and proxy.cores < bar.max_cores,
    }
    if control:
        del checks["cores"]
    return Comparison(proxy.path, proxy.concurrency, ratio, d50, d99, proxy.cores, checks,
                      "PASS" if all(checks.values()) else "MISS")


def abba_order(paths: Sequence[str], rounds: int) -> list[str]:
    """``rounds`` rounds of every path, alternating forward and backward passes."""
    order: list[str] = []
    for i in range(rounds):
        order += list(paths) if i % 2 == 0 else list(reversed(paths))
    return order


def render_table(summaries: Sequence[PathSummary], comparisons: Sequence[Comparison],
                 bar: Bar) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def delta(v: float | None) -> str:
        return "-" if v is None else f"{v:+.2f}"

    by_key = {(c.proxy, c.concurrency): c for c in comparisons}
    lines = ["| c | path | requests (errors) | TTFT p50 ms | TTFT p99 ms | out tok/s | "
             "ratio | p50 delta | p99 delta | cores | verdict |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in summaries:
        cmp = by_key.get((s.path, s.concurrency))
        failed = "" if cmp is None else ", ".join(k for k, ok in cmp.checks.items() if not ok)
        lines.append(
            f"| {s.concurrency} | {s.path} | {s.requests} ({s.errors}) | {ms(s.ttft_p50_ms)} | "
            f"{ms(s.ttft_p99_ms)} | {s.tok_per_s:.1f} | "
            + ("- | - | - | - | - |" if cmp is None else
               f"{'-' if cmp.throughput_ratio is None else f'{cmp.throughput_ratio:.4f}'} | "
               f"{delta(cmp.ttft_p50_delta_ms)} | {delta(cmp.ttft_p99_delta_ms)} | "
               f"{'-' if cmp.cores is None else f'{cmp.cores:.3f}'} | "
               f"{cmp.verdict}{f' ({failed})' if failed else ''} |"))
    lines.append(f"\nBar: ratio >= {bar.min_throughput_ratio}, p50 delta <= "
                 f"{bar.max_p50_delta_ms} ms, p99 delta <= {bar.max_p99_delta_ms} ms, "
                 f"cores < {bar.max_cores}, no errors; the verdict ignores the {CONTROL} row "
                 f"(with --control: the engine against itself, the noise floor).")
    return "\n".join(lines)


# --- the impure part: processes, sockets, threads ---------------------------------------------

def tree_cpu_seconds(pid: int, descendants: bool = True) -> float:
    """utime+stime of ``pid`` and its live descendants (all their threads), from /proc; with
    ``descendants`` false, of ``pid`` alone (qwen4090's front is a thread of the supervisor,
    whose children are vLLM)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue            # gone meanwhile
        # the command name may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    if pid not in cpu:
        raise ProcessLookupError(f"no process {pid}")
    if not descendants:
        return cpu[pid]
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += [child for child, par in parent.items() if par == p]
    return total


@dataclass(frozen=True)
class Target:
    name: str
    host: str
    port: int
    pid: int | None = None      # the proxy's pid; None for the engine itself
    tree: bool = True           # its CPU counts its descendants ("=PID" on the command line:
    #                             that process alone)
    control: bool = False       # the engine again, measured as a proxy would be


def parse_url(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
    if u.scheme != "http" or not u.hostname or not u.port:
        raise argparse.ArgumentTypeError(f"{url!r}: expected http://HOST:PORT")
    return u.hostname, u.port


@dataclass(frozen=True)
class Workload:
    model: str
    prompt_len: int
    max_tokens: int
    token_lo: int
    token_hi: int
    seed: int
    timeout_s: float


class PromptSource:
    """Exact-length prompts, a fresh one for each request of the run (seeded, so two runs with
    the same arguments send the same prompts in the same order)."""

    def __init__(self, w: Workload) -> None:
        self._rng = random.Random(w.seed)
        self._w = w
        self._lock = threading.Lock()

    def next(self) -> list[int]:
        with self._lock:
            return [self._rng.randrange(self._w.token_lo, self._w.token_hi)
                    for _ in range(self._w.prompt_len)]


def stream_one(conn: http.client.HTTPConnection, w: Workload, prompt: list[int]
               ) -> RequestResult:
    body = json.dumps({
        "model": w.model, "prompt": prompt, "max_tokens": w.max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        text = resp.read(300).decode(errors="replace").strip().replace("\n", " ")
        return RequestResult(None, 0, f"HTTP {resp.status}: {text[:120]}")
    ttft: float | None = None
    chunks, usage, error, done = 0, None, "", False
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        if event.get("choices"):
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunks += 1
        if event.get("usage"):
            usage = event["usage"].get("completion_tokens")
        if "error" in event:
            error = f"SSE error: {json.dumps(event['error'])[:120]}"
    resp.read()                 # the chunked terminator, so the connection can be reused
    if not error and not done:
        error = "stream ended without [DONE]"
    tokens = usage if isinstance(usage, int) else chunks
    if not error and tokens != w.max_tokens:
        error = f"{tokens} tokens, expected {w.max_tokens}"
    return RequestResult(ttft, tokens, error)


def run_round(t: Target, c: int, n: int, w: Workload, prompts: PromptSource) -> RoundResult:
    """``n`` requests, ``c`` at a time; the clock starts once all c connections are open."""
    results: list[RequestResult] = []
    lock = threading.Lock()
    left = [n]
    start = threading.Barrier(c + 1)

    def take() -> bool:
        with lock:
            if left[0] == 0:
                return False
            left[0] -= 1
            return True

    def worker() -> None:
        conn = http.client.HTTPConnection(t.host, t.port, timeout=w.timeout_s)
        try:
            conn.connect()
        finally:
            start.wait(w.timeout_s)
        try:
            while take():
                prompt = prompts.next()
                try:
                    r = stream_one(conn, w, prompt)
                except (OSError, http.client.HTTPException, ValueError) as e:
                    r = RequestResult(None, 0, f"{type(e).__name__}: {e}"[:160])
                    conn.close()    # http.client reconnects on the next request
                with lock:
                    results.append(r)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(c)]
    for th in threads:
        th.start()
    start.wait(w.timeout_s)
    cpu0 = tree_cpu_seconds(t.pid, t.tree) if t.pid else None
    t0 = time.perf_counter()
    deadline = time.monotonic() + w.timeout_s * (n // c + 2)
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds(t.pid, t.tree) - cpu0 if t.pid and cpu0 is not None else None
    with lock:
        done = list(results)
    if len(done) < n:
        done += [RequestResult(None, 0, "not finished before the round's deadline")] * (
            n - len(done))
    return RoundResult(t.name, c, wall, done, cpu)


def get_json(t: Target, path: str, timeout: float) -> Any:
    conn = http.client.HTTPConnection(t.host, t.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{t.name}: GET {path}: HTTP {resp.status}")
        return json.loads(body)
    finally:
        conn.close()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(),
                            "platform": platform.platform(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), "?")
    except OSError:
        pass
    return info


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join((__doc__ or "").splitlines()[2:]))
    ap.add_argument("--engine", required=True, help="the vLLM server: http://HOST:PORT")
    ap.add_argument("--proxy", nargs=3, action="append", metavar=("NAME", "URL", "PID"),
                    required=True, help="a proxy in front of the engine and its pid (its CPU "
                    "counts its child processes; =PID: that process alone, e.g. qwen4090's "
                    "supervisor with the front in it); repeat for several (all in one run)")
    ap.add_argument("--control", action="store_true",
                    help=f"also measure the engine a second time as if it were a proxy "
                    f"('{CONTROL}'): the differences the machine makes by itself")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens (default 128)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 256],
                    help="requests per round: one value, or one per concurrency level")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds per path and level")
    ap.add_argument("--warmup-requests", type=int, default=0,
                    help="an unmeasured round per path and level first (default: c requests)")
    ap.add_argument("--token-range", type=int, nargs=2, default=[100, 1900],
                    metavar=("LO", "HI"), help="prompt token ids drawn from [LO, HI)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request socket timeout")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if len(a.requests) == 1:
        a.requests = a.requests * len(a.concurrency)
    if len(a.requests) != len(a.concurrency):
        ap.error("--requests: one value, or one per --concurrency level")
    if any(n < c for n, c in zip(a.requests, a.concurrency, strict=True)):
        ap.error("--requests: at least c requests per round")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    sys.setswitchinterval(0.0005)   # a woken worker waits less for the GIL: less client jitter
    bar = Bar()
    engine = Target(DIRECT, *parse_url(a.engine))
    proxies = [Target(name, *parse_url(url), pid=int(pid.lstrip("=")),
                      tree=not pid.startswith("=")) for name, url, pid in a.proxy]
    if a.control:
        proxies.append(Target(CONTROL, engine.host, engine.port, control=True))
    targets = {t.name: t for t in [engine, *proxies]}
    if len(targets) != len(proxies) + 1:
        raise SystemExit(f"proxy names must differ from each other and from {DIRECT!r}, "
                         f"{CONTROL!r}")
    w = Workload(a.model, a.prompt_len, a.max_tokens, a.token_range[0], a.token_range[1],
                 a.seed, a.timeout)
    for t in targets.values():
        if t.pid:
            tree_cpu_seconds(t.pid)     # fails now, not after the first round
        ids = [m.get("id") for m in get_json(t, "/v1/models", 10).get("data", [])]
        if a.model not in ids:
            raise SystemExit(f"{t.name}: model {a.model!r} not served (found {ids})")
    prompts = PromptSource(w)
    started = time.time()
    all_rounds: list[RoundResult] = []
    for c, n in zip(a.concurrency, a.requests, strict=True):
        for name in targets:
            run_round(targets[name], c, a.warmup_requests or c, w, prompts)
        for i, name in enumerate(abba_order(list(targets), a.rounds)):
            r = run_round(targets[name], c, n, w, prompts)
            all_rounds.append(r)
            print(f"c={c} round {i // len(targets) + 1} {name}: {r.tokens / r.wall_s:.1f} "
                  f"tok/s, {len(r.errors)} errors"
                  + (f", {r.cpu_s / r.wall_s:.3f} cores" if r.cpu_s is not None else ""),
                  file=sys.stderr, flush=True)
    summaries = [summarize([r for r in all_rounds if (r.path, r.concurrency) == (name, c)])
                 for c in a.concurrency for name in targets]
    key = {(s.path, s.concurrency): s for s in summaries}
    comparisons = [compare(key[(DIRECT, c)], key[(p.name, c)], bar, p.control)
                   for c in a.concurrency for p in proxies]
    print(render_table(summaries, comparisons, bar))
    verdict = "PASS" if all(cmp.verdict == "PASS" for cmp in comparisons
                            if cmp.proxy != CONTROL) else "MISS"
    print(f"verdict: {verdict}")
    if a.out:
        a.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "started_unix": started, "machine": machine(),
            "workload": asdict(w), "bar": asdict(bar), "verdict": verdict,
            "summaries": [asdict(s) for s in summaries],
            "comparisons": [asdict(cmp) for cmp in comparisons],
            "rounds": [{"path": r.path, "c": r.concurrency, "wall_s": r.wall_s,
                        "cpu_s": r.cpu_s, "tokens": r.tokens, "errors": r.errors[:5],
                        "ttft_ms": [None if q.ttft_s is None else round(q.ttft_s * 1000, 3)
                                    for q in r.requests]} for r in all_rounds],
        }, indent=1) + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
