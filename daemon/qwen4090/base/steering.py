"""What the supervisor tells the front (issue 29.4): typed commands, each naming its engine.

The supervisor is the one owner of which engine serves; where it changes the serving row it
sends one of these (``FrontLike.command``), and the front carries it out on its own loop.  The
front no longer infers its gates from the supervisor's states.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Serve:
    """This engine serves from now on: requests go to ``host:port``; held ones are released.
    ``engine`` names it (its pid): the same engine serving again after DEGRADED is no news,
    a new one is a new generation (a request that failed on the old one is replayed on it)."""

    host: str
    port: int
    engine: int


@dataclass(frozen=True)
class Hold:
    """No engine serves (a restart, a failover, a standby's build): requests wait, and one that
    failed on ``engine`` (the one that stopped serving; None: none served) is replayed."""

    reason: str
    engine: int | None = None


@dataclass(frozen=True)
class Drain:
    """The service stops: no new requests (the listener closes); those in flight go on."""


@dataclass(frozen=True)
class Refuse:
    """The daemon gave up: no engine will come; held requests get their 503 now."""

    reason: str


FrontCommand = Serve | Hold | Drain | Refuse
