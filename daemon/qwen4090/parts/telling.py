"""What the daemon tells, and to whom: systemd (READY=1, RELOADING=1, STOPPING=1, STATUS=,
WATCHDOG=1, EXTEND_TIMEOUT_USEC) and the listeners of its events (the timeline, /metrics,
the reload fan-out).  The supervisor decides what is true; this keeps what was said, so that
STATUS= goes out only when it changed and READY=1 only once (issue 29: one owner each)."""

from __future__ import annotations

from collections.abc import Callable

from qwen4090.base.events import Event
from qwen4090.base.redact import safe_error
from qwen4090.parts.contracts import LogLike, NotifierLike

EXTEND_EVERY = 10.0  # how often EXTEND_TIMEOUT_USEC goes out while a start makes progress
EXTEND_BY = 60.0  # ... and how far it reaches


class Teller:
    def __init__(self, notifier: NotifierLike, listeners: list[Callable[[Event], None]],
                 log: LogLike) -> None:
        self.n = notifier
        self.listeners = listeners  # (the composition root adds to this list later)
        self.log = log
        self.ready_notified = False
        self.last_watchdog = -1e18
        self.last_extend = -1e18
        self.last_status = ""

    def emit(self, event: Event) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as e:
                self.log.error("listener_failed", event_name=type(event).__name__,
                               error=safe_error(e, where=True))

    def beat(self, now: float, status: str, extend: Callable[[], bool]) -> None:
        """Each step: the watchdog when due; before the first READY=1 (and while stopping)
        systemd's timeouts run, so they are extended while ``extend()`` says the start makes
        visible progress; STATUS= when the line changed."""
        n = self.n
        if n.watchdog_interval and now - self.last_watchdog >= n.watchdog_interval:
            n.watchdog()
            self.last_watchdog = now
        if now - self.last_extend >= EXTEND_EVERY and extend():
            n.extend_timeout(EXTEND_BY)
            self.last_extend = now
        self.status(status)

    def status(self, status: str) -> None:
        if status != self.last_status:
            self.n.status(status)
            self.last_status = status

    def ready(self, status: str) -> bool:
        """READY=1 the first time (True), else the new STATUS= (READY=1 went out before this
        restart; systemd still shows the last line, "warming: ...", until the new one)."""
        first = not self.ready_notified
        if first:
            self.n.ready(status)
            self.ready_notified = True
            self.last_status = status
        else:
            self.status(status)
        return first

    def reloading(self) -> bool:
        """RELOADING=1 once READY (True): a reload before it says neither (architecture.md)."""
        if self.ready_notified:
            self.n.reloading()
        return self.ready_notified

    def reloaded(self, status: str) -> None:
        """READY=1 ends the reload (also a refused one); a restart it caused goes on.  Its
        STATUS= (a refused reload's note) stays until the line itself changes."""
        self.n.ready(status)

    def stopping(self, status: str) -> None:
        self.n.stopping(status)
        self.last_status = status
