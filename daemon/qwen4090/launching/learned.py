"""Settings learned from out-of-memory restarts, kept in the state directory across starts.

A learned value is a ceiling: it replaces "auto" and lowers an explicit setting, never raises
one.  It belongs to one model on one GPU (a fingerprint of the settings that decide memory use):
when the fingerprint changes, what was learned no longer applies and is ignored (and said so).
`qwen4090 reset-learned` forgets it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from qwen4090.base import atomicfile
from qwen4090.settings.config import AUTO, Config, ConfigError, VllmConfig, _check

FILE_NAME = "learned.json"
DEFAULT_STATE_DIR = "/var/lib/qwen4090"
KEYS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization")


INSTANCES_DIR_NAME = "instances"


def state_dir(cfg: Config, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if cfg.gpu.state_directory:
        return Path(cfg.gpu.state_directory)
    # qwen4090@NAME reads /etc/qwen4090/instances/NAME.toml and has StateDirectory=qwen4090/NAME:
    # derived from the config file, so `plan -c`/`reset-learned -c` from a shell (no
    # $STATE_DIRECTORY) read the same learned.json as the instance's daemon (issue 9).
    main = Path(cfg.sources[0]) if cfg.sources else None
    if main is not None and main.parent.name == INSTANCES_DIR_NAME and main.suffix == ".toml":
        return Path(DEFAULT_STATE_DIR) / main.stem
    # systemd's StateDirectory= may list several, separated by ':'; the first is ours.
    sd = env.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(sd or DEFAULT_STATE_DIR)


def fingerprint(cfg: Config, gpu_name: str, gpu_bytes: int) -> dict[str, Any]:
    v = cfg.vllm
    fp: dict[str, Any] = {"model": v.model, "quantization": v.quantization, "dtype": v.dtype,
                          "kv_cache_dtype": v.kv_cache_dtype, "enforce_eager": v.enforce_eager,
                          "gpu": gpu_name, "gpu_gib": round(gpu_bytes / 1024 ** 3, 1)}
    if v.tensor_parallel_size > 1:  # only then: files learned before the key still match
        fp["tensor_parallel_size"] = v.tensor_parallel_size
    return fp


@dataclass(frozen=True)
class SaveFailure:
    """Why learned settings could not be written, and what the sysadmin does about it."""

    path: str
    error: str  # atomicfile.cause: "disk full (ENOSPC)", "read-only file system (EROFS)"...
    hint: str

    def line(self) -> str:
        return f"cannot save learned settings to {self.path}: {self.error}; {self.hint}"


# What could not be written stays here for the life of this process, so a step-down still
# applies to the next launch even when the state directory is not writable.
_unsaved: dict[Path, dict[str, Any]] = {}
_unsaved_lock = threading.Lock()


class LearnedStore:
    def __init__(self, directory: Path, clock: Any = time.time) -> None:
        self.dir = Path(directory)
        self.path = self.dir / FILE_NAME
        self.clock = clock

    def read(self) -> dict[str, Any]:
        with _unsaved_lock:
            if self.path in _unsaved:
                return copy.deepcopy(_unsaved[self.path])
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # unreadable or torn: as if nothing was learned
        return data if isinstance(data, dict) else {}

    def apply(self, cfg: Config, fp: dict[str, Any]) -> tuple[Config, list[str]]:
        """cfg with learned ceilings applied, and one line per value applied (or ignored)."""
        return applied(cfg, self.read(), fp)

    def record(self, key: str, value: float, fp: dict[str, Any], why: str
               ) -> SaveFailure | None:
        """Remember a learned ceiling; None when saved, else why not (it still applies in
        this process: the supervisor must never die, or forget a step-down, over a disk)."""
        data = self.read()
        if data.get("fingerprint") != fp:
            data = {}
        settings = dict(data.get("settings") or {})
        settings[key] = value
        history = list(data.get("history") or [])[-19:]
        history.append({"time": round(self.clock(), 3), "key": key, "value": value, "why": why})
        new = {"version": 1, "fingerprint": fp, "settings": settings, "history": history}
        try:
            self._write(new)
        except OSError as e:
            with _unsaved_lock:
                _unsaved[self.path] = new
            return SaveFailure(str(self.path), atomicfile.cause(e),
                               f"free space in {self.dir}, or create it owned by the "
                               "service user, or set gpu.state_directory to a writable "
                               "directory; until then it applies only until qwen4090 exits")
        with _unsaved_lock:
            _unsaved.pop(self.path, None)
        return None

    def reset(self) -> list[str]:
        settings = sorted(self.read().get("settings") or {})
        with _unsaved_lock:
            _unsaved.pop(self.path, None)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # no file: done
            self.path.unlink()
        return settings

    def _write(self, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomicfile.write_text(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")



def applied(cfg: Config, data: Mapping[str, Any], fp: dict[str, Any]
            ) -> tuple[Config, list[str]]:
    """cfg with the learned ceilings of `data` (learned.json) applied, and one line per value
    applied (or ignored).  Pure: launch.resolve calls it with what LearnedStore.read found."""
    settings = data.get("settings") or {}
    if not settings:
        return cfg, []
    if data.get("fingerprint") != fp:
        return cfg, [f"ignored learned {', '.join(sorted(settings))}: learned for another "
                     "model, GPU or dtype"]
    v = cfg.vllm
    changes: dict[str, Any] = {}
    notes = []
    for key in KEYS:
        if key not in settings:
            continue
        learned = _valid(key, settings[key])
        if learned is None:  # a hand-edited or foreign file: never a crash over it
            notes.append(f"ignored learned {key}: {settings[key]!r:.40} is not a valid "
                         f"vllm.{key}")
            continue
        current = getattr(v, key)
        if current == AUTO or (isinstance(current, (int, float)) and learned < current):
            changes[key] = learned
            notes.append(f"{key} {current} -> {learned}")
    if not changes:
        return cfg, notes
    return dataclasses.replace(cfg, vllm=dataclasses.replace(v, **changes)), notes


def _valid(key: str, value: Any) -> int | float | None:
    """A learned value as the config would accept it for vllm.<key>, or None."""
    f = {f.name: f for f in dataclasses.fields(VllmConfig)}[key]
    try:
        checked = _check(None, key, value, get_type_hints(VllmConfig)[key], f.metadata)
    except ConfigError:
        return None
    return None if checked == AUTO else checked
