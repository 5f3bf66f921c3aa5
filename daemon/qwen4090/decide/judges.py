"""Small judges of one vLLM run: each owns its timers and gives a verdict for ``now``.

Pure: no I/O, no logging, no clock of their own (``now`` comes in), so a test states a moment
and reads the verdict.  Each judge reports its next deadline (the moment its verdict may change
without anything else happening), and the supervisor's loop sleeps until the earliest of them:
a new judge cannot forget to wake the loop.  Shaped after :class:`policy.HangDetector`.

- :class:`KillSchedule` — SIGTERM sent; when SIGKILL is due, and why.
- :class:`Drain` — SIGTERM asked for a drain: the front's count (or vLLM's gauges), and when
  it is over.
- :class:`ServingSchedule` — while serving: when the next /health+/metrics poll and the next
  canary are due (the hang detector's deadline brings a poll forward), and the window in which
  failing /health probes are counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qwen4090.decide.policy import DrainSample, HangDetector, drain_busy

# After SIGTERM, once waiting is pointless (the EngineCore is gone, the drain deadline passed, a
# hang), SIGKILL what is left this much later instead of after stop.term_timeout: vLLM's API
# server otherwise sits in "Waiting for connections to close" for as long as a client keeps a
# stream open (measured on the H200: 15 s of a 31.9 s hang restart).
KILL_GRACE = 2.0
KILL_WAIT = 30.0  # after SIGKILL, how long we wait for the group before saying who survived
STOP_POLL_INTERVAL = 0.5  # how often a drain looks at what clients still wait for


@dataclass
class KillSchedule:
    """The group was sent SIGTERM at ``term_sent``: SIGKILL after ``term_timeout``, or after
    KILL_GRACE when there is a reason to hurry (a hang, a spent drain) or the EngineCore is
    gone (the API server would only wait for idle client connections)."""

    term_sent: float
    term_timeout: float
    hurry: str | None = None
    killed_at: float | None = None
    engine_gone_at: float | None = None

    def reason(self, now: float, engines_left: Callable[[], bool]) -> str | None:
        """Why SIGKILL is due now (None: keep waiting for the group to end by itself).
        ``engines_left`` is asked only once the grace has passed (it walks the group)."""
        if now >= self.term_sent + self.term_timeout:
            return f"still running {self.term_timeout:g}s after SIGTERM"
        if now - self.term_sent < KILL_GRACE:
            return None
        if self.hurry is not None:
            return f"{self.hurry}; {now - self.term_sent:.1f}s after SIGTERM"
        if self.engine_gone_at is None and not engines_left():
            self.engine_gone_at = now
        if self.engine_gone_at is not None and now - self.engine_gone_at >= KILL_GRACE:
            return (f"no EngineCore left {now - self.engine_gone_at:.1f}s; the API server would "
                    "only wait for idle client connections")
        return None

    def killed(self, now: float) -> None:
        self.killed_at = now

    def survived(self, now: float) -> bool:
        """SIGKILL went out KILL_WAIT ago and the group is still there."""
        return self.killed_at is not None and now - self.killed_at > KILL_WAIT

    def deadline(self) -> float:
        if self.killed_at is not None:
            return self.killed_at + KILL_WAIT
        due = [self.term_sent + self.term_timeout, self.term_sent + KILL_GRACE]
        if self.engine_gone_at is not None:
            due.append(self.engine_gone_at + KILL_GRACE)
        return min(due)


@dataclass
class Drain:
    """SIGTERM while serving: wait (up to ``deadline``) until no client waits for an answer.

    With the front, its count of requests in flight is read at each step (exact and local:
    :meth:`on_clients`); without it, the engine's running/waiting gauges are asked every
    STOP_POLL_INTERVAL (a job: an answer from an API server that may be busy).  What cannot be
    told stays "busy" (policy.drain_busy).
    """

    deadline: float
    next_poll: float
    sample: DrainSample | None = None

    def over(self, now: float, exited: bool) -> tuple[bool, bool, bool]:
        """(over, busy, expired): over when nobody waits, the deadline passed or vLLM exited."""
        busy = drain_busy(self.sample)
        expired = now >= self.deadline
        return (not busy or expired or exited), busy, expired

    def gauges_due(self, now: float, in_flight: bool) -> bool:
        """Without the front: whether to ask the gauges now (advances the schedule)."""
        if now < self.next_poll:
            return False
        self.next_poll = now + STOP_POLL_INTERVAL
        return not in_flight

    def on_clients(self, clients: int) -> None:
        self.sample = DrainSample(clients, None, None)

    def on_gauges(self, running: float | None, waiting: float | None) -> None:
        self.sample = DrainSample(None, running, waiting)

    def next_deadline(self) -> float:
        return min(self.deadline, self.next_poll)


@dataclass
class ServingSchedule:
    """While serving: the poll and canary timers, the failing-/health window, the hang clock.

    The next poll and canary are due one (live, reloadable) interval after the last, so a
    SIGHUP that shortens an interval acts at once; the intervals come in with each question.
    """

    hang: HangDetector
    last_poll: float
    last_canary: float
    unhealthy_since: float | None = None
    asked: bool = False  # a judgement needs a fresh sample: the next poll is due at once

    def next_poll_at(self, poll_interval: float, quiet_since: float | None = None) -> float:
        """poll_interval after the last poll, or earlier at the moment a stall being timed
        reaches its bound (HangDetector.deadline) -- once: a deadline already polled for
        (the stall's clock is not reset while /health fails) must not bring each next poll
        forward.  ``quiet_since``: the front has requests at the engine and has relayed no
        answer byte since then; once that silence is half the hang bound, polls come every
        half bound (issue 30.3: the fast verdict needs two samples of a flat counter)."""
        if self.asked:
            return self.last_poll
        due = self.last_poll + poll_interval
        deadline = self.hang.deadline()
        if quiet_since is not None:
            half = self.hang.bound / 2
            due = min(due, max(self.last_poll, quiet_since) + half)
            if deadline is not None:  # the front's last byte is progress the poll did not see
                deadline = max(deadline, quiet_since + self.hang.bound)
        return deadline if deadline is not None and self.last_poll < deadline < due else due

    def poll_due(self, now: float, poll_interval: float, quiet_since: float | None = None
                 ) -> bool:
        return now >= self.next_poll_at(poll_interval, quiet_since)

    def polled(self, now: float) -> None:
        self.last_poll, self.asked = now, False

    def ask(self) -> None:
        """A poll at once, not at the next interval (a stuck canary's judgement needs one)."""
        self.asked = True

    def restart(self, now: float) -> None:
        """Serving (again): the hang clock, the failing window and the canary start over, and
        a first sample is taken at once (Run.became_ready)."""
        self.hang.reset()
        self.last_poll = self.last_canary = now
        self.unhealthy_since = None
        self.ask()

    def canary_sent(self, now: float) -> None:
        self.last_canary = now

    def canary_due(self, now: float, canary_interval: float) -> bool:
        return canary_interval > 0 and now >= self.last_canary + canary_interval

    def failing(self, since: float) -> bool:
        """A failing /health probe sent at ``since``: True when it opens the window."""
        if self.unhealthy_since is None:
            self.unhealthy_since = since
            return True
        return False

    def failed_for(self, now: float) -> float:
        return 0.0 if self.unhealthy_since is None else now - self.unhealthy_since

    def recovered(self) -> float | None:
        """/health answered: how long it had been failing (None: it had not)."""
        since, self.unhealthy_since = self.unhealthy_since, None
        return since

    def next_deadline(self, poll_interval: float, canary_interval: float,
                      quiet_since: float | None = None) -> float:
        due = self.next_poll_at(poll_interval, quiet_since)
        return min(due, self.last_canary + canary_interval) if canary_interval > 0 else due
