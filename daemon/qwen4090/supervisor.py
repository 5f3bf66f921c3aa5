"""The supervisor owns the daemon's state and its loop: it is the only code that changes state.

The loop is steppable: :meth:`Supervisor.step` takes ``now`` and does one pass of named steps
(signals, harvest finished probes, reap the child, the current state's step, heartbeat), so
unit tests drive it with a fake clock and fake parts.  Everything that touches processes, HTTP
or systemd comes in through :class:`Parts`; blocking work (probes, warmup) runs on an executor
and its results are harvested here, so a slow vLLM never blocks signals or the watchdog.
"""

from __future__ import annotations

import random
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from qwen4090 import states, vllmfacts
from qwen4090.config import AUTO, Config, ConfigError, changed_sections
from qwen4090.instance import PortOwner, PortWait, UncheckedPorts
from qwen4090.launch import Launch, configured
from qwen4090.policy import (
    EX_CONFIG,
    EX_GPU,
    EX_OK,
    EX_TEMPFAIL,
    NOT_FAILURES,
    Cause,
    DrainSample,
    ExitVerdict,
    HangDetector,
    Progress,
    RestartBudget,
    backoff_delay,
    canary_counts,
    classify_exit,
    drain_busy,
    engine_dead_verdict,
)
from qwen4090.preflight import PreflightResult
from qwen4090.probes.http import CompletionResult, HealthResult, MetricsResult
from qwen4090.redact import safe_error
from qwen4090.states import State
from qwen4090.vllmfacts import RUNNING, WAITING
from qwen4090.warmup import WarmupResult

S = State

# How often the loop looks at a starting server, and how far EXTEND_TIMEOUT_USEC reaches.
LOAD_POLL_INTERVAL = 1.0
STOP_POLL_INTERVAL = 0.5
EXTEND_EVERY = 10.0
EXTEND_BY = 60.0
PROGRESS_WINDOW = 120.0  # output or warmup steps within this long count as "making progress"
KILL_WAIT = 30.0  # after SIGKILL, how long we wait for the group before saying who survived
PORT_RETRY = 1.0  # while vLLM's port is held: how often we look again
PORT_SAY_EVERY = 30.0  # ... and how often we say again who holds it
# After SIGTERM, once waiting is pointless (the EngineCore is gone, the drain deadline passed, a
# hang), SIGKILL what is left this much later instead of after stop.term_timeout: vLLM's API
# server otherwise sits in "Waiting for connections to close" for as long as a client keeps a
# stream open (measured on the H200: 15 s of a 31.9 s hang restart).
KILL_GRACE = 2.0
# How long the loop waits, without blocking, for vLLM's last output lines once the group is
# gone (all writers of the pipes are dead, so the readers end within milliseconds).
OUTPUT_WAIT = 2.0


# --- the parts the supervisor drives (real ones are built in cli.py) ------------------------


class ChildLike(Protocol):
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
    def client_connections(self, port: int) -> int | None: ...
    def oom_evidence(self) -> str | None: ...


class GpuLike(Protocol):
    """The GPU part (gpu.py's GpuParts; NoGpu where there is none): what the next vLLM is
    launched with (launch.py), one rung down after an OOM, and who still holds GPU memory."""

    def launch(self, cfg: Config) -> Launch: ...
    # After an OOM exit: (what was launched, the current config: the ladder's settings, the
    # verdict, vLLM's last lines) -> what was lowered, or None when nothing could be.
    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None: ...
    # Which of these pids still hold memory on the GPU with this NVML index (None: none).
    def held(self, device: int, pids: list[int]) -> str | None: ...


class NoGpu:
    """No GPU part: the launch as configured, no ladder, nothing ever held."""

    def launch(self, cfg: Config) -> Launch:
        return configured(cfg)

    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None:
        return None

    def held(self, device: int, pids: list[int]) -> str | None:
        return None


class ProbeLike(Protocol):
    def health(self, timeout: float) -> HealthResult: ...
    def metrics(self, timeout: float) -> MetricsResult: ...
    def complete(self, prompt: Sequence[int] | str, max_tokens: int, timeout: float
                 ) -> CompletionResult: ...


class NotifierLike(Protocol):
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


@dataclass
class Parts:
    spawn: Callable[[Config], ChildLike]
    make_probe: Callable[[Config], ProbeLike]
    preflight: Callable[[Launch], PreflightResult]  # every check before that launch
    warmup: Callable[[Config, ProbeLike, Callable[[str], None]], WarmupResult]
    load_config: Callable[[], Config]
    notifier: NotifierLike
    executor: ExecutorLike
    log: Any  # a structlog-style logger: .info(event, **fields), .warning, .error
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    rand: random.Random = field(default_factory=random.Random)
    # Called with (event, fields) on transitions, restarts and warmups (metrics, status page).
    listeners: list[Callable[[str, dict[str, Any]], None]] = field(default_factory=list)
    gpu: GpuLike = field(default_factory=NoGpu)
    ports: PortsLike = field(default_factory=UncheckedPorts)


@dataclass
class RestartRecord:
    wall_time: float
    cause: str
    detail: str
    counted: bool


@dataclass
class _Task:
    kind: str
    generation: int
    started: float
    future: Future[Any]
    job: Any = None  # the callable, when it reports partial progress (_PollJob)


