"""The supervisor's states and the arrows allowed between them (imports nothing of ours).

PREFLIGHT -> STARTING -> LOADING -> WARMING -> READY <-> DEGRADED -> RESTARTING -> PREFLIGHT ...
Any running state -> RESTARTING (failure) or STOPPING (SIGTERM); RESTARTING -> FAILED when the
crash-loop budget is spent or the failure can never heal; STOPPING -> STOPPED.
With a standby (issue 21): RESTARTING -> READY when it took over (a failover), and
READY -> REBUILDING -> READY while the serving engine sleeps for a new standby's start.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    PREFLIGHT = "preflight"
    STARTING = "starting"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DEGRADED = "degraded"
    RESTARTING = "restarting"
    REBUILDING = "rebuilding"  # the serving engine sleeps while a new standby starts
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


S = State
_RUNNING = (S.STARTING, S.LOADING, S.WARMING, S.READY, S.DEGRADED, S.REBUILDING)

ALLOWED: dict[State, frozenset[State]] = {
    S.PREFLIGHT: frozenset({S.STARTING, S.RESTARTING, S.FAILED, S.STOPPING}),
    S.STARTING: frozenset({S.LOADING, S.RESTARTING, S.STOPPING}),
    S.LOADING: frozenset({S.WARMING, S.RESTARTING, S.STOPPING}),
    S.WARMING: frozenset({S.READY, S.RESTARTING, S.STOPPING}),
    S.READY: frozenset({S.DEGRADED, S.RESTARTING, S.STOPPING, S.REBUILDING}),
    S.DEGRADED: frozenset({S.READY, S.RESTARTING, S.STOPPING}),
    S.REBUILDING: frozenset({S.READY, S.RESTARTING, S.STOPPING}),
    S.RESTARTING: frozenset({S.PREFLIGHT, S.FAILED, S.STOPPING, S.READY}),
    S.STOPPING: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}

# States in which a vLLM process may be alive and must be watched.
CHILD_STATES = frozenset(_RUNNING)
# States in which clients are served (what /readyz and READY=1 mean).
SERVING_STATES = frozenset({S.READY, S.DEGRADED})
FINAL_STATES = frozenset({S.STOPPED, S.FAILED})


class IllegalTransition(RuntimeError):
    pass


def check(src: State, dst: State) -> None:
    if dst not in ALLOWED[src]:
        raise IllegalTransition(f"{src.value} -> {dst.value} is not allowed")
