"""vLLM's port while another process holds it (issue 8.2, 8.4): waited on, bounded by
``restart.port_wait``, not counted as a vLLM crash.

The bound runs from the first time the port was found held (at preflight, or vLLM's own
"Address already in use") until our vLLM is seen listening on it (:meth:`PortGuard.ours`); when
it is spent, the next held port is a counted failure (the normal budget path).  The supervisor
asks; the guard keeps the wait (:class:`PortWait`) and says in the journal who holds the port.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen4090.decide.policy import Cause, ExitVerdict
from qwen4090.launching.launchvalue import Endpoint
from qwen4090.parts.contracts import LogLike, PortsLike

PORT_RETRY = 1.0  # while vLLM's port is held: how often we look again
PORT_SAY_EVERY = 30.0  # ... and how often we say again who holds it


@dataclass
class PortWait:
    """A port held by another process is waited on (bounded), not counted as a vLLM crash.

    The bound runs from the first time the port was found held (at preflight, or vLLM's own
    "Address already in use") until our vLLM is seen listening on it; when it is spent the
    next held port is a counted failure (the normal budget path), and the wait starts over.
    """

    since: float | None = None
    holder: str = ""  # who holds it now ("" = not waiting)
    next_check: float = 0.0
    last_said: float = -1e18

    def observe(self, now: float, holder: str, limit: float, say_every: float
                ) -> tuple[bool, bool]:
        """(keep waiting, log it now) for a port found held by ``holder``."""
        if self.since is None:
            self.since = now
        if now - self.since >= limit:
            self.reset()
            return False, False
        say = holder != self.holder or now - self.last_said >= say_every
        if say:
            self.last_said = now
        self.holder = holder
        return True, say

    def spent(self, now: float, limit: float) -> bool:
        return self.since is not None and now - self.since >= limit

    def waited(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since

    def reset(self) -> None:
        self.since, self.holder, self.last_said = None, "", -1e18


class PortGuard:
    def __init__(self, log: LogLike) -> None:
        self.log = log
        self.wait = PortWait()

    @property
    def holder(self) -> str:
        """Who holds the port while preflight waits for it ("" = not waiting)."""
        return self.wait.holder

    def ours(self) -> None:
        """Our vLLM listens on the port: the wait is over."""
        self.wait.reset()

    def observe(self, now: float, at: Endpoint, limit: float, holder: str) -> bool:
        """The engine's port ``at`` is held by ``holder``: True while it is waited on (in
        PREFLIGHT, not a failure); False once ``limit`` (restart.port_wait) is spent (the
        caller counts a failure)."""
        waited = round(self.wait.waited(now), 1)
        wait, say = self.wait.observe(now, holder, limit, PORT_SAY_EVERY)
        if say:
            self.log.warning("port_busy", port=str(at), holder=holder, waited=waited,
                             limit=limit)
        if not wait:
            self.log.error("port_wait_spent", port=str(at), holder=holder, waited=waited,
                           limit=limit)
        self.wait.next_check = now + PORT_RETRY
        return wait

    def look_again(self, now: float, at: Endpoint, limit: float, ports: PortsLike
                   ) -> bool | ExitVerdict:
        """While waiting: look again (cheaply, not the whole preflight).  True: nothing more to
        do now (still waiting); False: the port is free; a verdict: the wait is spent."""
        if now < self.wait.next_check:
            return True
        holder = ports.holder(at.host, at.port)
        if holder is None:
            self.log.info("port_free", port=str(at), waited=round(self.wait.waited(now), 1))
            self.wait.holder = ""
            return False
        if self.observe(now, at, limit, holder):
            return True
        return ExitVerdict(Cause.PREFLIGHT, f"port {at} is in use by {holder}", True)

    def judge(self, now: float, limit: float, verdict: ExitVerdict) -> ExitVerdict:
        """vLLM died of a held port: waited on like a held port at preflight, until the wait is
        spent; then it counts (so a port that looks free to us but not to vLLM cannot loop)."""
        if verdict.cause != Cause.PORT_HELD:
            return verdict
        if self.wait.spent(now, limit):
            self.wait.reset()
            return ExitVerdict(Cause.PREFLIGHT, f"{verdict.detail} (restart.port_wait = "
                                                f"{limit:g}s spent)", True)
        if self.wait.since is None:
            self.wait.since = now
        return verdict
