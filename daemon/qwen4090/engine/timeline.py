"""Where a start and a recovery spend their seconds: the startup and recovery timelines.

vLLM's start-up lines themselves are vllmfacts' (:func:`vllmfacts.match_line`: one output line
-> the start-up mark it ends, if any, and the facts it carries: KV-cache tokens and bytes, a
compile-cache hit or miss).  Two parts here:

- :class:`StartupTimeline` — one vLLM start, fed ``(line, now)`` and the supervisor's own marks
  (/health, READY); reports seconds since spawn per mark and per phase.
- :class:`TimelineWatch` — the glue: a supervisor listener plus the child's line sink.  It logs
  one ``startup_timeline`` event per start and one ``recovery_timeline`` event per recovery
  (fault -> detected -> group gone -> relaunched -> READY), keeps the last of each for /status
  and observes them in two Prometheus histograms for /metrics.

Marks are moments, seconds after the spawn: ``spawn`` (0), ``first_output`` (vLLM's first
line), ``api_up`` (the API server parsed its arguments: Python imports done), ``engine_up`` (the
EngineCore process logged its config: a second interpreter imported everything again),
``weights_loaded``, ``compiled`` (torch.compile, or the CPU build's compile warm-up),
``kv_sized`` (vLLM said how many tokens its KV cache holds), ``graphs_captured`` (CUDA graphs),
``engine_ready`` (vLLM's "init engine ... took"), ``api_listening`` (uvicorn's application
startup), ``health`` (our first /health 200), ``ready`` (READY: warmup done).  A phase is named
after the mark that ends it and lasts from the previous mark that was seen (eager mode has no
``compiled`` and no ``graphs_captured``; the phases around them simply join).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from qwen4090.base.events import ChildExitSeen, Event, HangSeen, Restarted, StandbyWoken, Transition
from qwen4090.base.states import State
from qwen4090.base.vllmfacts import LineMatch, match_line

S = State

# The marks in the order a start passes them (on vLLM 0.26 CUDA: compile before KV sizing,
# graphs after; on the CPU build the compile warm-up also precedes KV sizing).
MARKS = ("spawn", "first_output", "api_up", "engine_up", "weights_loaded", "compiled",
         "kv_sized", "graphs_captured", "engine_ready", "api_listening", "health", "ready")

# --- one start ----------------------------------------------------------------------------------


@dataclass
class StartupTimeline:
    """One vLLM start: mark -> monotonic time, plus what vLLM said about its KV cache."""

    spawned: float
    at: dict[str, float] = field(default_factory=dict)
    kv_tokens: int | None = None
    kv_bytes: int | None = None
    compile_cache: str | None = None
    lines: int = 0

    def __post_init__(self) -> None:
        self.at.setdefault("spawn", self.spawned)

    def feed(self, line: str, now: float, stream: str = "stdout") -> LineMatch:
        self.lines += 1
        if "first_output" not in self.at:
            self.at["first_output"] = now
        m = match_line(line, stream)
        if m.mark is not None and (m.keep == "last" or m.mark not in self.at):
            self.at[m.mark] = now
        if m.kv_tokens is not None and self.kv_tokens is None:
            self.kv_tokens = m.kv_tokens
        if m.kv_bytes is not None and self.kv_bytes is None:
            self.kv_bytes = m.kv_bytes
        if m.compile_cache is not None:
            # one miss anywhere means this start compiled
            self.compile_cache = "miss" if "miss" in (m.compile_cache, self.compile_cache) \
                else "hit"
        return m

    def mark(self, name: str, now: float) -> None:
        self.at.setdefault(name, now)

    def seconds(self) -> dict[str, float]:
        """Seconds after the spawn per mark seen, in time order."""
        pairs = sorted(self.at.items(), key=lambda kv: (kv[1], MARKS.index(kv[0])))
        return {k: round(t - self.spawned, 3) for k, t in pairs}

    def phases(self) -> dict[str, float]:
        """Seconds of each phase, named after the mark that ends it (from the previous mark)."""
        out: dict[str, float] = {}
        prev = None
        for k, t in self.seconds().items():
            if prev is not None:
                out[k] = round(t - prev, 3)
            prev = t
        return out

    def report(self, outcome: str) -> dict[str, Any]:
        secs = self.seconds()
        return {"outcome": outcome, "total": max(secs.values()), "at": secs,
                "took": self.phases(), "kv_tokens": self.kv_tokens, "kv_bytes": self.kv_bytes,
                "compile_cache": self.compile_cache or "none", "lines": self.lines}


# --- one recovery -------------------------------------------------------------------------------

RECOVERY_MARKS = ("fault", "detected", "group_gone", "relaunched", "woken", "ready")
# Phases of a recovery, each ending at a mark: how long until we noticed, until the old group
# was gone, until the relaunch (backoff, GPU release wait, preflight), until READY again.  A
# failover to the standby (issue 21) has no relaunch: its standby is woken ("wake"), then its
# known answer checked ("check").
RECOVERY_PHASES = {"detected": "detect", "group_gone": "stop", "relaunched": "backoff",
                   "woken": "wake", "ready": "start"}
FAULT_LINE_WINDOW = 30.0  # an ERROR line this long before detection is taken as the fault


@dataclass
class RecoveryTimeline:
    detected: float
    detected_wall: float
    cause: str
    fault: float
    fault_source: str  # detected, vllm_error_line, child_exit_seen or last_token_progress
    at: dict[str, float] = field(default_factory=dict)
    attempts: int = 1

    def __post_init__(self) -> None:
        self.at.setdefault("fault", self.fault)
        self.at.setdefault("detected", self.detected)

    def report(self) -> dict[str, Any]:
        secs = {k: round(self.at[k] - self.fault, 3) for k in RECOVERY_MARKS if k in self.at}
        took: dict[str, float] = {}
        prev = None
        for k in RECOVERY_MARKS:
            if k in self.at:
                if prev is not None:
                    phase = "check" if k == "ready" and prev == "woken" else RECOVERY_PHASES[k]
                    took[phase] = round(self.at[k] - self.at[prev], 3)
                prev = k
        return {"cause": self.cause, "total": secs.get("ready"), "at": secs, "took": took,
                "failover": "woken" in self.at,
                "fault_source": self.fault_source, "attempts": self.attempts,
                "detected_wall": round(self.detected_wall, 3)}


# --- the glue: listener + line sink + log + /status + /metrics ----------------------------------

PHASE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 45, 60, 90, 120, 180, 300, 600)
_CHILD_STATES = {s.value for s in (S.STARTING, S.LOADING, S.WARMING, S.READY, S.DEGRADED,
                                   S.REBUILDING)}
_SERVING = {S.READY.value, S.DEGRADED.value}


class TimelineWatch:
    """Feeds timelines from the supervisor's events and vLLM's lines; tells what it saw.

    ``on_line`` runs on the child's reader threads, ``__call__`` on the supervisor's loop and
    ``status`` on the HTTP threads: one lock guards the state.
    """

    def __init__(self, log: Any, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.log = log
        self.clock = clock
        self.wall = wall
        self._lock = threading.Lock()
        self.current: StartupTimeline | None = None
        self.last_startup: dict[str, Any] | None = None
        self.recovery: RecoveryTimeline | None = None
        self.last_recovery: dict[str, Any] | None = None
        self.last_error_line: float | None = None  # since the last READY
        self.stalled_since: float | None = None  # from the supervisor's hang event
        self.exit_seen: float | None = None  # the loop saw vLLM's main process gone
        self.phase_hist = Histogram(
            "qwen4090_startup_phase_seconds", "seconds of each vLLM start-up phase (named after "
            "the mark that ends it), starts that reached READY", ["phase"], registry=None,
            buckets=PHASE_BUCKETS)
        self.recovery_hist = Histogram(
            "qwen4090_recovery_phase_seconds", "seconds of each recovery phase: detect, stop, "
            "backoff, start, and total (fault to READY)", ["phase"], registry=None,
            buckets=PHASE_BUCKETS)

    def collectors(self) -> list[Histogram]:
        return [self.phase_hist, self.recovery_hist]

    def register(self, registry: CollectorRegistry) -> None:
        for c in self.collectors():
            registry.register(c)

    def status(self) -> dict[str, Any]:
        with self._lock:
            running = None if self.current is None else self.current.report("running")
            return {"startup_timeline": self.last_startup, "startup_in_progress": running,
                    "recovery_timeline": self.last_recovery}

    # --- the child's lines (reader threads) ---------------------------------------------------

    def on_line(self, stream: str, line: str) -> None:
        now = self.clock()
        with self._lock:
            if self.current is not None:
                m = self.current.feed(line, now, stream)
            else:
                m = match_line(line, stream)
            if m.error and self.last_error_line is None:
                self.last_error_line = now

    # --- the supervisor's events (its loop) ---------------------------------------------------

    def __call__(self, event: Event) -> None:
        now = self.clock()
        done: list[tuple[str, dict[str, Any]]] = []
        with self._lock:
            if isinstance(event, HangSeen):
                self.stalled_since = now - event.stalled
            elif isinstance(event, ChildExitSeen):
                self.exit_seen = now
            elif isinstance(event, Restarted) and self.recovery is not None:
                self.recovery.at.setdefault("group_gone", now)
            elif isinstance(event, StandbyWoken) and self.recovery is not None:
                self.recovery.at["woken"] = now
            elif isinstance(event, Transition):
                done = self._transition(now, event.src.value, event.dst.value, event.reason)
        for name, report in done:  # log and observe outside the lock
            self._tell(name, report)

    def _transition(self, now: float, src: str, dst: str, reason: str
                    ) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if dst == S.STARTING.value:
            self.current = StartupTimeline(now)
            if self.recovery is not None:
                self.recovery.at["relaunched"] = now  # the last relaunch is the one that counts
        elif dst == S.WARMING.value and self.current is not None:
            self.current.mark("health", now)
        elif dst == S.READY.value and src == S.RESTARTING.value and self.recovery is not None:
            # a failover: the standby serves (no start of ours to time)
            self.recovery.at["ready"] = now
            out.append(("recovery_timeline", self.recovery.report()))
            self.last_recovery = out[-1][1]
            self.recovery = None
            self.last_error_line = self.stalled_since = self.exit_seen = None
        elif dst == S.READY.value and src == S.WARMING.value:
            if self.current is not None:
                self.current.mark("ready", now)
                out.append(("startup_timeline", self.current.report("ready")))
                self.last_startup = out[-1][1]
                self.current = None
            if self.recovery is not None:
                self.recovery.at["ready"] = now
                out.append(("recovery_timeline", self.recovery.report()))
                self.last_recovery = out[-1][1]
                self.recovery = None
            self.last_error_line = self.stalled_since = self.exit_seen = None
        elif dst in (S.RESTARTING.value, S.STOPPING.value, S.FAILED.value):
            if self.current is not None:
                outcome = "failed" if dst != S.STOPPING.value else "stopped"
                out.append(("startup_timeline", {**self.current.report(outcome),
                                                 "reason": reason}))
                self.last_startup = out[-1][1]
                self.current = None
            if dst == S.RESTARTING.value and src in _CHILD_STATES:
                if self.recovery is None:
                    self.recovery = self._new_recovery(now, src, reason)
                else:
                    self.recovery.attempts += 1
            elif dst != S.RESTARTING.value and self.recovery is not None:
                self.recovery = None  # stopped or gave up: no READY to measure
        return out

    def _new_recovery(self, now: float, src: str, reason: str) -> RecoveryTimeline:
        """The fault is the earliest sign we have, within FAULT_LINE_WINDOW of detection."""
        signs = [(now, "detected")]
        if self.stalled_since is not None and self.stalled_since <= now:
            signs.append((self.stalled_since, "last_token_progress"))
        for t, source in ((self.last_error_line, "vllm_error_line"),
                          (self.exit_seen, "child_exit_seen")):
            if t is not None and now - FAULT_LINE_WINDOW <= t <= now:
                signs.append((t, source))
        fault, source = min(signs)
        self.stalled_since = self.last_error_line = self.exit_seen = None
        return RecoveryTimeline(now, self.wall(), reason.split(":", 1)[0] or src, fault,
                                source)

    def _tell(self, name: str, report: dict[str, Any]) -> None:
        """Observe the report in /metrics, then log it: whoever reads the journal line finds
        the histograms already updated (a test under load read /metrics between the two)."""
        took = report.get("took") or {}
        summary = " ".join(f"{k}={v:g}" for k, v in (report.get("at") or {}).items())
        if name == "startup_timeline":
            if report.get("outcome") == "ready":
                for phase, secs in took.items():
                    self.phase_hist.labels(phase).observe(secs)
                self.phase_hist.labels("total").observe(float(report["total"]))
        else:
            for phase, secs in took.items():
                self.recovery_hist.labels(phase).observe(secs)
            if report.get("total") is not None:
                self.recovery_hist.labels("total").observe(float(report["total"]))
        self.log.info(name, summary=summary, **report)
