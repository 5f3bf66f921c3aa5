"""What the parts the supervisor drives answer: the result values, with no machine behind them.

Each part (the HTTP probe, the preflight, the warmup, the port walk, the front) returns one of
these instead of raising; the supervisor, its runs and the standby read them.  This module
imports nothing that touches the machine (no socket, HTTP, subprocess or NVML), so neither
does the state machine that reads them (contracts.py; tests/unit/test_imports.py holds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from qwen4090.settings.config import ConfigError

# --- vLLM's HTTP API (probes/http.py asks) --------------------------------------------------------

@dataclass(frozen=True)
class HealthResult:
    ok: bool
    status: int | None
    seconds: float
    error: str = ""
    unseen: bool = False  # not asked: no file descriptor left (no word on vLLM)


@dataclass(frozen=True)
class MetricsResult:
    ok: bool
    values: dict[str, float] = field(default_factory=dict)  # family name -> sum over labels
    seconds: float = 0.0
    error: str = ""
    timed_out: bool = False  # no answer in time (a stopped or stuck API server)
    unseen: bool = False  # not asked: no file descriptor left (no word on vLLM)

    def get(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)


@dataclass(frozen=True)
class CompletionResult:
    ok: bool
    ttft: float | None  # seconds to the first streamed token
    seconds: float  # whole request
    tokens: int  # streamed chunks that carried text
    error: str = ""
    finish_reason: str | None = None
    timed_out: bool = False  # no answer in time (as opposed to an error answer)
    text: str = ""  # the answer's text (greedy: the same weights give the same text)
    unseen: bool = False  # not asked: no file descriptor left (no word on vLLM)


class ProbeLike(Protocol):
    """vLLM's HTTP API as the supervisor and the warmup use it (:class:`VllmProbe`; the tests'
    fakes): every call returns a result, never raises."""

    def health(self, timeout: float) -> HealthResult: ...
    def metrics(self, timeout: float) -> MetricsResult: ...
    def complete(self, prompt: Sequence[int] | str, max_tokens: int, timeout: float
                 ) -> CompletionResult: ...
    def control(self, path: str, timeout: float) -> HealthResult: ...


UNSEEN_RETRY = 0.5  # seconds between tries of a Patient probe while no file descriptor is left
Result = TypeVar("Result", HealthResult, MetricsResult, CompletionResult)


class Patient:
    """A probe that asks again while it could not ask (``unseen``: no file descriptor left),
    within each call's own timeout: for the one-shot questions whose failure is a verdict (the
    warmup's requests, the standby's checks, a sleeping engine's wake), where a poll is simply
    sent again at its next interval.  Sleeps on the job's thread, never on the loop's."""

    def __init__(self, probe: ProbeLike, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.probe = probe
        self.clock = clock
        self.sleep = sleep

    def _again(self, ask: Callable[[float], Result], timeout: float) -> Result:
        end = self.clock() + timeout
        res = ask(timeout)
        while res.unseen and (left := end - self.clock()) > UNSEEN_RETRY:
            self.sleep(UNSEEN_RETRY)
            res = ask(left - UNSEEN_RETRY)
        return res

    def health(self, timeout: float) -> HealthResult:
        return self._again(self.probe.health, timeout)

    def metrics(self, timeout: float) -> MetricsResult:
        return self._again(self.probe.metrics, timeout)

    def complete(self, prompt: Sequence[int] | str, max_tokens: int, timeout: float
                 ) -> CompletionResult:
        return self._again(lambda t: self.probe.complete(prompt, max_tokens, t), timeout)

    def control(self, path: str, timeout: float) -> HealthResult:
        return self._again(lambda t: self.probe.control(path, t), timeout)


# --- before a launch (preflight.py) ---------------------------------------------------------------


@dataclass
class PreflightResult:
    fatal: ConfigError | None = None  # never heals: exit 78
    transient: str | None = None  # may heal: retry with backoff
    port_holder: str | None = None  # vLLM's port is held by this process: wait, do not count
    unseen: OSError | None = None  # a check could not look (no file descriptor): again soon
    warnings: list[str] = field(default_factory=list)
    facts: dict[str, object] = field(default_factory=dict)  # for logs and status

    @property
    def ok(self) -> bool:
        return self.fatal is None and self.transient is None and self.unseen is None


# --- vLLM's port (instance.py walks the group's sockets) ------------------------------------------


@dataclass(frozen=True)
class PortOwner:
    """Whose socket listens on vLLM's port, as far as our child's group goes."""

    ours: bool | None  # True: a process of our group listens; False: not; None: cannot tell
    holder: str = ""  # who does, when it is not us (or why we cannot tell)


# --- the client port (front.py) -------------------------------------------------------------------


@dataclass(frozen=True)
class FrontSample:
    """The front's counts at one moment (a copy: any thread may read it)."""

    in_flight: int  # requests accepted and not yet answered in full
    holding: int  # ... of them waiting for an engine now
    unanswered: int  # sent to the engine, no byte of the answer back yet
    oldest_unanswered: float  # seconds the oldest of those has waited (0 when none)
    bytes_from_engine: int  # bytes of answers to POSTs (generation) received from vLLM since
    #                         the front started: they grow while the engine makes progress
    #                         (GETs, such as a balancer's /health, are answered by a hung
    #                         vLLM too)
    open: bool  # the engine is up: requests pass
    draining: bool
    last_byte_at: float | None = None  # when (the front's clock) the last of those came in
    connections: int = 0  # client connections open
    shedding: str = ""  # while a limit refuses clients: what and how many (STATUS)
    # requests sent to each engine and not yet answered in full: (its name, how many); the name
    # is the one the supervisor's steering.Serve gave (the pid)
    by_engine: tuple[tuple[str, int], ...] = ()
    # the longest gap between two chunks of one streamed answer relayed in the last
    # front.STEP_WINDOW seconds (None: none): the engine's steps as the load makes them now
    longest_gap: float | None = None
    # requests the engine surely has: answers under way, and unanswered ones with a small body
    # (front.SMALL_BODY: past vLLM's tokenizer at once); vLLM's own running gauge can read 0
    # while its engine is stopped (H100, 2026-12-06: short requests back to back)
    at_engine: int = 0


