"""The OOM ladder: after vLLM ran out of memory, the one setting to lower before the next try.

Pure: it reads vLLM's last output lines and the limits the failed process ran with, and returns
the next rung (or None when no rung is left).  Which rung depends on what ran out, because
lowering the wrong knob only costs another minute-long start:

- ``To serve at least one request with the model's max seq len (N) ... estimated maximum model
  length is M`` (or ``... larger than the maximum number of tokens that can be stored in KV
  cache``): the context does not fit; max_model_len goes to vLLM's own estimate M (rounded down
  to 256), else to half.
- ``Free memory on device (F/T GiB) ... less than desired GPU memory utilization``: something
  else holds GPU memory; gpu_memory_utilization goes to what is free (minus one step).
- ``No available memory for the cache blocks``: weights and activations exceed the budget;
  only a smaller prefill batch (max_num_batched_tokens, halved down to 2048) helps here.
- ``CUDA out of memory`` / ``torch.OutOfMemoryError`` / ``CUDA error: out of memory``
  (profiling, graph capture, serving), and the CPU backend's host memory: the general
  ladder, one rung per failure: max_num_seqs halved (down to 8, then 1), then
  gpu_memory_utilization down by ``step`` (to a floor), then max_model_len halved (to a floor).

The texts themselves are vllmfacts.OOM_TEXTS, one table with policy.classify_exit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qwen4090.base.vllmfacts import OOM_KINDS, OomKind, estimated_max_len, free_memory_gib, says_oom


@dataclass(frozen=True)
class OomFacts:
    kind: OomKind
    line: str
    estimated_max_len: int | None = None
    free_gib: float | None = None
    total_gib: float | None = None


@dataclass(frozen=True)
class Limits:
    """The settings the failed vLLM ran with (no "auto" left: the plan resolved them)."""

    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float


@dataclass(frozen=True)
class Floors:
    util_step: float = 0.02
    min_util: float = 0.5
    min_len: int = 2048
    min_batched: int = 2048


@dataclass(frozen=True)
class Rung:
    key: str  # max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization
    old: float
    new: float
    why: str

    def describe(self) -> str:
        return f"{self.key} {_fmt(self.old)} -> {_fmt(self.new)} ({self.why})"


def read_oom(lines: Iterable[str]) -> OomFacts | None:
    """What ran out, from vLLM's output (the most specific message wins).

    The texts are vllmfacts.OOM_TEXTS, the table policy.classify_exit reads too: a line is
    an OOM for one exactly when it is for the other.
    """
    lines = list(lines)
    for kind in OOM_KINDS:
        for line in reversed(lines):
            if not says_oom(line, kind):
                continue
            if kind is OomKind.CONTEXT_TOO_LONG:
                return OomFacts(kind, line.strip(), estimated_max_len=estimated_max_len(line))
            if kind is OomKind.OTHERS_HOLD_MEMORY:
                free, total = free_memory_gib(line) or (None, None)
                return OomFacts(kind, line.strip(), free_gib=free, total_gib=total)
            return OomFacts(kind, line.strip())
    return None


def next_rung(facts: OomFacts | None, limits: Limits, floors: Floors = Floors()
              ) -> Rung | None:
    """One step down for this failure, or None when nothing is left to lower."""
    kind = facts.kind if facts else OomKind.CUDA_OOM
    if kind == OomKind.CONTEXT_TOO_LONG:
        return _shorter_context(limits, floors, facts.estimated_max_len if facts else None)
    if kind == OomKind.OTHERS_HOLD_MEMORY:
        assert facts is not None
        return _less_memory(limits, floors, facts)
    if kind == OomKind.NO_CACHE_BLOCKS:
        b = limits.max_num_batched_tokens
        if b is not None and b > floors.min_batched:
            return Rung("max_num_batched_tokens", b, max(floors.min_batched, b // 2),
                        "weights + activations left no KV cache: a smaller prefill batch")
        return None
    # General CUDA OOM (and the CPU backend's host memory): seqs, utilization, context.
    s = limits.max_num_seqs
    if s is not None and s > 1:
        new = s // 2 if s > 16 else (8 if s > 8 else max(1, s // 2))
        return Rung("max_num_seqs", s, new, "out of memory: fewer sequences at once")
    u = limits.gpu_memory_utilization
    if u - floors.util_step >= floors.min_util - 1e-9:
        return Rung("gpu_memory_utilization", u, round(u - floors.util_step, 3),
                    "out of memory: more room outside vLLM's budget")
    return _shorter_context(limits, floors, None)


def _shorter_context(limits: Limits, floors: Floors, estimate: int | None) -> Rung | None:
    n = limits.max_model_len
    if n is None or n <= floors.min_len:
        return None
    if estimate is not None and estimate < n:
        new = max(floors.min_len, estimate // 256 * 256 if estimate >= 256 else estimate)
        why = f"vLLM estimated at most {estimate} tokens fit"
    else:
        new = max(floors.min_len, n // 2)
        why = "the context does not fit the KV cache"
    return Rung("max_model_len", n, new, why) if new < n else None


def _less_memory(limits: Limits, floors: Floors, facts: OomFacts) -> Rung | None:
    u = limits.gpu_memory_utilization
    target = u - floors.util_step
    if facts.free_gib and facts.total_gib:
        target = min(target, facts.free_gib / facts.total_gib - floors.util_step)
    target = round(int(target * 100) / 100, 2)
    if target < floors.min_util - 1e-9 or target >= u:
        return None
    return Rung("gpu_memory_utilization", u, target,
                "other processes hold GPU memory: a smaller share")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
