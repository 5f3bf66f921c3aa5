"""What the supervisor tells its listeners: one frozen dataclass per event, matched by type.

A listener is any ``Callable[[Event], None]`` (httpapi.Telemetry, timeline.TimelineWatch, cli's
reload fan-out); it matches the events it cares for with ``isinstance`` or ``match`` and lets
the rest pass.  A field cannot be misspelt, and a new event cannot be mistaken for an old one.
Listeners run on the supervisor's loop; one that raises is logged (``listener_failed``) and
the others still get the event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qwen4090.base.states import State


@dataclass(frozen=True)
class Transition:
    """The supervisor moved from ``src`` to ``dst``."""

    src: State
    dst: State
    reason: str


@dataclass(frozen=True)
class ChildExitSeen:
    """The loop saw vLLM's main process gone (its exit code): the recovery timeline's fault."""

    code: int


@dataclass(frozen=True)
class Restarted:
    """A vLLM group is gone after a failure; ``counted`` when it counts against the budget."""

    cause: str
    counted: bool


@dataclass(frozen=True)
class WarmedUp:
    """The warmup finished: its seconds and its TTFT table (warmup.WarmupResult.rows)."""

    seconds: float
    rows: tuple[Any, ...] = ()


@dataclass(frozen=True)
class HangSeen:
    """Requests in flight and no token progress for ``stalled`` seconds: a hang."""

    stalled: float


@dataclass(frozen=True)
class SteppedDown:
    """After an OOM, the OOM ladder lowered these settings for the next launch."""

    changes: tuple[str, ...]


@dataclass(frozen=True)
class GpuSampled:
    """One NVML sample (probes.nvml's metrics for /status and /metrics)."""

    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reloaded:
    """SIGHUP: a new config is in effect; ``changed`` names its changed sections."""

    changed: tuple[str, ...]


@dataclass(frozen=True)
class StandbyWoken:
    """A failover woke the standby (the recovery timeline's ``woken`` mark)."""

    seconds: float


Event = (Transition | ChildExitSeen | Restarted | WarmedUp | HangSeen | SteppedDown | GpuSampled
         | Reloaded | StandbyWoken)
Listener = Callable[[Event], None]


@dataclass
class Inbox:
    """What other threads hand the supervisor's loop, each only appended there (a deque's
    append is atomic; the loop alone takes): the signal handlers' signals, the NVML threads'
    samples (events) and fatal Xid texts, the pipe readers' engine deaths (child, line)."""

    signals: deque[int] = field(default_factory=deque)
    gpu: deque[Event | str] = field(default_factory=deque)
    engine_deaths: deque[tuple[object, str]] = field(default_factory=deque)

    def deliver(self, signum: int) -> None:
        """A signal (from the signal handler)."""
        self.signals.append(signum)

    def gpu_fault(self, detail: str) -> None:
        """A fatal Xid (from the NVML thread)."""
        self.gpu.append(detail)

    def gpu_sample(self, fields: dict[str, Any]) -> None:
        """An NVML sample (from the sample thread)."""
        self.gpu.append(GpuSampled(fields))

    def engine_dead(self, child: object, line: str) -> None:
        """vLLM's line that its EngineCore died (from a pipe reader thread)."""
        self.engine_deaths.append((child, line))
