"""NVML: the GPU's memory, its processes, samples of its health, and Xid events.

This module is the one place that provides the NVML binding (``pynvml``) to the rest of the
package (gpu.py, plan.py): at import, whatever nvml_binding finds on the import path or in the
default runtime venv; :func:`bind` adds the venv that the config's ``vllm.command`` runs in
(vLLM's venv carries nvidia-ml-py).  Debian's python3 has no binding of its own, so without
this the package would see no GPU at all.  Without a binding, or without a driver, every
function returns a string saying why instead of raising, so a machine without a GPU runs the
supervisor unchanged.  Nothing here decides anything: results go to the plan, preflight, the
log and the supervisor's listeners.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qwen4090.decide.cudacompat import DriverCuda
from qwen4090.probes import nvml_binding

# The binding: nvidia-ml-py's pynvml module (or vLLM's vendored copy of it); None = none found.
pynvml: Any = nvml_binding.load_pynvml()
_no_binding = (f"no NVML binding: pynvml is not importable and {nvml_binding.DEFAULT_VENV} has "
               "none")
INSTALL_HINT = ("run `qwen4090 install-runtime` (vLLM's venv carries nvidia-ml-py) or point "
                "vllm.command at a venv that has vLLM; python3-pynvml (Debian contrib) also "
                "works")

GIB = 1024 ** 3
UVM_DEVICE = "/dev/nvidia-uvm"
_lock = threading.Lock()
_initialized = False

THROTTLE_NAMES = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal",
    0x40: "hw_thermal", 0x80: "hw_power_brake", 0x200: "board_limit", 0x400: "reliability",
}  # idle (0x1), application clocks (0x2) and display (0x100) are not throttling


def bind(command: Sequence[str]) -> str | None:
    """Find the binding for this config, once: importable, else in the venv of vLLM's
    interpreter (``vllm.command[0]``).  None when there is one, else why not (with the fix)."""
    global pynvml, _no_binding
    if pynvml is not None and not _from_default_venv():
        return None
    venv = nvml_binding.runtime_venv(command)
    if pynvml is not None and (_initialized or venv == nvml_binding.DEFAULT_VENV):
        return None
    # The venv vLLM is configured to run from wins over the default /opt/qwen4090/venv found
    # at import (a system with both: the runtime the config names is the one that matches).
    found = nvml_binding.load_pynvml(venv)
    if found is None and pynvml is not None:
        return None
    if found is None:
        _no_binding = f"no NVML binding: pynvml is not importable and {venv} has none"
        return f"{_no_binding}; {INSTALL_HINT}"
    pynvml = found
    return None


def _from_default_venv() -> bool:
    where = str(getattr(pynvml, "__file__", "") or "")
    return where.startswith(str(nvml_binding.DEFAULT_VENV) + "/")


def binding() -> str:
    """Where the binding was loaded from (for the log), or why there is none."""
    if pynvml is None:
        return _no_binding
    return str(getattr(pynvml, "__file__", None) or getattr(pynvml, "__name__", "pynvml"))


def init() -> str | None:
    """Initialise NVML once per process; None when it works, else why not."""
    global _initialized
    if pynvml is None:
        return f"{_no_binding}; {INSTALL_HINT}"
    with _lock:
        if _initialized:
            return None
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return f"NVML unavailable: {_err(e)}"
        _initialized = True
        return None


def shutdown() -> None:
    global _initialized
    with _lock:
        if _initialized and pynvml is not None:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
        _initialized = False


def _err(e: BaseException) -> str:
    s = str(e) or type(e).__name__
    return s.decode() if isinstance(s, bytes) else s


def _handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def index_of(visible: str) -> int | str:
    """NVML's index of the GPU that one ``CUDA_VISIBLE_DEVICES`` entry names by UUID:
    ``GPU-<uuid>`` (or a unique prefix of one, which CUDA accepts too), ``MIG-<uuid>`` or the
    older ``MIG-GPU-<uuid>/<gi>/<ci>`` (the GPU that holds the MIG instance); a str says why
    not.  CUDA numbers GPUs its own way, NVML by PCI bus: only the UUID is the same to both."""
    why = init()
    if why:
        return why
    name = visible.strip()
    if name.startswith("MIG-GPU-"):  # drivers before R470: MIG-GPU-<uuid>/<gi>/<ci>
        name = name[len("MIG-"):].split("/", 1)[0]
    if not name.startswith(("GPU-", "MIG-")):
        return f"{visible!r} is neither a GPU index nor a GPU-/MIG- UUID"
    try:
        h = pynvml.nvmlDeviceGetHandleByUUID(name)
    except Exception as e:
        h = _handle_by_uuid_prefix(name)
        if h is None:
            return f"NVML knows no GPU with UUID {name!r} ({_err(e)})"
    try:
        if _is_mig(h):
            h = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
        return int(pynvml.nvmlDeviceGetIndex(h))
    except Exception as e:
        return f"no NVML index for {name!r}: {_err(e)}"


def _handle_by_uuid_prefix(prefix: str) -> Any:
    """The one GPU whose UUID starts with ``prefix`` (None: none, or more than one)."""
    if not prefix.startswith("GPU-"):
        return None
    try:
        handles = [_handle(i) for i in range(int(pynvml.nvmlDeviceGetCount()))]
        found = [h for h in handles if _text(pynvml.nvmlDeviceGetUUID(h)).startswith(prefix)]
    except Exception:
        return None
    return found[0] if len(found) == 1 else None


def _is_mig(h: Any) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(h))
    except Exception:  # bindings or drivers without MIG
        return False


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _name(h: Any) -> str:
    n = pynvml.nvmlDeviceGetName(h)
    return n.decode() if isinstance(n, bytes) else str(n)


def driver_cuda() -> DriverCuda | str:
    """The driver's version and the newest CUDA it supports (the preflight compares it with
    the runtime's torch: decide/cudacompat.py); a str says why NVML cannot tell."""
    why = init()
    if why:
        return why
    # _v2 is the name newer bindings prefer; both answer 1000 x major + 10 x minor
    getter = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or \
        getattr(pynvml, "nvmlSystemGetCudaDriverVersion", None)
    if getter is None:
        return "this NVML binding cannot ask the driver's CUDA version"
    try:
        cuda = int(getter())
    except Exception as e:
        return f"NVML CUDA version query failed: {_err(e)}"
    try:
        version = _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # the CUDA version alone decides; the number is for the message
        version = "?"
    return DriverCuda(version, cuda)