# --- the warmup (warmup.py) -----------------------------------------------------------------------


@dataclass
class WarmupRow:
    length: int
    concurrency: int
    ttft_ms: float  # median over the concurrent requests
    ttft_max_ms: float
    seconds: float


@dataclass
class WarmupResult:
    ok: bool
    rows: list[WarmupRow] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    skipped: list[str] = field(default_factory=list)
    cut_short: str = ""  # why the warmup ended early and OK (an engine busy with clients)
    # The longest engine step the settings allow, as measured: (seconds, prompt tokens)
    longest_step: tuple[float, int] | None = None

    def ttft_at(self, length: int) -> float | None:
        for r in self.rows:
            if r.length == length and r.concurrency == 1:
                return r.ttft_ms
        return None

    def ttft_near(self, length: int) -> tuple[int, float] | None:
        """The concurrency-1 row whose length is closest to ``length`` (for STATUS=)."""
        singles = [r for r in self.rows if r.concurrency == 1]
        if not singles:
            return None
        r = min(singles, key=lambda r: abs(r.length - length))
        return r.length, r.ttft_ms

    def table(self) -> str:
        """One line: 'len=ttft_ms' pairs, then 'xC=ttft_ms' for the concurrency sweep."""
        lens = " ".join(f"{r.length}:{r.ttft_ms:.0f}ms" for r in self.rows if r.concurrency == 1)
        conc = " ".join(f"x{r.concurrency}:{r.ttft_ms:.0f}/{r.ttft_max_ms:.0f}ms"
                        for r in self.rows if r.concurrency > 1)
        return f"ttft by prompt length [{lens}] by concurrency p50/max [{conc}]"