class Supervisor:
    def __init__(self, cfg: Config, parts: Parts) -> None:
        self.cfg = cfg
        self.p = parts
        self.log = parts.log
        now = parts.clock()
        self.state = S.PREFLIGHT
        self.state_since = now
        self.state_reason = "start"
        self.exit_code: int | None = None
        self.child: ChildLike | None = None
        self.probe: ProbeLike | None = None
        self.generation = 0  # one per vLLM process; stale probe results are dropped
        self.spawned_at = now
        self.restarts = 0
        self.history: deque[RestartRecord] = deque(maxlen=50)
        self.budget = RestartBudget(cfg.restart.budget_failures, cfg.restart.budget_window)
        self.consecutive = 0
        self.failure: ExitVerdict | None = None
        self.restart_at: float | None = None
        self.kill_at: float | None = None
        self.killed_at: float | None = None
        self.ready_notified = False
        self.ready_since: float | None = None
        self.after_stable = False  # the failing run had been READY for restart.stable_after
        self.warmup: WarmupResult | None = None
        self.launch = configured(cfg)  # what the current vLLM runs with, and why (launch.py)
        self.exit_tail: list[str] = []
        self.exit_rc: int | None = None  # the child's own exit (None: alive, or ended by us)
        self.exit_oom: str | None = None  # the kernel's word on an OOM kill of that exit
        self.group_gone_at: float | None = None
        self.term_sent_at = now
        self.hurry: str | None = None  # why SIGKILL follows SIGTERM after KILL_GRACE
        self.engine_gone_at: float | None = None
        self.drain_sample: DrainSample | None = None
        self.drain_counted = False  # the gauges were read since the last connection count
        self.task_started = now  # when the task whose result is being handled was submitted
        self.canary_base: float | None = None  # progress counter when the canary was judged
        self.canary_judged_at = now  # start of the window in which a stuck canary is judged
        self.canary_stuck_noted: float | None = None
        self.old_pids: list[int] = []
        self.gone_at = now
        self.gpu_faults: deque[str] = deque()  # from the NVML Xid thread: only appends
        # (child, line) from the pipe readers: vLLM said its EngineCore died (only appends)
        self.engine_deaths: deque[tuple[object, str]] = deque()
        self.gpu_samples: deque[dict[str, Any]] = deque(maxlen=1)  # NVML sample thread: latest
        self.warmup_progress = ""
        self.last_warmup_step = now
        self.hang = HangDetector(cfg.watch.hang_timeout, cfg.watch.poll_interval)
        self.unhealthy_since: float | None = None
        self.last_metrics: MetricsResult | None = None
        self.next_poll = now  # loading and draining
        # While serving: when the last poll and canary went out; the next are due one (live,
        # reloadable) interval later, so a SIGHUP that shortens an interval acts at once.
        self.last_poll = now
        self.last_canary = now
        self.tasks: dict[str, _Task] = {}
        self.moved = False  # the last step changed the state: the next one is due at once
        self.signals: deque[int] = deque()
        self.stop_phase: str | None = None  # drain -> term
        self.drain_deadline = now
        self.last_watchdog = -1e18
        self.last_extend = -1e18
        self.last_status = ""
        self.port_wait = PortWait()
        self.stranger_said = 0  # the generation for which port_answered_by_stranger was logged

    # --- public surface ------------------------------------------------------------------

    @property
    def launch_cfg(self) -> Config:
        """The config the current vLLM runs with (auto resolved, learned applied)."""
        return self.launch.config

    def deliver(self, signum: int) -> None:
        """Queue a signal (called from the signal handler: only an append)."""
        self.signals.append(signum)

    @property
    def done(self) -> bool:
        return self.state in states.FINAL_STATES

    def next_wakeup(self, now: float) -> float:
        """Seconds the loop may sleep before the next step is due.

        Not a fixed tick where a deadline is known: the step after a transition runs at once
        (a restart's PREFLIGHT waited a whole 0.5 s tick before its launch), a backoff ends on
        time, and a poll (the hang deadline's among them) is sent when due.  A job's result
        and a signal wake the loop themselves."""
        if self.moved:
            return 0.0
        if self.state is S.RESTARTING and self.child is not None \
                and self.group_gone_at is not None:
            return 0.02  # vLLM's last lines: the pipes end milliseconds after its group
        if self.state is S.RESTARTING and self.child is None and self.restart_at is not None \
                and self.restart_at > now:
            return min(0.2, self.restart_at - now)  # then 0.2 s ticks while the GPU frees up
        if self.state in (S.RESTARTING, S.STOPPING, S.STARTING, S.LOADING):
            return 0.2
        if self.state in states.SERVING_STATES and "poll" not in self.tasks:
            return min(0.5, max(0.0, self.next_poll_at() - now))
        return 0.5

    def step(self, now: float | None = None) -> None:
        now = self.p.clock() if now is None else now
        before = self.state
        self.handle_signals(now)
        self.handle_gpu_faults(now)
        self.harvest(now)
        self.reap(now)
        self.handle_engine_deaths(now)
        getattr(self, f"step_{self.state.value}")(now)
        self.heartbeat(now)
        self.moved = self.state is not before

    def snapshot(self) -> dict[str, Any]:
        """Facts for status output (JSON-friendly)."""
        now = self.p.clock()
        v = self.launch_cfg.vllm
        return {
            "state": self.state.value,
            "state_reason": self.state_reason,
            "state_seconds": round(now - self.state_since, 3),
            "child_pid": self.child.pid if self.child else None,
            "restarts": self.restarts,
            "failures_in_window": self.budget.count(now),
            "history": [r.__dict__ for r in self.history],
            "model": v.served_model_name,
            "max_model_len": v.max_model_len,
            "max_num_seqs": v.max_num_seqs,
            "warmup": None if self.warmup is None else {
                "ok": self.warmup.ok, "seconds": round(self.warmup.seconds, 3),
                "rows": [r.__dict__ for r in self.warmup.rows], "error": self.warmup.error},
            "status": self.last_status,
        }

    # --- loop steps ------------------------------------------------------------------------

    def handle_signals(self, now: float) -> None:
        while self.signals:
            signum = self.signals.popleft()
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.handle_stop(now, signal.Signals(signum).name)
            elif signum == signal.SIGHUP:
                self.handle_reload(now)

    def handle_stop(self, now: float, why: str) -> None:
        if self.done:
            return
        if self.state == S.STOPPING:
            # A second request: no more draining.
            if self.stop_phase == "drain":
                self.log.warning("drain_skipped", reason=f"second {why}")
                self.begin_kill(now)
                self.stop_phase = "term"
            return
        serving = self.state in states.SERVING_STATES
        self.notify_stopping(f"stopping: {why}")
        self.transition(now, S.STOPPING, why)
        self.cancel_tasks()
        if self.child is None:
            return
        if serving and self.cfg.stop.drain_timeout > 0:
            self.stop_phase = "drain"
            self.drain_deadline = now + self.cfg.stop.drain_timeout
            self.drain_sample = None  # a poll from before the stop says nothing about streams
            self.next_poll = now
        else:
            self.stop_phase = "term"
            self.begin_kill(now)

    def handle_reload(self, now: float) -> None:
        """SIGHUP: read the config again; a broken one is refused and the old one stays.

        Changed ``[vllm]`` settings restart vLLM (controlled, not counted); every other section
        applies live: the supervisor reads ``self.cfg`` where it uses a setting, and cli.py's
        listener of the ``reloaded`` event (``reload_fanout``) redoes what was set up from the
        config at start-up: logging, the GPU watch, the status endpoint.

        systemd's reload protocol (sd_notify(3)) is spoken only by a service that was READY:
        before the first READY=1 the unit is still "activating", so a SIGHUP then sends neither
        RELOADING=1 nor READY=1; the new config is used from the next launch (``[vllm]``
        restarts the one loading now) and READY=1 goes out once, after the warmup.  After the
        first READY=1 a reload is RELOADING=1 + MONOTONIC_USEC and ends with READY=1 — also
        when the config is refused and while the restart it caused is still under way.
        """
        if self.done or self.state == S.STOPPING:
            return
        announce = self.ready_notified
        if announce:
            self.p.notifier.reloading()
        try:
            new = self.p.load_config()
        except ConfigError as e:
            self.log.error("reload_refused", error=str(e), keeping=",".join(self.cfg.sources))
            if announce:
                self.p.notifier.ready(self.status_line(now, note="reload refused: " + str(e)))
            return
        changed = changed_sections(self.cfg, new)
        old = self.cfg
        self.cfg = new
        self.budget.reconfigure(new.restart.budget_failures, new.restart.budget_window)
        self.hang.reconfigure(new.watch.hang_timeout, new.watch.poll_interval)
        self.log.info("reloaded", changed=",".join(changed) or "nothing",
                      files=",".join(new.sources))
        self.emit("reloaded", {"changed": changed})
        if "vllm" in changed and self.state in states.CHILD_STATES:
            self.log.warning("restart_for_reload", reason="[vllm] settings changed",
                             old_argv_len=len(old.vllm.command))
            self.fail(now, ExitVerdict(Cause.RELOAD, "[vllm] settings changed", True))
        if announce:  # READY=1 ends the reload (the restart, if any, goes on)
            self.p.notifier.ready(self.status_line(now))

    def harvest(self, now: float) -> None:
        for kind in list(self.tasks):
            task = self.tasks.get(kind)  # a failure handled above may have cancelled it
            if task is None or not task.future.done():
                continue
            del self.tasks[kind]
            if task.generation != self.generation:
                continue  # a result about a vLLM process that is gone
            try:
                result = task.future.result()
            except Exception as e:
                self.log.error("probe_crashed", kind=kind, error=safe_error(e, where=True))
                continue
            self.task_started = task.started
            getattr(self, f"on_{kind}")(now, result)

    def reap(self, now: float) -> None:
        if self.child is None or self.state not in states.CHILD_STATES:
            return
        rc = self.child.poll()
        if rc is None:
            return
        self.emit("child_exit_seen", {"code": rc})  # recovery: the timeline's fault mark
        # No waiting on the pipes here: a surviving EngineCore holds them open.  The verdict
        # is made again from the full tail once the group is gone (step_restarting).
        self.exit_rc = rc
        self.exit_oom = self.child.oom_evidence() if rc == -signal.SIGKILL else None
        verdict = self.port_verdict(now, classify_exit(rc, self.child.tail_lines(),
                                                    oom_evidence=self.exit_oom))
        self.log.warning("child_exited", pid=self.child.pid, code=rc, cause=verdict.cause.value,
                         detail=verdict.detail)
        self.fail(now, verdict)

    def heartbeat(self, now: float) -> None:
        n = self.p.notifier
        if n.watchdog_interval and now - self.last_watchdog >= n.watchdog_interval:
            n.watchdog()
            self.last_watchdog = now
        # Before the first READY=1 (and while stopping), systemd's timeouts run: extend them
        # for as long as vLLM makes visible progress.
        starting = not self.ready_notified and self.state in (
            S.PREFLIGHT, S.STARTING, S.LOADING, S.WARMING, S.RESTARTING)
        if (starting or self.state == S.STOPPING) and now - self.last_extend >= EXTEND_EVERY \
                and self.making_progress(now):
            n.extend_timeout(EXTEND_BY)
            self.last_extend = now
        status = self.status_line(now)
        if status != self.last_status:
            n.status(status)
            self.last_status = status

    def making_progress(self, now: float) -> bool:
        if self.state in (S.PREFLIGHT, S.RESTARTING, S.STOPPING):
            return True  # bounded by our own timers
        if self.state == S.WARMING:
            return now - self.last_warmup_step < PROGRESS_WINDOW
        return self.child is not None and now - self.child.last_output < PROGRESS_WINDOW

    # --- per-state steps -----------------------------------------------------------------

    def step_preflight(self, now: float) -> None:
        if self.port_wait.holder and self.port_still_held(now):
            return
        chosen = self.p.gpu.launch(self.cfg)
        res = self.p.preflight(chosen)
        for w in res.warnings:
            self.log.warning("preflight_warning", detail=w)
        if res.fatal is not None:
            self.give_up(now, EX_CONFIG, str(res.fatal))
            return
        if res.transient is not None:
            if res.port_holder is not None and self.wait_for_port(now, res.port_holder):
                return
            self.fail(now, ExitVerdict(Cause.PREFLIGHT, res.transient, True))
            return
        launch = chosen.config
        try:
            child = self.p.spawn(launch)
        except ConfigError as e:
            self.give_up(now, EX_CONFIG, str(e))
            return
        except OSError as e:
            err = ConfigError(self.cfg.sources[0] if self.cfg.sources else None,
                              "vllm.command", f"cannot start {self.cfg.vllm.command[0]}: "
                                              f"{e.strerror or e}")
            self.give_up(now, EX_CONFIG, str(err))
            return
        self.child = child
        self.launch = chosen
        self.generation += 1
        self.spawned_at = now
        self.probe = self.p.make_probe(launch)
        self.hang.reset()
        self.unhealthy_since = None
        self.failure = None
        self.exit_rc = None
        self.exit_oom = None
        self.group_gone_at = None
        self.next_poll = now
        self.log.info("child_spawned", pid=child.pid, argv=" ".join(self.safe_argv()))
        self.transition(now, S.STARTING, "spawned")

    def step_starting(self, now: float) -> None:
        assert self.child is not None
        if self.child.lines > 0:
            self.transition(now, S.LOADING, "vLLM is loading")
        else:
            self.check_load_timeout(now)

    def step_loading(self, now: float) -> None:
        if self.check_load_timeout(now):
            return
        if now >= self.next_poll and "health" not in self.tasks:
            self.submit(now, "health", _health_job(self._probe(), self.cfg.watch.health_timeout,
                                                   self._owner_check()))
            self.next_poll = now + LOAD_POLL_INTERVAL

    def check_load_timeout(self, now: float) -> bool:
        limit = self.cfg.watch.load_timeout
        if now - self.spawned_at > limit:
            self.fail(now, ExitVerdict(Cause.LOAD_TIMEOUT, f"/health not 200 within {limit:g}s "
                                                           "(watch.load_timeout)", True))
            return True
        return False

    def on_health(self, now: float, res: tuple[HealthResult, PortOwner | None]) -> None:
        if self.state == S.LOADING:
            # A 200 counts only from our own live vLLM (issue 8.2): an exited one is reap's.
            health, owner = res
            alive = self.child is not None and self.child.poll() is None
            if health.ok and alive and self.stranger_on_port(owner) is None:
                self.log.info("health_ok", seconds_since_launch=round(now - self.spawned_at, 1))
                self.begin_warmup(now)
            return

    def begin_warmup(self, now: float) -> None:
        self.transition(now, S.WARMING, "/health answered 200")
        if not self.cfg.warmup.enabled:
            self.warmup = None
            self.become_ready(now, "warmup disabled")
            return
        self.last_warmup_step = now
        self.warmup_progress = ""
        cfg, probe = self.launch_cfg, self.probe

        def progress(msg: str) -> None:
            # Runs on the warmup thread: plain assignments only.
            self.warmup_progress = msg
            self.last_warmup_step = self.p.clock()

        self.submit(now, "warmup", lambda: self.p.warmup(cfg, probe, progress))  # type: ignore[arg-type]

    def step_warming(self, now: float) -> None:
        w = self.cfg.warmup
        limit = w.timeout + w.request_timeout
        if "warmup" in self.tasks and now - self.state_since > limit:
            self.fail(now, ExitVerdict(Cause.WARMUP_FAILED, f"warmup overran {limit:g}s", True))

    def on_warmup(self, now: float, res: WarmupResult) -> None:
        if self.state != S.WARMING:
            return
        self.warmup = res
        if not res.ok:
            self.log.error("warmup_failed", error=res.error, seconds=round(res.seconds, 1))
            self.fail(now, ExitVerdict(Cause.WARMUP_FAILED, res.error, True))
            return
        self.log.info("warmup_finished", seconds=round(res.seconds, 2), table=res.table(),
                      skipped="; ".join(res.skipped) or "none")
        self.emit("warmup", {"result": res})
        self.become_ready(now, "warmed up")

    def become_ready(self, now: float, why: str) -> None:
        self.transition(now, S.READY, why)
        self.ready_since = now
        self.unhealthy_since = None
        self.last_poll = now
        self.last_canary = now
        status = self.status_line(now)
        if not self.ready_notified:
            self.p.notifier.ready(status)
            self.ready_notified = True
            self.log.info("ready_notified", seconds_since_launch=round(now - self.spawned_at, 1))
        else:
            # READY=1 went out before this restart; systemd still shows the last STATUS=
            # ("warming: ...") until we send the new one.
            self.p.notifier.status(status)
        self.last_status = status

    def served_stably(self, now: float) -> bool:
        """This run has been serving for restart.stable_after."""
        return self.state in states.SERVING_STATES and self.ready_since is not None \
            and now - self.ready_since >= self.cfg.restart.stable_after

    def note_stable(self, now: float) -> None:
        """A run READY for restart.stable_after starts the backoff over."""
        if self.consecutive and self.served_stably(now):
            assert self.ready_since is not None
            self.log.info("stable", seconds=round(now - self.ready_since), backoff_reset=True)
            self.consecutive = 0

    def step_ready(self, now: float) -> None:
        w = self.cfg.watch
        self.note_stable(now)
        if now >= self.next_poll_at() and "poll" not in self.tasks:
            self.submit(now, "poll", _PollJob(self._probe(), w.health_timeout, self.p.clock,
                                              self._owner_check()))
            self.last_poll = now
        if self.check_poll_in_flight(now):
            return
        if w.canary_interval > 0 and now >= self.last_canary + w.canary_interval \
                and "canary" not in self.tasks \
                and not (self.last_metrics and self._busy(self.last_metrics)):
            self.canary_base = _progress_of(self.last_metrics) if self.last_metrics else None
            self.canary_judged_at = now
            self.submit(now, "canary", _canary_job(self._probe(), w.canary_timeout,
                                                   w.health_timeout))
            self.last_canary = now
        canary = self.tasks.get("canary")
        if canary is not None and now - self.canary_judged_at > w.canary_timeout + 5:
            # Judged once per window: the tokens must have moved within each one.
            latest = _progress_of(self.last_metrics) if self.last_metrics else None
            stuck = f"canary request stuck for {now - canary.started:.0f}s"
            if canary_counts(False, True, self.canary_base, latest):
                self.fail(now, ExitVerdict(Cause.CANARY, stuck, True))
                return
            if self.canary_stuck_noted != canary.started:
                self.canary_stuck_noted = canary.started
                self.log.warning("canary_slow", error=stuck, tokens_before=self.canary_base,
                                 tokens_after=latest, verdict="tokens moving: busy, not hung")
            self.canary_base, self.canary_judged_at = latest, now

    def next_poll_at(self) -> float:
        """The next /health + /metrics poll: poll_interval after the last one, or earlier at
        the moment a stall being timed reaches hang_timeout (HangDetector.deadline) -- once:
        a deadline already polled for (the stall's clock is not reset while /health fails)
        must not bring each next poll forward."""
        due = self.last_poll + self.cfg.watch.poll_interval
        deadline = self.hang.deadline()
        return deadline if deadline is not None and self.last_poll < deadline < due else due

    def check_poll_in_flight(self, now: float) -> bool:
        """A /health answer overdue is a failing probe, dated from when it was sent.

        A stopped API server accepts the connection (the kernel does) and never answers; the
        probe's own result arrives only after its timeouts, so waiting for it would push the
        detection past unhealthy_timeout + one poll.  True when it ended in a restart.
        """
        poll = self.tasks.get("poll")
        if poll is None or not isinstance(poll.job, _PollJob):
            return False
        health = poll.job.health
        timeout = self.cfg.watch.health_timeout
        if health is None and (now - poll.started > timeout or self.unhealthy_since is not None):
            # already failing: the window keeps running while this probe has no answer either
            return self.health_failing(now, poll.started, f"no answer within {timeout:g}s")
        if health is not None and not health.ok:
            return self.health_failing(now, poll.started, health.error)
        sent = poll.job.metrics_sent
        if health is not None and sent is not None and now - sent > timeout:
            # /health answered, then the server stopped: /metrics is the newer probe
            return self.health_failing(now, sent, f"/metrics: no answer within {timeout:g}s")
        return False

    def health_failing(self, now: float, since: float, error: str) -> bool:
        """Record a failing /health probe sent at ``since``; True when it ended in a restart."""
        w = self.cfg.watch
        if self.unhealthy_since is None:
            self.unhealthy_since = since
            self.log.warning("health_failed", error=error)
        if self.state == S.READY:
            self.transition(now, S.DEGRADED, f"/health: {error}")
        if now - self.unhealthy_since >= w.unhealthy_timeout:
            self.fail(now, ExitVerdict(Cause.UNHEALTHY, f"/health failing for "
                                                        f"{now - self.unhealthy_since:.0f}s: "
                                                        f"{error}", True))
            return True
        return False

    step_degraded = step_ready

    def on_poll(self, now: float,
                res: tuple[HealthResult, MetricsResult, PortOwner | None]) -> None:
        if self.state not in states.SERVING_STATES:
            return
        health, metrics, owner = res
        if health.ok and (stranger := self.stranger_on_port(owner)) is not None:
            health = HealthResult(False, health.status, health.seconds,
                                  f"port answered by {stranger}, not by our vLLM")
        if health.ok and metrics.timed_out:
            # the API server stopped answering between the two requests
            if self.health_failing(now, self.task_started + health.seconds,
                                   f"/metrics: {metrics.error}"):
                return
        elif health.ok:
            if self.unhealthy_since is not None:
                self.log.info("health_recovered", after=round(now - self.unhealthy_since, 1))
            self.unhealthy_since = None
        elif self.health_failing(now, self.task_started, health.error):
            return
        stalled = 0.0
        if metrics.ok:
            self.last_metrics = metrics
            prog = Progress(metrics.get(RUNNING), metrics.get(WAITING), _progress_of(metrics))
            hang = self.hang.judge(now, prog)
            stalled = hang.stalled
            if hang.hung:
                self.log.error("hang_detected", stalled_seconds=round(stalled, 1),
                               running=prog.running, waiting=prog.waiting)
                self.emit("hang", {"stalled": stalled})
                self.fail(now, ExitVerdict(Cause.HANG, f"{prog.running:g} running, "
                                                       f"{prog.waiting:g} waiting, no token "
                                                       f"progress for {stalled:.0f}s", True))
                return
            if self.state == S.READY and hang.stalling:
                self.transition(now, S.DEGRADED, f"no token progress for {stalled:.0f}s")
                return
        if self.state == S.DEGRADED and health.ok and not metrics.timed_out and stalled == 0:
            self.transition(now, S.READY, "healthy again")

    def on_canary(self, now: float, res: tuple[MetricsResult, CompletionResult, MetricsResult]
                  ) -> None:
        if self.state not in states.SERVING_STATES:
            return
        before, result, after = res
        if result.ok:
            self.log.debug("canary_ok", ms=round(result.seconds * 1000, 1))
            return
        b = _progress_of(before) if before.ok else None
        a = _progress_of(after) if after.ok else None
        if not canary_counts(result.ok, result.timed_out, b, a):
            self.log.warning("canary_slow", error=result.error, tokens_before=b, tokens_after=a,
                             running=after.get(RUNNING), waiting=after.get(WAITING),
                             verdict="tokens moving: busy, not hung")
            return
        self.log.error("canary_failed", error=result.error, tokens_before=b, tokens_after=a)
        self.fail(now, ExitVerdict(Cause.CANARY, f"canary: {result.error}", True))

    def step_restarting(self, now: float) -> None:
        if self.child is not None:
            if not self.reap_group(now):
                return
            assert self.group_gone_at is not None
            if not self.child.output_closed() and now - self.group_gone_at < OUTPUT_WAIT:
                return  # vLLM's last lines are still on their way (never blocking the loop)
            self.exit_tail = self.child.tail_lines()
            self.reclassify_exit(now)
            self.gone_at = now
            self.child = None
            self.after_child_gone(now)
            return
        if self.restart_at is not None and now >= self.restart_at:
            if not self.gpu_released(now):
                return
            self.restart_at = None
            self.transition(now, S.PREFLIGHT, f"restart {self.restarts}")

    def reclassify_exit(self, now: float) -> None:
        """The child's own exit, judged again now that its last lines are in (the tail)."""
        if self.exit_rc is None and self.failure is not None \
                and self.failure.cause is Cause.ENGINE_DEAD:
            final = engine_dead_verdict(self.exit_tail, self.failure.detail)
            if final.cause is Cause.OOM:  # the engine's own OOM text came after its death line
                self.log.warning("exit_classified", cause=final.cause.value,
                                 detail=final.detail, was=self.failure.cause.value)
                self.failure = final
            return
        # exit_rc is set only by reap, for an exit vLLM chose itself: a child we stopped has
        # none, since reap does not run once we left the child's states.
        if self.exit_rc is None or self.failure is None \
                or self.failure.cause in (Cause.GPU_FATAL, Cause.PORT_HELD, Cause.PREFLIGHT):
            return  # judged already (a held port's wait must not be judged twice)
        final = self.port_verdict(now, classify_exit(self.exit_rc, self.exit_tail,
                                                     oom_evidence=self.exit_oom))
        if final != self.failure:
            self.log.warning("exit_classified", cause=final.cause.value, detail=final.detail,
                             was=self.failure.cause.value)
            self.failure = final

    def after_child_gone(self, now: float) -> None:
        v = self.failure
        assert v is not None
        counted = v.cause not in NOT_FAILURES
        self.restarts += 1
        self.history.append(RestartRecord(self.p.wall(), v.cause.value, v.detail, counted))
        if counted:
            self.budget.record(now)
            self.consecutive += 1
        self.emit("restart", {"cause": v.cause.value, "counted": counted})
        if not v.retry:
            code = EX_GPU if v.cause == Cause.GPU_FATAL else EX_CONFIG
            self.give_up(now, code, f"{v.cause.value}: {v.detail}")
            return
        if v.cause == Cause.OOM:
            self.step_down(v)
        if counted and self.budget.exhausted(now):
            r = self.cfg.restart
            self.give_up(now, EX_TEMPFAIL, f"crash loop: {self.budget.count(now)} failures in "
                                           f"{r.budget_window:g}s (restart.budget_failures = "
                                           f"{r.budget_failures}); last: {v.cause.value}: "
                                           f"{v.detail}")
            return
        delay = backoff_delay(self.consecutive, self.cfg.restart, self.p.rand) \
            if counted and not self.after_stable else 0.0
        self.restart_at = now + delay
        self.log.warning("restart_scheduled", cause=v.cause.value, delay=round(delay, 2),
                         restarts=self.restarts, failures_in_window=self.budget.count(now),
                         budget=self.cfg.restart.budget_failures)

    def step_down(self, v: ExitVerdict) -> None:
        """OOM: one rung down the ladder for the next launch (gpu.py remembers it).

        The ladder's own settings ([gpu] oom_ladder and its floors) are the current config's,
        so a reload that changes them applies to the next OOM; the limits are the launch's.
        """
        if not self.cfg.gpu.oom_ladder:
            self.log.error("oom_not_stepped_down", cause=v.detail,
                           reason="gpu.oom_ladder is off: the next launch uses the same "
                                  "settings", hint="set gpu.oom_ladder = true, or lower "
                                                   "vllm.max_model_len / max_num_seqs")
            return
        try:
            changes = self.p.gpu.step_down(self.launch, self.cfg, v, self.exit_tail)
        except Exception as e:
            self.log.error("oom_step_down_failed", error=safe_error(e, where=True))
            return
        if changes:
            self.log.warning("oom_step_down", changes="; ".join(changes), cause=v.detail)
            self.emit("oom_step_down", {"changes": changes})
        else:
            self.log.error("oom_ladder_exhausted", cause=v.detail,
                           hint="lower vllm.max_model_len / max_num_seqs, or use a smaller "
                                "or quantized model")

    def gpu_released(self, now: float) -> bool:
        """Before a relaunch: the old vLLM's GPU memory is free, or we waited long enough."""
        if not self.old_pids:
            return True
        held = self.p.gpu.held(self.launch.config.gpu.device, self.old_pids)
        waited = round(now - self.gone_at, 2)
        if held is None:
            self.log.info("gpu_released", waited=waited)
        elif waited < self.cfg.gpu.release_timeout:
            return False
        else:
            self.log.warning("gpu_not_released", waited=waited, holders=held,
                             hint="relaunching anyway; preflight will name what holds memory")
        self.old_pids = []
        return True

    def report_gpu_fault(self, detail: str) -> None:
        """A fatal Xid (called from the NVML thread: only an append)."""
        self.gpu_faults.append(detail)

    def report_gpu_sample(self, fields: dict[str, Any]) -> None:
        """An NVML sample (called from the sample thread: only an append)."""
        self.gpu_samples.append(fields)

    def report_engine_dead(self, child: object, line: str) -> None:
        """vLLM's line that its EngineCore died (from a pipe reader thread: only an append)."""
        self.engine_deaths.append((child, line))

    def handle_engine_deaths(self, now: float) -> None:
        """Restart at once when vLLM says its engine died: its API server would serve errors
        until its own watchdog ends it, seconds later (issue 10.2)."""
        while self.engine_deaths:
            child, line = self.engine_deaths.popleft()
            current = self.child
            if current is None or child is not current or self.state not in states.CHILD_STATES:
                continue  # an old child's late line, or a stop/restart under way already
            verdict = engine_dead_verdict(current.tail_lines(), line)
            self.log.warning("engine_died", pid=current.pid, cause=verdict.cause.value,
                             detail=verdict.detail)
            self.fail(now, verdict)

    def handle_gpu_faults(self, now: float) -> None:
        while self.gpu_samples:  # the loop's thread hands the sample to the listeners
            self.emit("gpu_sample", self.gpu_samples.popleft())
        while self.gpu_faults and not self.done:
            v = ExitVerdict(Cause.GPU_FATAL, self.gpu_faults.popleft(), retry=False)
            if self.state == S.STOPPING:
                continue  # stopping anyway
            if self.state == S.RESTARTING:
                self.failure = v  # after_child_gone gives up with EX_GPU
                if self.child is None:
                    self.restart_at = None
                    self.give_up(now, EX_GPU, f"{v.cause.value}: {v.detail}")
            elif self.child is None:
                self.give_up(now, EX_GPU, f"{v.cause.value}: {v.detail}")
            else:
                self.fail(now, v)

    def step_stopping(self, now: float) -> None:
        if self.child is None:
            self.finish_stop(now)
            return
        if self.stop_phase == "drain":
            sample = self.drain_sample
            busy = drain_busy(sample)
            expired = now >= self.drain_deadline
            if not busy or expired or self.child.poll() is not None:
                fields = {"busy": busy, "seconds": round(now - self.state_since, 2),
                          "connections": sample.connections if sample else None,
                          "running": sample.running if sample else None,
                          "waiting": sample.waiting if sample else None}
                if busy and expired:
                    self.log.warning("drain_timeout", timeout=self.cfg.stop.drain_timeout,
                                     **fields)
                self.log.info("drained", **fields)
                self.stop_phase = "term"
                self.begin_kill(now, hurry="the drain deadline passed" if busy and expired
                                else None)
                return
            if now >= self.next_poll:
                # Two tasks: the connection count is local and quick, the gauges need an
                # answer from an API server that may be too busy to accept one in time.  They
                # never overlap: the gauges' own connection must not be counted as a client.
                if "drain" not in self.tasks and "drain_gauges" not in self.tasks:
                    if self.drain_sample is None or self.drain_counted:
                        self.drain_counted = False
                        self.submit(now, "drain", _drain_job(self.child,
                                                             self.launch_cfg.vllm.port))
                    else:
                        self.submit(now, "drain_gauges", _drain_gauges_job(
                            self._probe(), self.cfg.watch.health_timeout))
                self.next_poll = now + STOP_POLL_INTERVAL
            return
        if self.reap_group(now):
            self.child = None
            self.finish_stop(now)

    def on_drain(self, now: float, connections: int | None) -> None:
        # Each part of a sample replaces its own last value; what cannot be told stays "busy"
        # (policy.drain_busy).
        last = self.drain_sample or DrainSample(None, None, None)
        self.drain_sample = DrainSample(connections, last.running, last.waiting)
        self.next_poll = now  # the gauges next, at once

    def on_drain_gauges(self, now: float, gauges: tuple[float | None, float | None]) -> None:
        last = self.drain_sample or DrainSample(None, None, None)
        self.drain_sample = DrainSample(last.connections, *gauges)
        self.drain_counted = True  # a count next

    def finish_stop(self, now: float) -> None:
        self.exit_code = EX_OK
        self.transition(now, S.STOPPED, "stopped")

    def step_stopped(self, now: float) -> None:
        pass

    def step_failed(self, now: float) -> None:
        pass

    # --- vLLM's port: ours, or held by someone else (issue 8.2, 8.4; instance.py) -----------

    def _owner_check(self) -> Callable[[], PortOwner] | None:
        """Who listens on vLLM's port, for a probe job to find out on its own thread: under
        load the walk of the group's sockets took seconds, and in the loop it blocked every
        other step (seen: SIGTERM handled late)."""
        child, v = self.child, self.launch_cfg.vllm
        if child is None:
            return None
        return lambda: self.p.ports.owner(child, v.host, v.port)

    def stranger_on_port(self, owner: PortOwner | None = None) -> str | None:
        """Who listens on vLLM's port when it is not our child's group (None: ours).

        A 200 from anyone else (a stray server, another supervisor's vLLM) must never count
        as our vLLM: no warmup and no READY=1 against it.  "Cannot tell" counts as ours, and
        so does no child: an exited vLLM is reap's, in this same step.
        """
        child = self.child
        if child is None or child.poll() is not None:
            return None
        v = self.launch_cfg.vllm
        if owner is None:  # not looked up by the job (no child when it was submitted): now
            owner = self.p.ports.owner(child, v.host, v.port)
        if owner.ours is not False:
            self.port_wait.reset()
            return None
        if self.stranger_said != self.generation:
            self.stranger_said = self.generation
            self.log.warning("port_answered_by_stranger", port=f"{v.host}:{v.port}",
                             holder=owner.holder, pid=child.pid,
                             detail="not counted as our vLLM's /health")
        return owner.holder

    def wait_for_port(self, now: float, holder: str) -> bool:
        """True while a held port is waited on (in PREFLIGHT, not a failure), bounded by
        restart.port_wait; False once that is spent (the caller counts a failure)."""
        v, limit = self.cfg.vllm, self.cfg.restart.port_wait
        waited = round(self.port_wait.waited(now), 1)
        wait, say = self.port_wait.observe(now, holder, limit, PORT_SAY_EVERY)
        if say:
            self.log.warning("port_busy", port=f"{v.host}:{v.port}", holder=holder,
                             waited=waited, limit=limit)
        if not wait:
            self.log.error("port_wait_spent", port=f"{v.host}:{v.port}", holder=holder,
                           waited=waited, limit=limit)
        self.port_wait.next_check = now + PORT_RETRY
        return wait

    def port_still_held(self, now: float) -> bool:
        """While waiting for the port: look again (cheaply, not the whole preflight).  True:
        nothing more to do in this step (still waiting, or the wait is spent and counted)."""
        if now < self.port_wait.next_check:
            return True
        v = self.cfg.vllm
        holder = self.p.ports.holder(v.host, v.port)
        if holder is None:
            self.log.info("port_free", port=f"{v.host}:{v.port}",
                          waited=round(self.port_wait.waited(now), 1))
            self.port_wait.holder = ""
            return False
        if not self.wait_for_port(now, holder):
            self.fail(now, ExitVerdict(Cause.PREFLIGHT, f"port {v.host}:{v.port} is in use by "
                                                        f"{holder}", True))
        return True

    def port_verdict(self, now: float, verdict: ExitVerdict) -> ExitVerdict:
        """vLLM died of a held port: waited on like a held port at preflight, until the wait is
        spent; then it counts (so a port that looks free to us but not to vLLM cannot loop)."""
        if verdict.cause != Cause.PORT_HELD:
            return verdict
        limit = self.cfg.restart.port_wait
        if self.port_wait.spent(now, limit):
            self.port_wait.reset()
            return ExitVerdict(Cause.PREFLIGHT, f"{verdict.detail} (restart.port_wait = "
                                                f"{limit:g}s spent)", True)
        if self.port_wait.since is None:
            self.port_wait.since = now
        return verdict

    # --- failure and stopping the child ----------------------------------------------------

    def fail(self, now: float, verdict: ExitVerdict) -> None:
        """Leave the running states for RESTARTING: stop the group, then decide."""
        if self.state in (S.RESTARTING, S.STOPPING) or self.done:
            return
        # A failure found in this step's harvest comes before step_ready's own check.
        self.note_stable(now)
        # A run that served for restart.stable_after is restarted at once (issue 10.2): one
        # fault after a long healthy period is not a crash loop; the next ones back off.
        self.after_stable = self.served_stably(now)
        self.failure = verdict
        level = self.log.info if verdict.cause in NOT_FAILURES else self.log.error
        level("vllm_failed", cause=verdict.cause.value, detail=verdict.detail,
              pid=self.child.pid if self.child else None)
        self.transition(now, S.RESTARTING, f"{verdict.cause.value}: {verdict.detail}")
        self.cancel_tasks()
        self.last_metrics = None
        if self.child is not None:
            self.old_pids = [self.child.pid, *self.child.group_members()]
            # A hung engine will not shut down politely: no term_timeout wait for it.
            self.begin_kill(now, hurry="hang: the engine makes no progress"
                            if verdict.cause == Cause.HANG else None)
            if self.child.poll() is not None and self.child.group_alive():
                # The API server is gone: what is left of its group (the EngineCore) serves
                # nobody, and vLLM's own shutdown force-kills it too ("Process manager: force
                # killing remaining processes").  Its SIGTERM teardown took 1.3 s of an
                # API-server kill's restart on the H200 (issue 10).
                self.kill_group(now, "the API server is gone; its EngineCore serves nobody")
        else:
            self.after_child_gone(now)

    def begin_kill(self, now: float, hurry: str | None = None) -> None:
        """SIGTERM the group; SIGKILL after term_timeout, or after KILL_GRACE with a reason."""
        assert self.child is not None
        self.kill_at = now + self.cfg.stop.term_timeout
        self.killed_at = None
        self.term_sent_at = now
        self.hurry = hurry
        self.engine_gone_at = None
        self.group_gone_at = None
        if self.child.signal_group(signal.SIGTERM):
            # A stopped process (SIGSTOP, a debugger) acts on TERM only once continued.
            self.child.signal_group(signal.SIGCONT)
            self.log.info("group_signalled", signal="SIGTERM", pgid=self.child.pid,
                          hurry=hurry)

    def reap_group(self, now: float) -> bool:
        """True once no process of the child's group is left (TERM, then KILL)."""
        assert self.child is not None
        if self.group_gone_at is not None:
            return True
        rc = self.child.poll()
        if rc is not None and not self.child.group_alive():
            self.group_gone_at = now
            self.log.info("group_gone", pid=self.child.pid, code=rc,
                          seconds_after_term=round(now - self.term_sent_at, 2))
            return True
        if self.killed_at is None:
            why = self.kill_reason(now)
            if why is not None:
                self.kill_group(now, why)
        if self.killed_at is not None and now - self.killed_at > KILL_WAIT:
            self.log.error("group_survives_kill", pids=self.child.group_members())
            self.group_gone_at = now
            return True
        return False

    def kill_group(self, now: float, why: str) -> None:
        assert self.child is not None
        self.log.warning("group_kill", reason=why, pgid=self.child.pid)
        self.child.signal_group(signal.SIGKILL)
        self.killed_at = now

    def kill_reason(self, now: float) -> str | None:
        """Why SIGKILL is due now (None: keep waiting for the group to end by itself)."""
        assert self.child is not None
        if self.kill_at is not None and now >= self.kill_at:
            return f"still running {self.cfg.stop.term_timeout:g}s after SIGTERM"
        if now - self.term_sent_at < KILL_GRACE:
            return None
        if self.hurry is not None:
            return f"{self.hurry}; {now - self.term_sent_at:.1f}s after SIGTERM"
        if self.engine_gone_at is None and not self.child.engine_pids():
            self.engine_gone_at = now
        if self.engine_gone_at is not None and now - self.engine_gone_at >= KILL_GRACE:
            return (f"no EngineCore left {now - self.engine_gone_at:.1f}s; the API server would "
                    "only wait for idle client connections")
        return None

    def give_up(self, now: float, code: int, why: str) -> None:
        self.exit_code = code
        self.log.critical("giving_up", exit_code=code, reason=why)
        self.transition(now, S.FAILED, why)

    def cancel_tasks(self) -> None:
        for task in self.tasks.values():
            task.future.cancel()
        self.tasks.clear()

    def submit(self, now: float, kind: str, fn: Callable[[], Any]) -> None:
        self.tasks[kind] = _Task(kind, self.generation, now, self.p.executor.submit(fn), fn)

    def _probe(self) -> ProbeLike:
        assert self.probe is not None, "probe exists while a child runs"
        return self.probe

    @staticmethod
    def _busy(m: MetricsResult) -> bool:
        return m.get(RUNNING) + m.get(WAITING) > 0

    # --- telling ----------------------------------------------------------------------------

    def transition(self, now: float, dst: State, reason: str, **fields: Any) -> None:
        src = self.state
        states.check(src, dst)
        self.state, self.state_since, self.state_reason = dst, now, reason
        self.log.info("state_changed", **{"from": src.value}, to=dst.value, reason=reason,
                      pid=self.child.pid if self.child else None, restarts=self.restarts,
                      **fields)
        self.emit("transition", {"from": src.value, "to": dst.value, "reason": reason})

    def emit(self, event: str, fields: dict[str, Any]) -> None:
        for listener in self.p.listeners:
            try:
                listener(event, fields)
            except Exception as e:
                self.log.error("listener_failed", event_name=event,
                               error=safe_error(e, where=True))

    def notify_stopping(self, status: str) -> None:
        self.p.notifier.stopping(status)
        self.last_status = status

    def status_line(self, now: float, note: str = "") -> str:
        v = self.launch_cfg.vllm
        s = self.state
        secs = int(now - self.state_since)
        tail = f", restarts={self.restarts}"
        if s == S.READY or s == S.DEGRADED:
            ttft = ""
            if self.warmup and self.warmup.ok:
                near = self.warmup.ttft_near(1024)
                if near:
                    ttft = f", TTFT@{_k(near[0])}={near[1]:.0f}ms"
            ctx = v.max_model_len if v.max_model_len != AUTO else "auto"
            line = f"{s.value}: {v.served_model_name} ctx={ctx} seqs={v.max_num_seqs}{ttft}{tail}"
            if s == S.DEGRADED:
                line += f" ({self.state_reason})"
        elif s in (S.STARTING, S.LOADING):
            pid = self.child.pid if self.child else "-"
            line = f"{s.value}: {v.served_model_name} (pid {pid}, {int(now - self.spawned_at)}s)" \
                   f"{tail}"
        elif s == S.WARMING:
            line = f"warming: {self.warmup_progress or 'starting'}{tail}"
        elif s == S.RESTARTING:
            when = "" if self.restart_at is None else f" in {max(0, self.restart_at - now):.0f}s"
            cause = self.failure.cause.value if self.failure else "?"
            line = f"restarting{when} after {cause} ({self.budget.count(now)}/" \
                   f"{self.cfg.restart.budget_failures} failures in window){tail}"
        elif s == S.STOPPING:
            line = f"stopping: {self.stop_phase or 'stop'} ({secs}s)"
        elif s == S.FAILED:
            line = f"failed: {self.state_reason}"[:400]
        elif s == S.PREFLIGHT and self.port_wait.holder:
            c = self.cfg.vllm
            line = f"waiting for port {c.host}:{c.port} held by {self.port_wait.holder}"[:400] \
                + tail
        else:
            line = f"{s.value}: {self.state_reason}"
        return f"{line}; {note}" if note else line

    def safe_argv(self) -> list[str]:
        return list(self.launch.argv)  # child.render_argv: never a secret