@dataclass(frozen=True)
class MemoryInfo:
    name: str
    total: int  # bytes, as NVML reports the card
    reserved: int  # held by the driver/firmware: not usable by CUDA
    used: int
    free: int

    @property
    def usable(self) -> int:
        """What CUDA (and vLLM's utilization) counts as total."""
        return self.total - self.reserved


def memory(index: int = 0) -> MemoryInfo | str:
    why = init()
    if why:
        return why
    try:
        h = _handle(index)
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            reserved = int(getattr(m, "reserved", 0))
        except Exception:
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            reserved = 0
        return MemoryInfo(_name(h), int(m.total), reserved, int(m.used), int(m.free))
    except Exception as e:
        return f"NVML memory query failed: {_err(e)}"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: NVML may not say (containers, MIG)
    name: str  # from /proc, "" when the pid is not visible here

    def describe(self) -> str:
        mem = "?" if self.used_bytes is None else f"{self.used_bytes / GIB:.1f} GiB"
        return f"pid {self.pid} ({self.name or 'not visible here'}) {mem}"


def processes(index: int = 0) -> list[GpuProcess] | str:
    """Processes with a CUDA context on the GPU (compute and graphics)."""
    why = init()
    if why:
        return why
    try:
        h = _handle(index)
        found: dict[int, GpuProcess] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            getter = getattr(pynvml, fn, None)
            if getter is None:
                continue
            with contextlib.suppress(Exception):
                for p in getter(h):
                    used = getattr(p, "usedGpuMemory", None)
                    found[int(p.pid)] = GpuProcess(int(p.pid), int(used) if used else None,
                                                   _proc_name(int(p.pid)))
        return sorted(found.values(), key=lambda p: p.pid)
    except Exception as e:
        return f"NVML process query failed: {_err(e)}"


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        cmd = " ".join(a.decode("utf-8", "replace") for a in argv if a)
        return cmd[:120]
    except OSError:
        return ""


