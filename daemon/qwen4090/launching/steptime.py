"""The longest engine step the settings allow, as the last warmup measured it (issue 18.5).

Why: the hang watch (policy.HangDetector) calls a busy engine hung when its progress counter
stays flat for watch.hang_timeout, and one engine step -- a prefill of max_num_batched_tokens
tokens -- moves no counter while it runs.  A hang_timeout near one step restarts a healthy
engine.  The warmup times that step (warmup.step_length); the daemon logs it
(``warmup_finished longest_step_seconds=``), keeps the last value here, and warns when
hang_timeout is below policy.SAFE_STEP_MULTIPLE times it: after the warmup, on a reload that
changes [watch], and in ``qwen4090 check-config`` (against this file, for the same settings).

What: ``longest_step.json`` in the state directory, with the settings that decide a step's
length (a value measured for other settings is not held against these).  Written with
atomicfile like kv_budget.json; a state directory that cannot be written (full, read-only, not
ours; issue 18.1) costs only the file: the value is kept in this process instead, and
``state_not_saved`` says so once per file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwen4090.base import atomicfile, logs
from qwen4090.launching import learned
from qwen4090.settings.config import Config

FILE_NAME = "longest_step.json"
LOG = logs.get_logger()  # a lazy proxy: the configuration in effect at each call

# What could not be written stays here for the life of this process (keyed by path).


def settings(cfg: Config) -> dict[str, Any]:
    """What decides how long one engine step takes: the model and its dtypes, the step's
    token budget, the context, the batch."""
    v = cfg.vllm
    return {"model": v.model, "dtype": v.dtype, "quantization": v.quantization,
            "kv_cache_dtype": v.kv_cache_dtype, "enforce_eager": v.enforce_eager,
            "max_model_len": v.max_model_len, "max_num_seqs": v.max_num_seqs,
            "max_num_batched_tokens": v.max_num_batched_tokens,
            "enable_chunked_prefill": v.enable_chunked_prefill,
            "tensor_parallel_size": v.tensor_parallel_size}


class StepStore:
    """longest_step.json in the state directory."""

    def __init__(self, directory: Path, wall: Callable[[], float] = time.time,
                 log: Any = LOG) -> None:
        self.path = Path(directory) / FILE_NAME
        self.wall = wall
        self.state = atomicfile.JsonState(self.path, log)

    @classmethod
    def of(cls, cfg: Config, log: Any = LOG) -> StepStore:
        """The store in ``cfg``'s state directory (learned.state_dir)."""
        return cls(learned.state_dir(cfg), log=log)

    def read(self) -> dict[str, Any]:
        """What is on disk (or kept in this process); {} when nothing was measured."""
        return self.state.read()

    def measured(self, cfg: Config) -> float | None:
        """The seconds of the longest step measured with ``cfg``'s settings, or None."""
        data = self.read()
        seconds = data.get("seconds")
        if data.get("settings") != settings(cfg) or isinstance(seconds, bool) \
                or not isinstance(seconds, (int, float)) or seconds <= 0:
            return None
        return float(seconds)

    def record(self, cfg: Config, seconds: float, tokens: int) -> bool:
        """Keep the last measurement; True when it is on disk."""
        data = {"version": 1, "seconds": round(seconds, 4), "prompt_tokens": tokens,
                "time": round(self.wall(), 3), "settings": settings(cfg)}
        return self.state.write(data, "the longest engine step",
                                "check-config cannot hold watch.hang_timeout against it")


class StepTimes:
    """The supervisor's part (contracts.StepTimesLike, Parts.step_times): the store of the
    config it is given at each call, since a reload may move the state directory."""

    def __init__(self, log: Any = LOG) -> None:
        self.log = log

    def record(self, cfg: Config, seconds: float, tokens: int) -> bool:
        return StepStore.of(cfg, self.log).record(cfg, seconds, tokens)

    def measured(self, cfg: Config) -> float | None:
        return StepStore.of(cfg, self.log).measured(cfg)
