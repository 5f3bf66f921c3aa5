"""What the supervisor tells a human: the STATUS= line systemd shows in ``systemctl status``
(one line, sent when it changes) and the snapshot behind /status; pure, from its facts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwen4090.base.states import SERVING_STATES, State
from qwen4090.settings.config import AUTO, VllmConfig

S = State


@dataclass(frozen=True)
class Facts:
    state: State
    reason: str  # why the state was entered
    seconds: float  # in this state
    vllm: VllmConfig  # what the current vLLM runs with
    restarts: int
    warmup: Any  # the last warmup.WarmupResult, or None
    pid: int | None  # vLLM's API server
    run_seconds: float  # since vLLM was spawned
    warming: str  # the warmup's last step
    restart_in: float | None  # seconds until the next launch (None: not scheduled)
    cause: str  # of the last failure
    failures: int  # in the crash-loop window
    budget: int  # restart.budget_failures
    stop_phase: str  # drain, term or stop
    port: str  # vLLM's host:port
    port_holder: str  # who holds it while preflight waits ("" = not waiting)
    warnings: int = 0  # logged by the running vLLM's preflight (risky settings, the plan)
    front: Any = None  # front.FrontSample: the client port's counts (None: no front)
    standby: str = ""  # the standby's state ("" = restart.standby off)
    waking: bool = False  # a failover: the standby is being woken and checked


def render(f: Facts, note: str = "") -> str:
    v, s = f.vllm, f.state
    tail = f", restarts={f.restarts}"
    if f.warnings:  # legal but risky settings, said where a sysadmin looks first (issue 18.8)
        tail += f", {f.warnings} warning{'s' if f.warnings > 1 else ''} at start " \
                "(journalctl -p warning)"
    if s in SERVING_STATES:
        ttft = ""
        if f.warmup and f.warmup.ok:
            near = f.warmup.ttft_near(1024)
            if near:
                ttft = f", TTFT@{_k(near[0])}={near[1]:.0f}ms"
        ctx = v.max_model_len if v.max_model_len != AUTO else "auto"
        line = f"{s.value}: {v.served_model_name} ctx={ctx} seqs={v.max_num_seqs}{ttft}{tail}"
        if s == S.DEGRADED:
            line += f" ({f.reason})"
        if f.standby:
            line += f"; standby {f.standby}"
    elif s in (S.STARTING, S.LOADING) and f.pid is not None:
        line = f"{s.value}: {v.served_model_name} (pid {f.pid}, {int(f.run_seconds)}s){tail}"
    elif s == S.WARMING:
        line = f"warming: {f.warming or 'starting'}{tail}"
    elif s == S.RESTARTING and f.waking:
        line = f"failing over to the standby after {f.cause}{tail}"
    elif s == S.RESTARTING:
        when = "" if f.restart_in is None else f" in {max(0, f.restart_in):.0f}s"
        line = f"restarting{when} after {f.cause} ({f.failures}/{f.budget} failures in " \
               f"window){tail}"
    elif s == S.STOPPING:
        line = f"stopping: {f.stop_phase} ({int(f.seconds)}s)"
        if f.stop_phase == "drain" and f.front is not None:
            line = f"draining: {f.front.in_flight} in flight ({int(f.seconds)}s)"
    elif s == S.FAILED:
        line = f"failed: {f.reason}"[:400]
    elif s == S.PREFLIGHT and f.port_holder:
        line = f"waiting for port {f.port} held by {f.port_holder}"[:400] + tail
    else:
        line = f"{s.value}: {f.reason}"
    # held requests are said while no engine serves (at READY they are being released)
    if f.front is not None and f.front.holding and s not in SERVING_STATES \
            and s != S.STOPPING:
        line += f"; {f.front.holding} request{'s' if f.front.holding > 1 else ''} held"
    if f.front is not None and f.front.shedding:  # a [front] limit refuses clients
        line += f"; {f.front.shedding}"
    return f"{line}; {note}" if note else line


def snapshot(f: Facts, history: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """The supervisor's facts for /status, `qwen4090 status` and the page (JSON-friendly)."""
    v, w = f.vllm, f.warmup
    return {
        "state": f.state.value,
        "state_reason": f.reason,
        "state_seconds": round(f.seconds, 3),
        "child_pid": f.pid,
        "restarts": f.restarts,
        "failures_in_window": f.failures,
        "history": history,
        "model": v.served_model_name,
        "max_model_len": v.max_model_len,
        "max_num_seqs": v.max_num_seqs,
        "warmup": None if w is None else {
            "ok": w.ok, "seconds": round(w.seconds, 3), "rows": [r.__dict__ for r in w.rows],
            "error": w.error},
        "status": status,
    }


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
