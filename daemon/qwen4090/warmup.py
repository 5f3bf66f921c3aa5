"""Warmup: exact-length prompts and concurrent batches before READY=1.

Two sweeps: prompt lengths at concurrency 1 (prefill shapes; the TTFT per length is what we
report), then concurrency levels with a short prompt (decode batch shapes).  Prompts are token
ids drawn at random from a range every real vocabulary has, so each prompt is exactly N tokens
and prefix caching cannot make a warmup request look faster than a user's would be.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qwen4090.config import AUTO, Config
from qwen4090.probes.http import CompletionResult, ProbeLike
from qwen4090.redact import safe_error

TOKEN_ID_RANGE = (100, 1000)  # ids below 1000 exist in every tokenizer we serve


@dataclass(frozen=True)
class WarmupStep:
    length: int  # prompt tokens
    concurrency: int


@dataclass
class WarmupRow:
    length: int
    concurrency: int
    ttft_ms: float  # median over the concurrent requests
    ttft_max_ms: float
    seconds: float


@dataclass
class WarmupResult:
    ok: bool
    rows: list[WarmupRow] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    skipped: list[str] = field(default_factory=list)

    def ttft_at(self, length: int) -> float | None:
        for r in self.rows:
            if r.length == length and r.concurrency == 1:
                return r.ttft_ms
        return None

    def ttft_near(self, length: int) -> tuple[int, float] | None:
        """The concurrency-1 row whose length is closest to ``length`` (for STATUS=)."""
        singles = [r for r in self.rows if r.concurrency == 1]
        if not singles:
            return None
        r = min(singles, key=lambda r: abs(r.length - length))
        return r.length, r.ttft_ms

    def table(self) -> str:
        """One line: 'len=ttft_ms' pairs, then 'xC=ttft_ms' for the concurrency sweep."""
        lens = " ".join(f"{r.length}:{r.ttft_ms:.0f}ms" for r in self.rows if r.concurrency == 1)
        conc = " ".join(f"x{r.concurrency}:{r.ttft_ms:.0f}/{r.ttft_max_ms:.0f}ms"
                        for r in self.rows if r.concurrency > 1)
        return f"ttft by prompt length [{lens}] by concurrency p50/max [{conc}]"


def plan_steps(cfg: Config) -> tuple[list[WarmupStep], list[str]]:
    """The requests to send, capped by max_model_len and max_num_seqs; plus what was skipped."""
    w, v = cfg.warmup, cfg.vllm
    limit = v.max_model_len if isinstance(v.max_model_len, int) else None
    seqs = v.max_num_seqs if isinstance(v.max_num_seqs, int) else None
    steps, skipped = [], []
    for n in sorted(set(w.lengths)):
        if limit is not None and n + w.max_tokens > limit:
            skipped.append(f"length {n} (max_model_len {limit})")
            continue
        steps.append(WarmupStep(n, 1))
    short = w.concurrency_prompt_tokens
    if limit is not None:
        short = min(short, max(1, limit - w.max_tokens))
    for c in sorted(set(w.concurrency)):
        if c == 1:
            continue
        if seqs is not None and c > seqs:
            skipped.append(f"concurrency {c} (max_num_seqs {seqs})")
            continue
        if limit is not None and short + w.max_tokens > limit:  # not even a 1-token prompt
            skipped.append(f"concurrency {c} (max_model_len {limit})")
            continue
        steps.append(WarmupStep(short, c))
    return steps, skipped


def run(cfg: Config, probe: ProbeLike, on_progress: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> WarmupResult:
    steps, skipped = plan_steps(cfg)
    if cfg.vllm.max_model_len == AUTO:
        skipped.append("no length cap known (max_model_len = \"auto\"): lengths sent as listed")
    w = cfg.warmup
    rng = random.Random(seed)
    start = clock()
    deadline = start + w.timeout
    result = WarmupResult(ok=True, skipped=skipped)
    for step in steps:
        left = deadline - clock()
        if left <= 0:
            result.ok = False
            result.error = f"warmup took longer than warmup.timeout ({w.timeout:g}s)"
            break
        t0 = clock()
        prompts = [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(step.length)]
                   for _ in range(step.concurrency)]
        timeout = min(w.request_timeout, left)

        def one(prompt: list[int], t: float = timeout) -> CompletionResult:
            return probe.complete(prompt, w.max_tokens, t)

        outs = _parallel(one, prompts, timeout + 5)
        bad = [o for o in outs if not o.ok]
        if bad:
            result.ok = False
            result.error = (f"request of {step.length} tokens x{step.concurrency} failed: "
                            f"{bad[0].error}")
            break
        ttfts = [o.ttft * 1000 for o in outs if o.ttft is not None]
        row = WarmupRow(step.length, step.concurrency, statistics.median(ttfts), max(ttfts),
                        clock() - t0)
        result.rows.append(row)
        if on_progress:
            on_progress(f"{step.length} tokens x{step.concurrency}: TTFT {row.ttft_ms:.0f} ms")
    result.seconds = clock() - start
    return result


def _parallel(fn: Callable[[list[int]], CompletionResult], prompts: list[list[int]],
              timeout: float) -> list[CompletionResult]:
    """Run fn over prompts at once on daemon threads (never blocks the process's exit)."""
    outs: list[CompletionResult | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            outs[i] = fn(prompts[i])
        except Exception as e:  # said as what it is, not as "no answer within 125s"
            outs[i] = CompletionResult(False, None, 0.0, 0, safe_error(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name="warmup")
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [o if o is not None else CompletionResult(False, None, timeout, 0,
                                                     f"no answer within {timeout:g}s")
            for o in outs]