# Jobs for the executor: each binds its probe now, so a later config cannot change it.
def _health_job(probe: ProbeLike, timeout: float, owner: Callable[[], PortOwner] | None
                ) -> Callable[[], tuple[HealthResult, PortOwner | None]]:
    """/health while loading, and whose 200 it was (found here, off the loop, as _PollJob)."""
    def job() -> tuple[HealthResult, PortOwner | None]:
        health = probe.health(timeout)
        return health, _whose(health, owner)
    return job


def _whose(health: HealthResult, owner: Callable[[], PortOwner] | None) -> PortOwner | None:
    """Who listens on the port, asked only for a 200 (the walk is slow: a job's thread)."""
    return owner() if health.ok and owner is not None else None


class _PollJob:
    """/health then /metrics; ``health`` is set as soon as the first answer is in, so the loop
    can tell an overdue /health from a slow /metrics while the job still runs."""

    def __init__(self, probe: ProbeLike, timeout: float, clock: Callable[[], float],
                 owner: Callable[[], PortOwner] | None = None) -> None:
        self.probe = probe
        self.timeout = timeout
        self.clock = clock
        self.owner = owner
        self.health: HealthResult | None = None
        self.metrics_sent: float | None = None

    def __call__(self) -> tuple[HealthResult, MetricsResult, PortOwner | None]:
        health = self.probe.health(self.timeout)
        self.metrics_sent = self.clock()  # before ``health``: the loop reads them unlocked
        self.health = health
        metrics = self.probe.metrics(self.timeout)
        return health, metrics, _whose(health, self.owner)


def _canary_job(probe: ProbeLike, timeout: float, metrics_timeout: float
                ) -> Callable[[], tuple[MetricsResult, CompletionResult, MetricsResult]]:
    # The counters on both sides of the canary tell a queued canary from a hung engine.
    return lambda: (probe.metrics(metrics_timeout), probe.complete([TOKEN_CANARY], 1, timeout),
                    probe.metrics(metrics_timeout))


def _drain_job(child: ChildLike, port: int) -> Callable[[], int | None]:
    return lambda: child.client_connections(port)


def _drain_gauges_job(probe: ProbeLike, timeout: float
                      ) -> Callable[[], tuple[float | None, float | None]]:
    def job() -> tuple[float | None, float | None]:
        m = probe.metrics(timeout)
        return (m.get(RUNNING), m.get(WAITING)) if m.ok else (None, None)
    return job


TOKEN_CANARY = 785  # any id < 1000 exists in every vocabulary we serve


def _progress_of(m: MetricsResult) -> float:
    """The engine's progress counter in one /metrics answer (vllmfacts says which metrics)."""
    return vllmfacts.progress_counter(m.values)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
