"""Warmup: exact-length prompts and concurrent batches before READY=1.

Two sweeps: prompt lengths at concurrency 1 (prefill shapes; the TTFT per length is what we
report), then concurrency levels with a short prompt (decode batch shapes).  Prompts are token
ids drawn at random from a range every real vocabulary has, so each prompt is exactly N tokens
and prefix caching cannot make a warmup request look faster than a user's would be.

Under client load (a restart while clients keep sending: issue 18.4) the new vLLM takes their
requests as soon as it listens, and the warmup's queue behind them.  The warmup reads vLLM's
progress counter (/metrics) before each step: a request that times out while the counter moved
was queued behind work, so the engine is busy, not broken, and the warmup ends OK with the
remaining steps skipped (``cut_short`` says why); with clients already queued a request waits
at most watch.hang_timeout (policy.warmup_request_wait).  Nothing here outlasts
policy.warmup_bound (the supervisor's WARMING limit).

The warmup also times the longest engine step the settings allow (issue 18.5): a prefill of
max_num_batched_tokens tokens when chunked prefill is on (a step of its own when the lengths
do not have it), else the longest prompt it sends (:func:`step_length`).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from qwen4090.base import vllmfacts
from qwen4090.base.redact import safe_error
from qwen4090.base.vllmfacts import RUNNING, WAITING
from qwen4090.decide.policy import (
    WARMUP_JOIN_GRACE,
    queued_behind_work,
    serving_clients,
    warmup_request_wait,
)
from qwen4090.decide.results import (
    CompletionResult,
    MetricsResult,
    ProbeLike,
    WarmupResult,
    WarmupRow,
)
from qwen4090.settings.config import AUTO, Config

TOKEN_ID_RANGE = (100, 1000)  # ids below 1000 exist in every tokenizer we serve


@dataclass(frozen=True)
class WarmupStep:
    length: int  # prompt tokens
    concurrency: int


def step_length(cfg: Config) -> int | None:
    """The prompt whose prefill is the longest engine step the settings allow, when the
    warmup can send it: max_num_batched_tokens tokens (capped below max_model_len) when
    chunked prefill is on, since longer prompts are cut into steps of that many tokens; None
    when chunked prefill is off or max_num_batched_tokens is "auto" (then the longest prompt
    the warmup sends is timed: a prompt is one step without chunking)."""
    v = cfg.vllm
    if not v.enable_chunked_prefill or not isinstance(v.max_num_batched_tokens, int):
        return None
    n = v.max_num_batched_tokens
    if isinstance(v.max_model_len, int):
        n = min(n, v.max_model_len - cfg.warmup.max_tokens)
    return n if n >= 1 else None


def plan_steps(cfg: Config) -> tuple[list[WarmupStep], list[str]]:
    """The requests to send, capped by max_model_len and max_num_seqs; plus what was skipped.
    The longest step's prompt (:func:`step_length`) is added when the lengths lack it."""
    w, v = cfg.warmup, cfg.vllm
    limit = v.max_model_len if isinstance(v.max_model_len, int) else None
    seqs = v.max_num_seqs if isinstance(v.max_num_seqs, int) else None
    steps, skipped = [], []
    lengths = set(w.lengths)
    if (longest := step_length(cfg)) is not None:
        lengths.add(longest)
    for n in sorted(lengths):
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
    look = cfg.watch.health_timeout
    rng = random.Random(seed)
    start = clock()
    deadline = start + w.timeout
    result = WarmupResult(ok=True, skipped=skipped)
    last: MetricsResult | None = None  # the look before the previous step
    for i, step in enumerate(steps):
        before = probe.metrics(look)  # none of our requests is in flight here
        left = deadline - clock()
        if left <= 0:
            if last is not None and _clients_served(last, before):
                _cut_short(result, steps[i:], f"warmup.timeout ({w.timeout:g}s) reached "
                                              "while the engine serves clients: "
                                              + _moved(last, before))
            else:
                result.ok = False
                result.error = f"warmup took longer than warmup.timeout ({w.timeout:g}s)"
            break
        last = before
        t0 = clock()
        prompts = [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(step.length)]
                   for _ in range(step.concurrency)]
        queued = before.ok and before.get(WAITING) > 0
        timeout = warmup_request_wait(w.request_timeout, left, cfg.watch.hang_timeout, queued)

        def one(prompt: list[int], t: float = timeout) -> CompletionResult:
            return probe.complete(prompt, w.max_tokens, t)

        outs = _parallel(one, prompts, timeout + WARMUP_JOIN_GRACE)
        bad = [o for o in outs if not o.ok]
        if bad:
            after = probe.metrics(look)
            b, a = _progress(before), _progress(after)
            if all(queued_behind_work(o.timed_out, b, a) for o in bad):
                _cut_short(result, steps[i:], "engine busy with client requests: "
                                              + _moved(before, after))
                break
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
    result.longest_step = _longest_step(cfg, result)
    return result


def _longest_step(cfg: Config, result: WarmupResult) -> tuple[float, int] | None:
    """The TTFT of the longest step's prompt (step_length, else the longest one sent alone):
    its prefill, which moves no counter while it runs.  None when it was not sent."""
    singles = [r for r in result.rows if r.concurrency == 1]
    length = step_length(cfg)
    if length is None and singles:
        length = max(r.length for r in singles)
    ttft = result.ttft_at(length) if length is not None else None
    return None if ttft is None or length is None else (ttft / 1000, length)


def _progress(m: MetricsResult) -> float | None:
    return vllmfacts.progress_counter(m.values) if m.ok else None


def _clients_served(before: MetricsResult, now: MetricsResult) -> bool:
    return now.ok and serving_clients(now.get(RUNNING), now.get(WAITING), _progress(before),
                                      _progress(now))


def _moved(before: MetricsResult, after: MetricsResult) -> str:
    """'N tokens generated meanwhile (R running, W waiting)', from two /metrics looks."""
    b, a = _progress(before), _progress(after)
    n = a - b if a is not None and b is not None else 0.0
    return (f"{n:.0f} tokens generated meanwhile ({after.get(RUNNING):g} running, "
            f"{after.get(WAITING):g} waiting)")


def _cut_short(result: WarmupResult, rest: list[WarmupStep], why: str) -> None:
    """End the warmup OK: the engine makes progress, serving others first."""
    result.cut_short = why
    result.skipped += [f"{s.length} tokens x{s.concurrency} (warmup cut short: engine busy)"
                       for s in rest]


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
                                                     f"no answer within {timeout:g}s",
                                                     timed_out=True)
            for o in outs]
