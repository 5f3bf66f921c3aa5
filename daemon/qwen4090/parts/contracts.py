"""The contracts between the supervisor and the parts it drives: one module for them all.

The supervisor imports no subprocess, socket, HTTP or NVML code: everything that touches the
machine comes in through :class:`Parts`, whose fields are typed by the Protocols here.  The
real parts are built by cli.py (the composition root); the unit tests hand in fakes
(tests/support/fakes.py).  What the parts answer is in results.py, what vLLM is launched with
in launchvalue.py (the Launch value; its resolver, launch.py, is the GPU part's); this module
imports no part itself (tests/unit/test_imports.py: importing the supervisor loads no aiohttp,
subprocess, socket, HTTP client, psutil or NVML, and at most SUPERVISOR_MODULES of ours).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from qwen4090.settings.config import Config

if TYPE_CHECKING:  # (frontlimits imports aiohttp's parser errors: never at run time here)
    from qwen4090.engine.frontlimits import Limits
from qwen4090.base.events import Listener
from qwen4090.base.steering import FrontCommand
from qwen4090.decide.policy import ExitVerdict
from qwen4090.decide.results import (
    FrontSample,
    MetricsResult,
    PortOwner,
    PreflightResult,
    ProbeLike,
    WarmupResult,
)
from qwen4090.launching.launchvalue import Endpoint, Launch
from qwen4090.launching.plan import HostMemory


@dataclass(frozen=True)
class Published:
    """What the status endpoint's threads read of the supervisor: made by the loop after each
    step and never changed after (the loop publishes a new one), so no thread reads the live
    Supervisor (issue 29.6; the endpoint used to copy it and retry on RuntimeError)."""

    snapshot: Mapping[str, Any]  # Supervisor.snapshot(): state, run, restarts, standby...
    cfg: Config  # the config in effect (a reload's, once applied)
    last_metrics: MetricsResult | None  # vLLM's last /metrics answer while it serves
    at: float  # the loop's clock when it was made


class LogLike(Protocol):
    """A structlog-style logger: ``log.info(event, **fields)``, ``.warning``, ``.error``..."""

    def debug(self, event: str, **fields: Any) -> Any: ...
    def info(self, event: str, **fields: Any) -> Any: ...
    def warning(self, event: str, **fields: Any) -> Any: ...
    def error(self, event: str, **fields: Any) -> Any: ...
    def critical(self, event: str, **fields: Any) -> Any: ...


class ChildLike(Protocol):
    """One vLLM process group (child.VllmChild)."""

    pid: int
    lines: int
    last_output: float

    def poll(self) -> int | None: ...
    def tail_lines(self) -> list[str]: ...
    def output_closed(self) -> bool: ...
    def signal_group(self, sig: int) -> bool: ...
    def group_alive(self) -> bool: ...
    def group_members(self) -> list[int]: ...
    def engine_pids(self) -> list[int]: ...
    def engine_gone(self) -> str | None: ...
    def oom_evidence(self) -> str | None: ...
    # What vLLM said of its KV cache: (tokens, bytes), each None until it said so.
    def kv_cache(self) -> tuple[int | None, int | None]: ...
    # qwen4090 is stopping it, for ``why``: its lines from then on are its shutdown's noise
    def mark_ending(self, why: str) -> None: ...


class NotifierLike(Protocol):
    """sd_notify (notify.Notifier): each call says whether systemd took the message."""

    watchdog_interval: float | None

    def ready(self, status: str) -> bool: ...
    def status(self, status: str) -> bool: ...
    def watchdog(self) -> bool: ...
    def extend_timeout(self, seconds: float) -> bool: ...
    def stopping(self, status: str) -> bool: ...
    def reloading(self) -> bool: ...


class PortsLike(Protocol):
    """vLLM's port (instance.py): who holds it, and whether our child's group listens on it."""

    def holder(self, host: str, port: int) -> str | None: ...
    def owner(self, child: ChildLike, host: str, port: int) -> PortOwner: ...


class ExecutorLike(Protocol):
    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...


class GpuLike(Protocol):
    """The one door to the GPU (gpu.GpuParts; the unit tests' fakes.NoGpu does nothing).

    Before a launch: what it is launched with (launch.py) and every check before it; between a
    stop and the relaunch: who still holds GPU memory; and the store of what a start teaches —
    the KV bytes of a start that reached READY, forgotten when a start given them fails, and
    one rung down the OOM ladder after an OOM.  The supervisor calls these; nothing else does.
    """

    # The launch as configured, nothing learned, planned or remembered, and no I/O
    # (launch.configured): the supervisor's until its first preflight resolves one.
    def configured(self, cfg: Config) -> Launch: ...
    # ``beside``: the endpoint another engine listens on (a standby beside the serving one);
    # ``host``: the host's memory to resolve on (the serving launch's: Launch.host), else now
    def launch(self, cfg: Config, beside: Endpoint | None = None,
               host: HostMemory | str | None = None) -> Launch: ...
    def preflight(self, chosen: Launch) -> PreflightResult: ...
    # Which of these pids still hold memory on the GPU with this NVML index (None: none).
    def held(self, device: int, pids: list[int]) -> str | None: ...
    # Is this fraction of the GPU's usable memory free now (None: cannot tell)?
    def room(self, device: int, fraction: float) -> bool | None: ...
    # READY: vLLM sized its KV cache at (tokens, bytes); True when kept for the next launch.
    def remember_kv(self, launched: Launch, tokens: int | None, kv_bytes: int | None) -> bool: ...
    # A start given the remembered KV budget failed: True when it was forgotten.
    def forget_kv(self, launched: Launch) -> bool: ...
    # After an OOM exit: (what was launched, the current config: the ladder's settings, the
    # verdict, vLLM's last lines) -> what was lowered, or None when nothing could be.
    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None: ...


class StepTimesLike(Protocol):
    """The longest engine step the warmup measured, kept in the config's state directory
    (steptime.StepTimes; steptime.py says why it is held against watch.hang_timeout)."""

    # Keep this measurement for cfg's settings: True when it is on disk.
    def record(self, cfg: Config, seconds: float, tokens: int) -> bool: ...
    # The seconds of the longest step measured with cfg's settings (None: none).
    def measured(self, cfg: Config) -> float | None: ...


class NoStepTimes:
    """Nothing measured, nothing kept (the state machine's tests; cli.py builds StepTimes)."""

    def record(self, cfg: Config, seconds: float, tokens: int) -> bool:
        return False

    def measured(self, cfg: Config) -> float | None:
        return None


class FrontLike(Protocol):
    """The client port (front.Front): its counts, for the drain and the hang detector; and what
    the supervisor and the composition root do with it (the supervisor's typed commands, show
    it on the status endpoint, reconfigure it at a reload, stop it), so the root needs no
    isinstance."""

    def sample(self) -> FrontSample | None: ...
    # which engine serves, and whether requests wait, drain or are refused (steering.py)
    def command(self, cmd: FrontCommand) -> None: ...
    @property
    def api_key(self) -> str | None: ...
    # a reload's limits and key; applied on the front's own thread
    def configure(self, limits: Limits, key: str | None) -> None: ...
    # its part of /status and /metrics (httpapi.StatusSource)
    def status(self) -> dict[str, Any]: ...
    def register(self, registry: Any) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...


class NoFront:
    """No front (front.enabled = false, and the state machine's tests): clients talk to vLLM;
    every call does nothing."""

    def sample(self) -> FrontSample | None:
        return None

    def command(self, cmd: FrontCommand) -> None:
        pass

    @property
    def api_key(self) -> str | None:
        return None

    def configure(self, limits: Limits, key: str | None) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}

    def register(self, registry: Any) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass


class UncheckedPorts:
    """The supervisor's default port part (unit tests): every port free, every 200 ours."""

    def holder(self, host: str, port: int) -> str | None:
        return None

    def owner(self, child: ChildLike, host: str, port: int) -> PortOwner:
        return PortOwner(True)


@dataclass
class Parts:
    """Everything the supervisor drives, built by cli.py (or a test)."""

    spawn: Callable[[Launch], ChildLike]  # start vLLM with this resolved launch
    make_probe: Callable[[Launch], ProbeLike]  # asks the engine of this launch (its endpoint)
    warmup: Callable[[Config, ProbeLike, Callable[[str], None]], WarmupResult]
    load_config: Callable[[], Config]
    notifier: NotifierLike
    executor: ExecutorLike
    log: LogLike
    # No do-nothing default: that one (tests/support/fakes.NoGpu) needs launch.py's resolver,
    # which the supervisor must not load (issue 29).
    gpu: GpuLike
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    rand: random.Random = field(default_factory=random.Random)
    # Told of transitions, restarts, warmups, hangs, samples and reloads (events.py).
    listeners: list[Listener] = field(default_factory=list)
    step_times: StepTimesLike = field(default_factory=NoStepTimes)
    ports: PortsLike = field(default_factory=UncheckedPorts)
    front: FrontLike = field(default_factory=NoFront)