@dataclass(frozen=True)
class Sample:
    memory_used: int
    memory_total: int
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    util_gpu: int | None
    util_memory: int | None
    throttle: tuple[str, ...]
    ecc_corrected: int | None  # volatile (since the driver loaded)
    ecc_uncorrected: int | None

    def fields(self) -> dict[str, Any]:
        return {"mem_used_gib": round(self.memory_used / GIB, 2),
                "mem_total_gib": round(self.memory_total / GIB, 2),
                "temp_c": self.temperature_c,
                "power_w": None if self.power_w is None else round(self.power_w),
                "power_limit_w": None if self.power_limit_w is None else round(self.power_limit_w),
                "util_gpu": self.util_gpu, "util_mem": self.util_memory,
                "throttle": ",".join(self.throttle) or "none",
                "ecc_corrected": self.ecc_corrected, "ecc_uncorrected": self.ecc_uncorrected}

    def metrics(self, index: int) -> dict[str, Any]:
        """The sample as the supervisor's ``gpu_sample`` event: /status shows these fields and
        /metrics exports each number as ``qwen4090_gpu_<key>{gpu="<index>"}`` (the names the
        Grafana dashboard in packaging/examples queries); None = NVML could not say."""
        return {"index": index,
                "memory_used_bytes": self.memory_used, "memory_total_bytes": self.memory_total,
                "temperature_celsius": self.temperature_c,
                "power_watts": self.power_w, "power_limit_watts": self.power_limit_w,
                "utilization_percent": self.util_gpu,
                "memory_utilization_percent": self.util_memory,
                "ecc_corrected_errors": self.ecc_corrected,
                "ecc_uncorrected_errors": self.ecc_uncorrected,
                "throttle": ",".join(self.throttle) or "none"}


