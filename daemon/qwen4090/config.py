"""Configuration: the one place where defaults live, TOML loading and validation.

Every key is a dataclass field whose metadata carries its one-line help, its
allowed range or choices.  Loading reads the main file, then ``conf.d/*.toml``
next to it in name order (tables merge key by key, later files win), then
checks every key.  Any problem is a :class:`ConfigError` whose message is one
line naming the file, the key, what was found and what is expected, so that a
sysadmin can fix it without reading code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Ubuntu 22.04 only
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/qwen4090/qwen4090.toml")
AUTO = "auto"


class ConfigError(Exception):
    """A configuration problem; ``str()`` is the one line shown to the sysadmin."""

    def __init__(self, file: str | os.PathLike[str] | None, key: str | None, message: str):
        self.file = str(file) if file is not None else None
        self.key = key
        self.message = message
        where = ": ".join(p for p in (self.file, key) if p)
        super().__init__(f"{where}: {message}" if where else message)


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple[Any, ...] | None = None, factory: bool = False) -> Any:
    """A config field: its default, its one-line help, and what values are allowed."""
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if factory:
        return field(default_factory=lambda: default.copy(), metadata=meta)
    return field(default=default, metadata=meta)


# --- sections -------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmConfig:
    command: list[str] = opt(
        ["/opt/qwen4090/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
        "argv that starts vLLM's OpenAI server; the flags below are appended to it",
        factory=True)
    model: str = opt("/var/lib/qwen4090/models/Qwen3-14B-AWQ",
                     "model directory (or hub id, if the runtime may download)")
    served_model_name: str = opt("qwen3-14b", "model name clients send in requests")
    host: str = opt("127.0.0.1", "address vLLM listens on (put a proxy in front for others)")
    port: int = opt(8000, "port vLLM listens on", min=1, max=65535)
    dtype: str = opt("auto", "weights/activations dtype",
                     choices=("auto", "half", "float16", "bfloat16", "float", "float32"))
    quantization: str = opt("", "quantization method (e.g. awq_marlin, fp8); empty = detect "
                                "from the checkpoint")
    max_model_len: int | str = opt(16384, "longest context (prompt + output) in tokens, or "
                                          "\"auto\" for vLLM's choice", min=16)
    max_num_seqs: int | str = opt(32, "sequences scheduled at once, or \"auto\"", min=1)
    max_num_batched_tokens: int | str = opt(8192, "tokens per scheduler step (chunked prefill), "
                                                  "or \"auto\"", min=16)
    gpu_memory_utilization: float = opt(0.92, "fraction of GPU memory vLLM may take",
                                        min=0.05, max=0.99)
    kv_cache_dtype: str = opt("auto", "KV-cache dtype; fp8 halves its size",
                              choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"))
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = opt(True, "split long prompts so they do not stall others")
    block_size: int | str = opt(AUTO, "tokens per KV-cache block (8..128), or \"auto\" for the "
                                      "attention backend's choice (16 on CUDA)", min=8, max=128)
    enforce_eager: bool = opt(False, "skip CUDA graphs and torch.compile (slower, starts faster)")
    api_key_file: str = opt("", "file holding the API key clients must send; empty = no key; "
                                "must not be group/world readable")
    extra_args: list[str] = opt([], "more vLLM flags, appended verbatim (no secrets here)",
                                factory=True)
    env: dict[str, str] = opt({}, "extra environment variables for vLLM", factory=True)


@dataclass(frozen=True)
class WarmupConfig:
    enabled: bool = opt(True, "warm vLLM up before telling systemd READY=1")
    lengths: list[int] = opt([1, 16, 256, 1024, 2048, 4096, 8192],
                             "prompt lengths (tokens) to warm; capped below max_model_len",
                             factory=True)
    concurrency: list[int] = opt([1, 8, 32], "concurrent requests to warm; capped by "
                                             "max_num_seqs", factory=True)
    concurrency_prompt_tokens: int = opt(256, "prompt length used for the concurrency levels",
                                         min=1)
    max_tokens: int = opt(4, "tokens generated by each warmup request", min=1, max=1024)
    request_timeout: float = opt(120.0, "seconds one warmup request may take", min=1)
    timeout: float = opt(900.0, "seconds the whole warmup may take; over it = failed start",
                         min=1)


@dataclass(frozen=True)
class WatchConfig:
    load_timeout: float = opt(1200.0, "seconds from launch to /health 200 before the start "
                                      "counts as failed", min=1)
    poll_interval: float = opt(5.0, "seconds between /health + /metrics polls", min=0.1)
    health_timeout: float = opt(5.0, "seconds a /health or /metrics answer may take", min=0.1)
    unhealthy_timeout: float = opt(30.0, "seconds /health may keep failing before a restart",
                                   min=0.1)
    hang_timeout: float = opt(60.0, "seconds with requests in flight and no token progress "
                                    "before the engine counts as hung", min=0.1)
    canary_interval: float = opt(30.0, "seconds between 1-token canary requests when idle; "
                                       "0 = off", min=0)
    canary_timeout: float = opt(30.0, "seconds a canary request may take", min=0.1)


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial: float = opt(2.0, "seconds before the first restart", min=0)
    backoff_max: float = opt(60.0, "longest wait between restarts", min=0)
    backoff_factor: float = opt(2.0, "growth of the wait after each failure", min=1)
    jitter: float = opt(0.2, "random +/- fraction added to each wait", min=0, max=1)
    budget_failures: int = opt(5, "failures allowed within budget_window before giving up "
                                  "(exit 75)", min=1)
    budget_window: float = opt(600.0, "seconds of the crash-loop window", min=1)
    stable_after: float = opt(300.0, "seconds READY after which the backoff starts over", min=0)
    # recovery (issue 10): what makes a restart shorter
    fixed_kv_budget: bool = opt(False, "start vLLM with --kv-cache-memory-bytes = the KV cache "
                                       "of the last start that reached READY with the same "
                                       "settings and GPU: no memory profiling, the same KV "
                                       "tokens every start (ignores gpu_memory_utilization)")
    readahead: bool = opt(True, "at each launch, read the model's weight files into the page "
                                "cache while vLLM imports (skipped when they exceed half of "
                                "the available memory)")


@dataclass(frozen=True)
class StopConfig:
    drain_timeout: float = opt(30.0, "seconds to let running requests finish on stop", min=0)
    term_timeout: float = opt(15.0, "seconds between SIGTERM and SIGKILL of vLLM's process "
                                    "group", min=0.1)


@dataclass(frozen=True)
class LogConfig:
    format: str = opt("auto", "auto (console on a terminal, else keyvalue), console, keyvalue "
                              "or json", choices=("auto", "console", "keyvalue", "json"))
    level: str = opt("info", "lowest level logged",
                     choices=("debug", "info", "warning", "error"))
    vllm_level: str = opt("info", "lowest level of vLLM's own lines that are re-logged",
                          choices=("debug", "info", "warning", "error"))
    tail_lines: int = opt(200, "vLLM output lines kept to explain an exit (from vLLM's next "
                               "start)", min=10, max=10000)


@dataclass(frozen=True)
class StatusConfig:
    enabled: bool = opt(True, "serve /status, /metrics, /livez, /readyz and a status page")
    host: str = opt("127.0.0.1", "address of the status endpoint (keep it local or behind a "
                                 "proxy: it has no authentication)")
    port: int = opt(8090, "port of the status endpoint (never vLLM's port); when unset, "
                          "vllm.port + 90", min=1, max=65535)


@dataclass(frozen=True)
class GpuConfig:
    enabled: str = opt("auto", "GPU checks: auto (when NVML is present), required (wait for the "
                               "driver, never start without it) or off", choices=("auto",
                                                                                  "required",
                                                                                  "off"))
    device: int = opt(0, "NVML index of the GPU vLLM uses; when unset, the first index in "
                         "vllm.env.CUDA_VISIBLE_DEVICES", min=0)
    driver_wait: float = opt(60.0, "seconds to wait at start-up (only: not on reload) for the "
                                   "NVIDIA driver (NVML, /dev/nvidia-uvm)", min=0)
    memory_gib: float = opt(0.0, "plan for this much GPU memory (GiB); 0 = read it from NVML",
                            min=0)
    plan_check: str = opt("refuse", "explicit settings the KV-cache plan says cannot fit: "
                                    "refuse (exit 78), warn, or off",
                          choices=("refuse", "warn", "off"))
    oom_ladder: bool = opt(True, "after an out-of-memory exit, restart one rung down (seqs, "
                                 "then memory share, then context) and remember it")
    ladder_util_step: float = opt(0.02, "gpu_memory_utilization step of the OOM ladder",
                                  min=0.005, max=0.2)
    ladder_min_util: float = opt(0.5, "the OOM ladder never lowers gpu_memory_utilization "
                                      "below this", min=0.05, max=0.99)
    ladder_min_len: int = opt(2048, "the OOM ladder never lowers max_model_len below this",
                              min=16)
    state_directory: str = opt("", "where learned settings are kept; empty = $STATE_DIRECTORY "
                                   "(systemd), else /var/lib/qwen4090")
    release_timeout: float = opt(30.0, "seconds to wait after a stop for the old vLLM's GPU "
                                       "memory to be released before relaunching", min=0)
    sample_interval: float = opt(30.0, "seconds between NVML samples (changes are logged); "
                                       "0 = off", min=0)
    temperature_warn: int = opt(85, "GPU temperature (C) that is logged as a warning",
                                min=30, max=120)


@dataclass(frozen=True)
class Config:
    vllm: VllmConfig = field(default_factory=VllmConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    log: LogConfig = field(default_factory=LogConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    # Where the config came from (not a key): the main file and the drop-ins read.
    sources: tuple[str, ...] = field(default=(), compare=False)


SECTIONS: dict[str, type] = {"vllm": VllmConfig, "warmup": WarmupConfig, "watch": WatchConfig,
            "restart": RestartConfig, "stop": StopConfig, "log": LogConfig,
            "status": StatusConfig, "gpu": GpuConfig}

# Sections whose change needs a new vLLM process; the rest apply live on SIGHUP.
RESTART_SECTIONS = ("vllm",)


# --- loading ----------------------------------------------------------------------------------


def drop_in_dir(main: Path) -> Path:
    return main.parent / "conf.d"


def load(path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH) -> Config:
    """Read the main file and its drop-ins; raise ConfigError on the first problem."""
    main = Path(path)
    raw: dict[str, Any] = {}
    owner: dict[str, str] = {}  # "section.key" -> file that set it, for error messages
    files = [main]
    ddir = drop_in_dir(main)
    if ddir.is_dir():
        files += sorted(p for p in ddir.iterdir() if p.suffix == ".toml" and p.is_file())
    for f in files:
        data = _read_toml(f)
        _merge(raw, data, owner, str(f))
    return from_dict(raw, owner, default_file=str(main), sources=tuple(str(f) for f in files))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found; create it (see "
                                      "/usr/share/doc/qwen4090) or pass --config FILE") from None
    except PermissionError:
        raise ConfigError(path, None, "permission denied; make it readable by the service "
                                      "user (e.g. chmod 640, group qwen4090)") from None
    except IsADirectoryError:
        raise ConfigError(path, None, "is a directory; expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, None, f"invalid TOML: {e}; fix the syntax") from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror}") from None


def _merge(raw: dict[str, Any], data: dict[str, Any], owner: dict[str, str], file: str) -> None:
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(file, section, f"found a value ({_show(table)}), expected a "
                                             f"[{section}] table")
        dest = raw.setdefault(section, {})
        for key, value in table.items():
            dest[key] = value
            owner[f"{section}.{key}"] = file
        owner.setdefault(section, file)


def from_dict(raw: Mapping[str, Any], owner: Mapping[str, str] | None = None,
              default_file: str | None = None, sources: tuple[str, ...] = ()) -> Config:
    """Validate a plain dict (as parsed from TOML) into a Config."""
    owner = owner or {}
    sections: dict[str, Any] = {}
    for name, table in raw.items():
        if name not in SECTIONS:
            raise ConfigError(owner.get(name, default_file), name,
                              f"unknown section; expected one of {', '.join(SECTIONS)}")
        cls = SECTIONS[name]
        hints = get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            dotted = f"{name}.{key}"
            file = owner.get(dotted, default_file)
            if key not in known:
                close = _closest(key, known)
                hint = f"; did you mean {name}.{close}?" if close else ""
                raise ConfigError(file, dotted, f"unknown key{hint} (known: "
                                                f"{', '.join(known)})")
            values[key] = _check(file, dotted, value, hints[key], known[key].metadata)
        sections[name] = cls(**values)
    cfg = Config(**sections, sources=sources)
    # --- hook (H4 pkg, issue 9 item 12): status.port and gpu.device derived from vllm.* ---
    from qwen4090 import derived

    given = {f"{name}.{key}" for name, table in raw.items() for key in table}
    cfg = derived.apply(cfg, given, owner, default_file)
    # --- end hook
    _check_relations(cfg, owner, default_file)
    return cfg


def _check(file: str | None, key: str, value: Any, typ: Any, meta: Mapping[str, Any]) -> Any:
    expected = _describe(typ, meta)

    def bad(why: str = "") -> ConfigError:
        return ConfigError(file, key, f"found {_show(value)}, expected {expected}{why}")

    origin = get_origin(typ)
    if _is_union(typ):
        # int | str means: an integer, or the word "auto".
        if value == AUTO:
            return value
        typ = int
        origin = None
    if typ is bool:
        if not isinstance(value, bool):
            raise bad()
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        if not math.isfinite(value):
            raise bad()
        value = float(value)
    elif typ is str:
        if not isinstance(value, str):
            raise bad()
    elif origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise bad()
        if item is int and meta.get("min") is None and any(v < 1 for v in value):
            raise bad(" (each at least 1)")
        return list(value)
    elif origin is dict:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise bad()
        return dict(value)
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if choices is not None and value not in choices:
        raise bad()
    if lo is not None and value < lo:
        raise bad()
    if hi is not None and value > hi:
        raise bad()
    return value


def _check_relations(cfg: Config, owner: Mapping[str, str], default_file: str | None) -> None:
    """Checks that involve two keys."""
    v = cfg.vllm
    if not v.command:
        raise ConfigError(owner.get("vllm.command", default_file), "vllm.command",
                          "found [], expected the argv that starts vLLM, e.g. "
                          "[\"/opt/qwen4090/venv/bin/python\", \"-m\", "
                          "\"vllm.entrypoints.openai.api_server\"]")
    if not v.model:
        raise ConfigError(owner.get("vllm.model", default_file), "vllm.model",
                          "found \"\", expected a model directory")
    for arg in v.extra_args:
        if arg.split("=", 1)[0] in ("--api-key",):
            raise ConfigError(owner.get("vllm.extra_args", default_file), "vllm.extra_args",
                              "found --api-key, expected no secrets on the command line; "
                              "put the key in a file and set vllm.api_key_file")
    for name in ("VLLM_API_KEY", "NOTIFY_SOCKET"):
        if name in v.env:
            raise ConfigError(owner.get("vllm.env", default_file), f"vllm.env.{name}",
                              "is set by qwen4090 itself; remove it (API key: "
                              "vllm.api_key_file)")
    st = cfg.status
    if st.enabled and st.port == v.port:
        raise ConfigError(owner.get("status.port", default_file), "status.port",
                          f"found {st.port}, expected a port other than vllm.port ({v.port})")
    r = cfg.restart
    if r.backoff_max < r.backoff_initial:
        raise ConfigError(owner.get("restart.backoff_max", default_file), "restart.backoff_max",
                          f"found {r.backoff_max}, expected at least restart.backoff_initial "
                          f"({r.backoff_initial})")


def _describe(typ: Any, meta: Mapping[str, Any]) -> str:
    origin = get_origin(typ)
    if _is_union(typ):
        base = "an integer or \"auto\""
    elif typ is bool:
        base = "true or false"
    elif typ is int:
        base = "an integer"
    elif typ is float:
        base = "a number"
    elif typ is str:
        base = "a string"
    elif origin is list:
        (item,) = get_args(typ)
        base = "a list of integers" if item is int else "a list of strings"
    elif origin is dict:
        base = "a table of string values"
    else:  # pragma: no cover
        base = str(typ)
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if choices is not None:
        return "one of " + ", ".join(_show(c) for c in choices)
    if lo is not None and hi is not None:
        return f"{base} from {_num(lo)} to {_num(hi)}"
    if lo is not None:
        return f"{base} of at least {_num(lo)}"
    if hi is not None:
        return f"{base} of at most {_num(hi)}"
    return base


def _is_union(typ: Any) -> bool:
    origin = get_origin(typ)
    return origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, dict):
        return "a table"
    return repr(value)


def _closest(key: str, known: Mapping[str, Any]) -> str | None:
    import difflib

    found = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return found[0] if found else None


# --- views ------------------------------------------------------------------------------------


def defaults_as_dict() -> dict[str, dict[str, Any]]:
    """The defaults, as the TOML file would spell them."""
    return as_dict(Config())


def as_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def field_help() -> dict[str, str]:
    """'section.key' -> one-line help, for docs and the shipped TOML's comments."""
    return {f"{name}.{f.name}": f.metadata["help"]
            for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def changed_sections(old: Config, new: Config) -> list[str]:
    return [name for name in SECTIONS if getattr(old, name) != getattr(new, name)]


def read_secret(path: str) -> str:
    """Read the API key file, refusing loose permissions (ConfigError names the fix)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(p, "vllm.api_key_file",
                          "file not found; create it with the key (chmod 600) or set "
                          "api_key_file = \"\"") from None
    except PermissionError:
        raise ConfigError(p, "vllm.api_key_file", "permission denied; make it readable by "
                                                  "the service user only (chmod 600)") from None
    if st.st_mode & 0o077:
        raise ConfigError(p, "vllm.api_key_file", f"mode {oct(st.st_mode & 0o777)} lets other "
                                                  "users read the key; run chmod 600 on it")
    try:
        key = p.read_text(encoding="utf-8").strip()
    except PermissionError:
        raise ConfigError(p, "vllm.api_key_file", "permission denied; make it readable by "
                                                  "the service user only (chmod 600)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(p, "vllm.api_key_file", f"cannot read the key: {e}") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(p, "vllm.api_key_file", "expected one line holding the key, without "
                                                  "spaces")
    return key


def render_toml(cfg: Config | None = None) -> str:
    """The config as a commented TOML file (the shipped etc/ file is this, for the defaults)."""
    cfg = cfg or Config()
    helps = field_help()
    out = ["# qwen4090 configuration. Every key is shown with its default; delete a key to use",
           "# the default. Drop-ins in conf.d/*.toml next to this file are merged in name order.",
           "# Check a change with: qwen4090 check-config",
           ""]
    for name in SECTIONS:
        out.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            out.append(f"# {helps[f'{name}.{key}']}")
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)  # pragma: no cover