def sample(index: int = 0) -> Sample | str:
    why = init()
    if why:
        return why
    try:
        h = _handle(index)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
    except Exception as e:
        return f"NVML sample failed: {_err(e)}"

    def opt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None

    temp = opt(lambda: int(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
    power = opt(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
    limit = opt(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
    util = opt(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
    reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    reasons = opt(lambda: int(reasons_fn(h))) or 0
    throttle = tuple(name for bit, name in THROTTLE_NAMES.items() if reasons & bit)
    ecc_c = opt(lambda: int(pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)))
    ecc_u = opt(lambda: int(pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)))
    return Sample(int(m.used), int(m.total), temp, power, limit,
                  None if util is None else int(util.gpu),
                  None if util is None else int(util.memory), throttle, ecc_c, ecc_u)


def driver_ready() -> str | None:
    """None when NVML answers and /dev/nvidia-uvm exists (CUDA needs both), else why not."""
    why = init()
    if why:
        return why
    if not os.path.exists(UVM_DEVICE):
        return f"{UVM_DEVICE} does not exist yet (nvidia-uvm not loaded; nvidia-modprobe -u -c0)"
    return None


def wait_for_driver(timeout: float, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    on_wait: Callable[[str, float], None] | None = None,
                    stopping: Callable[[], bool] = lambda: False) -> str | None:
    """Wait (bounded) for the driver at boot; None when ready, else the last reason (at once
    when ``stopping`` says a stop was asked for meanwhile)."""
    deadline = clock() + timeout
    last_said = -1e18
    while True:
        why = driver_ready()
        if why is None:
            return None
        now = clock()
        if now >= deadline or stopping():
            return why
        if on_wait is not None and now - last_said >= 10:
            on_wait(why, deadline - now)
            last_said = now
        sleep(min(1.0, max(0.0, deadline - now)))


# --- the watch: samples and Xid events on their own threads --------------------------------


@dataclass
class WatchState:
    """What the last logged sample said; a new one is logged when this changes."""

    mem_gib: float | None = None
    throttle: tuple[str, ...] = ()
    ecc: tuple[int | None, int | None] = (None, None)
    hot: bool = False
    last: Sample | None = None
    samples: int = 0
    xids: list[int] = field(default_factory=list)


class GpuWatch:
    """Samples NVML every ``interval`` s (logging changes, not every sample; handing every
    sample to ``on_sample(index, sample)``) and waits on NVML events for Xid critical errors,
    calling ``on_xid(code)`` for each.  Both callbacks run on the watch's threads."""

    def __init__(self, index: int, interval: float, temperature_warn: int, log: Any,
                 on_xid: Callable[[int], None],
                 on_sample: Callable[[int, Sample], None] = lambda index, s: None) -> None:
        self.index = index
        self.interval = interval
        self.temperature_warn = temperature_warn
        self.log = log
        self.on_xid = on_xid
        self.on_sample = on_sample
        self.state = WatchState()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self.interval > 0:
            self._threads.append(threading.Thread(target=self._sample_loop, daemon=True,
                                                  name="qwen4090-nvml-sample"))
        self._threads.append(threading.Thread(target=self._xid_loop, daemon=True,
                                              name="qwen4090-nvml-xid"))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2.0)

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)

    def sample_once(self) -> Sample | None:
        s = sample(self.index)
        if isinstance(s, str):
            if self.state.samples == 0:
                self.log.warning("gpu_sample_failed", error=s)
            self.state.samples += 1
            return None
        st = self.state
        reasons = []
        mem = round(s.memory_used / GIB, 1)
        if st.samples == 0:
            reasons.append("first")
        if st.mem_gib is not None and abs(mem - st.mem_gib) >= 1.0:
            reasons.append("memory")
        if s.throttle != st.throttle:
            reasons.append("throttle")
        ecc = (s.ecc_corrected, s.ecc_uncorrected)
        if st.samples and ecc != st.ecc:
            reasons.append("ecc")
        hot = s.temperature_c is not None and s.temperature_c >= self.temperature_warn
        if hot != st.hot:
            reasons.append("temperature")
        st.samples += 1
        st.last = s
        if reasons:
            bad = hot or (st.samples > 1 and ecc[1] is not None and ecc[1] != st.ecc[1]) or \
                any(t in ("hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")
                    for t in s.throttle)
            (self.log.warning if bad else self.log.info)(
                "gpu_sample", why=",".join(reasons), **s.fields())
            st.mem_gib, st.throttle, st.ecc, st.hot = mem, s.throttle, ecc, hot
        try:
            self.on_sample(self.index, s)
        except Exception as e:  # the watch must outlive a broken listener
            self.log.error("gpu_sample_listener_failed", error=repr(e))
        return s

    def _xid_loop(self) -> None:
        if init() is not None or pynvml is None:
            return
        try:
            h = _handle(self.index)
            es = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
        except Exception as e:
            self.log.warning("xid_events_unavailable", error=_err(e),
                             note="Xid errors still reach the kernel log (journalctl -k)")
            return
        self.log.info("xid_watch_started", device=self.index)
        try:
            while not self._stop.is_set():
                try:
                    data = pynvml.nvmlEventSetWait_v2(es, 1000)
                except Exception as e:
                    if getattr(e, "value", None) == pynvml.NVML_ERROR_TIMEOUT:
                        continue
                    self.log.warning("xid_wait_failed", error=_err(e))
                    self._stop.wait(5.0)
                    continue
                if data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                    code = int(data.eventData)
                    self.state.xids.append(code)
                    self.on_xid(code)
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlEventSetFree(es)
