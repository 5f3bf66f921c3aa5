"""One vLLM run: one process group, from its spawn to the moment it is gone.

A :class:`Run` is built fresh at each spawn, so nothing of one vLLM process can leak into the
next (no hand-written resets): its child, probe and launch, the jobs in flight about it, what
it said when it exited, and its judges (judges.py: the kill schedule, the drain, the serving
schedule; policy.HangDetector).  supervisord makes the same split between its loop and one
machine per process.

The Run sends its own signals and starts its own probe jobs, and turns their results into
verdicts; it never changes the daemon's state.  The supervisor asks it (``start_step``,
``watch``, ``on_poll``, ``on_canary``, ``reap_group``...) and acts on the verdicts: a
:class:`Move` between states, or a :class:`Fail` (an ``ExitVerdict``) that fails the run.
Each Run has a :class:`Role` (the serving engine, the standby, one being retired) and its own
:class:`Phase`, which it moves itself; the supervisor keeps every Run as a row of one table
(engines.py) and the daemon's state says only what the service does (issue 29.3).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from qwen4090.base import fdlimit, vllmfacts
from qwen4090.base.events import HangSeen, WarmedUp
from qwen4090.base.redact import safe_error
from qwen4090.base.states import State
from qwen4090.base.vllmfacts import RUNNING, WAITING
from qwen4090.decide.judges import Drain, KillSchedule, ServingSchedule
from qwen4090.decide.policy import (
    Cause,
    ExitVerdict,
    HangDetector,
    Progress,
    canary_counts,
    classify_exit,
    engine_dead_verdict,
    hang_timeout_risk,
    warmup_bound,
)
from qwen4090.decide.results import (
    CompletionResult,
    FrontSample,
    HealthResult,
    MetricsResult,
    Patient,
    PortOwner,
    ProbeLike,
    WarmupResult,
)
from qwen4090.launching.launchvalue import Launch
from qwen4090.parts.contracts import ChildLike, LogLike, PortsLike, StepTimesLike
from qwen4090.settings.config import Config, WatchConfig

LOAD_POLL_INTERVAL = 1.0  # how often /health is asked while vLLM loads
# How long the loop waits, without blocking, for vLLM's last output lines once the group is
# gone (all writers of the pipes are dead, so the readers end within milliseconds).
OUTPUT_WAIT = 2.0
TOKEN_CANARY = 785  # any id < 1000 exists in every vocabulary we serve


@dataclass(frozen=True)
class Move:
    """A verdict of the serving watch: READY <-> DEGRADED, with the reason."""

    to: State
    reason: str


@dataclass(frozen=True)
class Fail:
    """A verdict of the serving watch: fail the run (after telling ``event``, if any)."""

    verdict: ExitVerdict
    event: HangSeen | None = None


@dataclass(frozen=True)
class Ready:
    """A verdict of the start: the run serves (its warmup's result, None without one; the
    event to tell first)."""

    reason: str
    warmup: WarmupResult | None = None
    event: WarmedUp | None = None


Verdict = Move | Fail | Ready


class _Verdicts:
    """The verdicts of one look, in order, and the state they leave (a failure ends it)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.out: list[Verdict] = []

    def move(self, to: State, reason: str) -> None:
        if self.state is not to:
            self.out.append(Move(to, reason))
            self.state = to

    def fail(self, verdict: ExitVerdict, event: HangSeen | None = None) -> None:
        self.out.append(Fail(verdict, event))

    @property
    def failed(self) -> bool:
        return any(isinstance(v, Fail) for v in self.out)


class Role(enum.Enum):
    """What an engine is for; a row of the table (engines.py) has one at a time."""

    SERVING = "serving"  # the engine the front sends clients to (once it serves)
    STANDBY = "standby"  # started beside it, to take over (standby.py)
    RETIRING = "retiring"  # being stopped, and nobody waits for it but the GPU


class Phase(enum.Enum):
    """Where one engine is, from its spawn to its end: its own, not the daemon's state."""

    STARTING = "starting"  # spawned, no line from vLLM yet
    LOADING = "loading"  # /health asked until the 200
    WARMING = "warming"  # the warmup (serving), the check and sleep (standby), a wake
    UP = "up"  # answers, and is watched when it serves
    HELD = "held"  # up but not watched: asleep, or about to be put to sleep
    STOPPING = "stopping"  # drained or signalled: TERM, then KILL
    GONE = "gone"  # no process of its group is left


class Job(enum.Enum):
    """What a job in flight asks of an engine; its result goes to one handler (the
    supervisor's ``route``), chosen by the job and the engine's role."""

    HEALTH = "health"  # /health while loading (the serving engine's start, the standby's)
    WARMUP = "warmup"
    POLL = "poll"  # the serving watch: /health + /metrics
    CANARY = "canary"
    DRAIN_GAUGES = "drain_gauges"  # taken by the run itself (its drain)
    CHECK = "check"  # the standby's known answer
    SLEEP = "sleep"  # ... and its sleep
    BUILD_REFERENCE = "build_reference"  # the serving engine's answer before it sleeps
    BUILD_SLEEP = "build_sleep"  # ... its sleep for the standby's build
    BUILD_WAKE = "build_wake"  # ... its wake after it
    BUILD_CHECK = "build_check"  # ... and its answer again
    FAILOVER_WAKE = "failover_wake"  # the promoted standby's wake
    FAILOVER_CHECK = "failover_check"  # ... and its known answer


@dataclass
class Task:
    """A job in flight on the executor about this run."""

    kind: Job
    started: float
    future: Future[Any]
    job: Any = None  # the callable, when it reports partial progress (_PollJob)


class Run:
    def __init__(self, child: ChildLike, probe: ProbeLike, launch: Launch, now: float,
                 watch: WatchConfig, log: LogLike, submit: Callable[[Callable[[], Any]],
                                                                    Future[Any]],
                 clock: Callable[[], float], warnings: int = 0, role: Role = Role.SERVING
                 ) -> None:
        """``submit`` runs a job off the loop (the supervisor's executor); ``warnings``: how
        many warnings its preflight logged (STATUS= says so while it runs)."""
        self.child = child
        self.role = role
        self.phase = Phase.STARTING
        self.warnings = warnings
        self.probe = probe
        self.launch = launch
        self.spawned_at = now
        self.log = log
        self._submit = submit
        self.clock = clock
        self.tasks: dict[Job, Task] = {}
        self.next_load_poll = now
        self.warmup_progress = ""
        self.warmup_started = self.last_warmup_step = now
        self.serving = ServingSchedule(HangDetector(watch.hang_timeout, watch.poll_interval,
                                                    watch.hang_floor), now, now)
        self.last_metrics: MetricsResult | None = None
        self.metrics_at: float | None = None  # when last_metrics came in
        self.canary_base: float | None = None  # progress counter when the canary was judged
        self.canary_judged_at = now  # start of the window in which a stuck canary is judged
        self.canary_stuck_noted: float | None = None
        self.kill: KillSchedule | None = None  # set by SIGTERM
        self.drain: Drain | None = None  # set by a stop that drains
        self.gone_at: float | None = None  # no process of the group is left
        self.exit_rc: int | None = None  # its own exit (None: alive, or ended by us)
        self.exit_oom: str | None = None  # the kernel's word on an OOM kill of that exit
        self.stranger_said = False  # port_answered_by_stranger was logged
        self.longest_step: float | None = None  # seconds: the warmup's (steptime.py)
        self.bound_step: float | None = None  # ... or the last one on disk: the hang bound's
        self.front_seen: FrontSample | None = None  # the front's counts at the last step

    @property
    def config(self) -> Config:
        return self.launch.config

    # --- jobs ------------------------------------------------------------------------------

    def submit(self, now: float, kind: Job, fn: Callable[[], Any]) -> None:
        self.tasks[kind] = Task(kind, now, self._submit(fn), fn)

    def finished(self, now: float) -> Iterator[tuple[Task, Any]]:
        """The jobs that are done, each once, with its result (an exception is logged); the
        drain's own looks are taken here."""
        for kind in list(self.tasks):
            task = self.tasks.get(kind)  # a failure handled by the caller may have cancelled
            if task is None or not task.future.done():
                continue
            del self.tasks[kind]
            try:
                result = task.future.result()
            except Exception as e:
                self.log.error("probe_crashed", kind=kind.value, error=safe_error(e, where=True))
                continue
            if kind is Job.DRAIN_GAUGES:
                if self.drain is not None:
                    self.drain.on_gauges(*result)
            else:
                yield task, result

    def cancel_tasks(self) -> None:
        for task in self.tasks.values():
            task.future.cancel()
        self.tasks.clear()

    def deadlines(self, w: WatchConfig) -> list[float]:
        """When each judge of this run wants the loop back (the loop sleeps until the first),
        by its own phase: the load's bound and polls, the serving watch, the stop."""
        out: list[float] = []
        if self.kill is not None:
            out.append(self.kill.deadline())
        if self.drain is not None:
            out.append(self.drain.next_deadline())
        if self.phase in (Phase.STARTING, Phase.LOADING):
            out.append(self.spawned_at + w.load_timeout)
        if self.phase is Phase.LOADING and Job.HEALTH not in self.tasks:
            out.append(self.next_load_poll)
        if self.phase is Phase.UP and self.role is Role.SERVING and Job.POLL not in self.tasks:
            # A canary in flight, or withheld while the engine is busy, is not due before the
            # next poll says otherwise: its past deadline would make the loop spin (measured on
            # the H200: a core of the supervisor at c=1, the front's TTFT +5 ms).
            waits = Job.CANARY in self.tasks or bool(self.last_metrics and _busy(self.last_metrics))
            out.append(self.serving.next_deadline(
                w.poll_interval, 0.0 if waits else w.canary_interval,
                _quiet_since(self.front_seen, self.clock())))
        return out

    # --- loading -----------------------------------------------------------------------------

    def start_step(self, now: float, cfg: Config, ports: PortsLike) -> list[Verdict]:
        """STARTING until vLLM's first line, LOADING with a /health poll each
        LOAD_POLL_INTERVAL until the 200 (the supervisor's on_health), WARMING until the
        warmup's result; each bounded (watch.load_timeout, warmup.timeout + request_timeout)."""
        w = cfg.watch
        if self.phase is Phase.WARMING:
            # the warmup's own bound: one that is still making progress has returned by then
            limit = warmup_bound(cfg)
            if Job.WARMUP in self.tasks and now - self.warmup_started > limit:
                return [Fail(ExitVerdict(Cause.WARMUP_FAILED, f"warmup overran {limit:g}s",
                                         True))]
            return []
        if self.phase is Phase.STARTING and self.child.lines > 0:
            self.phase = Phase.LOADING
            return [Move(State.LOADING, "vLLM is loading")]
        if now - self.spawned_at > w.load_timeout:
            return [Fail(ExitVerdict(Cause.LOAD_TIMEOUT, f"/health not 200 within "
                                                         f"{w.load_timeout:g}s "
                                                         "(watch.load_timeout)", True))]
        if self.phase is Phase.LOADING and now >= self.next_load_poll \
                and Job.HEALTH not in self.tasks:
            self.submit(now, Job.HEALTH, _health_job(self.probe, w.health_timeout,
                                                   self.owner_check(ports)))
            self.next_load_poll = now + LOAD_POLL_INTERVAL
        return []

    def on_health(self, now: float, res: tuple[HealthResult, PortOwner | None],
                  stranger: Callable[[PortOwner | None], str | None], cfg: Config,
                  warmup: Callable[..., Any]) -> list[Verdict]:
        """LOADING: a 200 counts only from our own live vLLM (issue 8.2: an exited one is
        reap's; ``stranger`` says who else answered on its port): WARMING, and the warmup
        begins, or READY at once without one."""
        health, owner = res
        if not health.ok or self.child.poll() is not None or stranger(owner) is not None:
            return []
        self.log.info("health_ok", seconds_since_launch=round(now - self.spawned_at, 1))
        warming = Move(State.WARMING, "/health answered 200")
        if not cfg.warmup.enabled:
            return [warming, Ready("warmup disabled")]
        self.begin_warmup(now, warmup)
        return [warming]

    def on_warmup(self, res: WarmupResult, cfg: Config, step_times: StepTimesLike
                  ) -> list[Verdict]:
        """WARMING: the warmup's result (``warmed``): READY, or the failure."""
        if (failed := self.warmed(res, cfg, step_times)) is not None:
            return [Fail(failed)]
        return [Ready("warmed up", res, WarmedUp(res.seconds, tuple(res.rows)))]

    def begin_warmup(self, now: float, warmup: Callable[..., Any]) -> None:
        self.phase = Phase.WARMING
        self.warmup_started = self.last_warmup_step = now
        self.warmup_progress = ""
        cfg, probe = self.config, self.probe

        def progress(msg: str) -> None:
            # Runs on the warmup thread: plain assignments only.
            self.warmup_progress = msg
            self.last_warmup_step = self.clock()

        # a warmup request that finds no file descriptor is sent again, not a failed warmup
        self.submit(now, Job.WARMUP, lambda: warmup(cfg, Patient(probe), progress))

    def warmed(self, res: WarmupResult, cfg: Config, step_times: StepTimesLike
               ) -> ExitVerdict | None:
        """The warmup's result, said in the journal: a failure's verdict, or None (READY).
        The longest engine step it measured is kept in ``step_times`` (steptime.py) and
        held against watch.hang_timeout; a warmup cut short by clients' requests is an OK
        one (issue 18.4), said with why."""
        if not res.ok:
            self.log.error("warmup_failed", error=res.error, seconds=round(res.seconds, 1))
            return ExitVerdict(Cause.WARMUP_FAILED, res.error, True)
        if res.cut_short:
            self.log.warning("warmup_cut_short", reason=res.cut_short,
                             steps_skipped=sum("cut short" in s for s in res.skipped))
        step = res.longest_step
        self.log.info("warmup_finished", seconds=round(res.seconds, 2), table=res.table(),
                      skipped="; ".join(res.skipped) or "none",
                      longest_step_seconds=round(step[0], 3) if step else None,
                      longest_step_tokens=step[1] if step else None)
        if step is not None:
            self.longest_step = step[0]
            step_times.record(cfg, *step)
        self.check_hang_timeout(cfg, step_times)
        return None

    def check_hang_timeout(self, cfg: Config, step_times: StepTimesLike) -> None:
        """Warn when watch.hang_timeout is below a safe multiple of the longest engine step
        (this run's warmup measured it, else the last one on disk for these settings)."""
        step = self.longest_step
        if step is None:
            step = step_times.measured(cfg)
        self.bound_step = step
        self.serving.hang.set_steps(step, None)
        if (risk := hang_timeout_risk(cfg.watch.hang_timeout, step)) is not None:
            self.log.warning("hang_timeout_too_short", hang_timeout=cfg.watch.hang_timeout,
                             longest_step_seconds=round(step or 0.0, 3), detail=risk)

    def reconfigure(self, cfg: Config, watch_changed: bool, step_times: StepTimesLike
                    ) -> None:
        """A reload: the hang detector takes the new [watch] (the stall being timed goes on),
        held against the longest step when [watch] changed."""
        self.serving.hang.reconfigure(cfg.watch.hang_timeout, cfg.watch.poll_interval,
                                      cfg.watch.hang_floor)
        if watch_changed:
            self.check_hang_timeout(cfg, step_times)

    def hang_doc(self) -> dict[str, Any]:
        """/status's "hang": the stall that counts as a hang now, and what it comes from."""
        h = self.serving.hang
        gap = self.front_seen.longest_gap if self.front_seen is not None else None
        return {"bound_seconds": round(min(h.bound, h.hang_timeout), 3),
                "hang_timeout": h.hang_timeout, "floor": h.floor,
                "longest_step_seconds": None if self.bound_step is None
                else round(self.bound_step, 3),
                "longest_gap_seconds": None if gap is None else round(gap, 3)}

    def became_ready(self, now: float, step: float | None = None) -> None:
        """The watch starts over: a stall timed before READY (a start, a sleep) is not this
        serving's, and a first sample is taken at once, so that a hang in the first
        poll_interval is dated from its last progress (H200: a SIGSTOP 0.3 s after a rebuild's
        READY, with no sample since, was timed from the first poll, 1.7 s late).  ``step``:
        the longest step on disk for these settings, the bound of an engine that never ran
        a warmup of its own (a promoted standby: it was warmed asleep, by its predecessor)."""
        self.phase = Phase.UP
        if self.bound_step is None and step is not None:
            self.bound_step = step
            self.serving.hang.set_steps(step, None)
        self.serving.restart(now)

    def assign(self, role: Role) -> None:
        """The table gives the row a new role (engines.py: promote, retire)."""
        self.role = role

    def skip_drain(self, now: float, term_timeout: float) -> bool:
        """A second stop request while draining: no more draining, the group is signalled."""
        if self.drain is None:
            return False
        self.drain = None
        self.begin_kill(now, term_timeout)
        return True

    def hold(self) -> None:
        """Up, but not watched: it sleeps (or is about to: a build), or waits as the standby."""
        self.phase = Phase.HELD

    def warming(self) -> None:
        """Its answers before it counts: a standby's check and sleep, a promoted standby's
        wake and check (then ``became_ready``)."""
        self.phase = Phase.WARMING

    # --- vLLM's port: ours, or a stranger's (issue 8.2) ---------------------------------------

    def owner_check(self, ports: PortsLike) -> Callable[[], PortOwner]:
        """Who listens on vLLM's port, for a probe job to find out on its own thread: under
        load the walk of the group's sockets took seconds, and in the loop it blocked every
        other step (seen: SIGTERM handled late)."""
        child, at = self.child, self.launch.engine
        return lambda: ports.owner(child, at.host, at.port)

    def stranger_on_port(self, ports: PortsLike, owner: PortOwner | None = None) -> str | None:
        """Who listens on vLLM's port when it is not our child's group (None: ours).

        A 200 from anyone else (a stray server, another supervisor's vLLM) must never count
        as our vLLM: no warmup and no READY=1 against it.  "Cannot tell" counts as ours, and
        so does an exited vLLM: that is reap's, in this same step.
        """
        if self.child.poll() is not None:
            return None
        if owner is None:  # not looked up by the job: now
            at = self.launch.engine
            owner = ports.owner(self.child, at.host, at.port)
        return self.stranger(owner)

    def stranger(self, owner: PortOwner) -> str | None:
        """The holder of vLLM's port when ``owner`` says it is not our child's group (said
        in the journal once per run), else None."""
        if owner.ours is not False:
            return None
        if not self.stranger_said:
            self.stranger_said = True
            self.log.warning("port_answered_by_stranger", port=str(self.launch.engine),
                             holder=owner.holder, pid=self.child.pid,
                             detail="not counted as our vLLM's /health")
        return owner.holder

    # --- serving: poll, canary, hang ---------------------------------------------------------

    def watch(self, now: float, state: State, w: WatchConfig, ports: PortsLike,
              front: FrontSample | None = None) -> list[Verdict]:
        """One serving step: send the poll and the canary when due, judge the ones in flight.
        ``front``: the front's counts now (its silence brings polls forward: deadlines)."""
        out = _Verdicts(state)
        self.front_seen = front
        if (gone := self.child.engine_gone()) is not None and self.child.poll() is None:
            # before vLLM's own line (seconds later on the H200): the restart, or the standby
            out.fail(self.said_dead(ExitVerdict(Cause.ENGINE_DEAD,
                                                f"vLLM's EngineCore died: {gone}", True)))
            return out.out
        if self.serving.poll_due(now, w.poll_interval, _quiet_since(front, now)) \
                and Job.POLL not in self.tasks:
            self.submit(now, Job.POLL, _PollJob(self.probe, w.health_timeout, self.clock,
                                              self.owner_check(ports)))
            self.serving.polled(now)
        self.poll_in_flight(now, w, out)
        if out.failed:
            return out.out
        if self.serving.canary_due(now, w.canary_interval) and Job.CANARY not in self.tasks \
                and not (self.last_metrics and _busy(self.last_metrics)):
            self.canary_base = _progress_of(self.last_metrics) if self.last_metrics else None
            self.canary_judged_at = now
            self.submit(now, Job.CANARY, _canary_job(self.probe, w.canary_timeout,
                                                   w.health_timeout))
            self.serving.canary_sent(now)
        self.canary_in_flight(now, w, out)
        return out.out

    def canary_in_flight(self, now: float, w: WatchConfig, out: _Verdicts) -> None:
        """A canary with no answer is judged once per window: the tokens must have moved."""
        canary = self.tasks.get(Job.CANARY)
        if canary is None or now - self.canary_judged_at <= w.canary_timeout + 5:
            return
        if self.metrics_at is None or self.metrics_at <= self.canary_judged_at:
            # No progress sample since the window opened (polls may be poll_interval apart):
            # flat would mean stale, not hung.  A poll now; judged when its answer is in.
            self.serving.ask()
            return
        latest = _progress_of(self.last_metrics) if self.last_metrics else None
        if self.canary_base is None:  # nothing to compare with yet: this sample opens a window
            self.canary_base, self.canary_judged_at = latest, now
            return
        stuck = f"canary request stuck for {now - canary.started:.0f}s"
        if canary_counts(False, True, self.canary_base, latest):
            out.fail(ExitVerdict(Cause.CANARY, stuck, True))
            return
        if self.canary_stuck_noted != canary.started:
            self.canary_stuck_noted = canary.started
            self.log.warning("canary_slow", error=stuck, tokens_before=self.canary_base,
                             tokens_after=latest, verdict="tokens moving: busy, not hung")
        self.canary_base, self.canary_judged_at = latest, now

    def poll_in_flight(self, now: float, w: WatchConfig, out: _Verdicts) -> None:
        """A /health answer overdue is a failing probe, dated from when it was sent.

        A stopped API server accepts the connection (the kernel does) and never answers; the
        probe's own result arrives only after its timeouts, so waiting for it would push the
        detection past unhealthy_timeout + one poll.
        """
        poll = self.tasks.get(Job.POLL)
        if poll is None or not isinstance(poll.job, _PollJob):
            return
        health = poll.job.health
        timeout = w.health_timeout
        if health is None and (now - poll.started > timeout
                               or self.serving.unhealthy_since is not None):
            # already failing: the window keeps running while this probe has no answer either
            self.health_failing(now, poll.started, f"no answer within {timeout:g}s", w, out)
            return
        if health is not None and not health.ok and not health.unseen:
            self.health_failing(now, poll.started, health.error, w, out)
            return
        sent = poll.job.metrics_sent
        if health is not None and sent is not None and now - sent > timeout:
            # /health answered, then the server stopped: /metrics is the newer probe
            self.health_failing(now, sent, f"/metrics: no answer within {timeout:g}s", w, out)

    def health_failing(self, now: float, since: float, error: str, w: WatchConfig,
                       out: _Verdicts) -> None:
        """A failing /health probe sent at ``since``: DEGRADED, and a failure once it has
        failed for unhealthy_timeout."""
        if self.serving.failing(since):
            self.log.warning("health_failed", error=error)
        if out.state is State.READY:
            out.move(State.DEGRADED, f"/health: {error}")
        failed_for = self.serving.failed_for(now)
        if failed_for >= w.unhealthy_timeout:
            out.fail(ExitVerdict(Cause.UNHEALTHY, f"/health failing for {failed_for:.0f}s: "
                                                  f"{error}", True))

    def on_poll(self, now: float, res: tuple[HealthResult, MetricsResult], started: float,
                state: State, w: WatchConfig, stranger: str | None,
                front: FrontSample | None = None) -> list[Verdict]:
        """A /health + /metrics answer (``stranger``: who answered on vLLM's port instead of
        our vLLM, if anyone): the failing-health window, the hang detector, READY/DEGRADED.
        ``front``: the front's counts at this moment, the better witness of work in flight
        (issue 20.5: vLLM's gauges can read 0 on a wedged engine)."""
        out = _Verdicts(state)
        health, metrics = res
        if health.unseen:  # not asked (no file descriptor left): no word on vLLM
            fdlimit.PRESSURE.note("vLLM's /health", health.error)
            return out.out
        if health.ok and stranger is not None:
            health = HealthResult(False, health.status, health.seconds,
                                  f"port answered by {stranger}, not by our vLLM")
        if health.ok and metrics.timed_out:
            # the API server stopped answering between the two requests
            self.health_failing(now, started + health.seconds, f"/metrics: {metrics.error}", w,
                                out)
        elif health.ok:
            if (since := self.serving.recovered()) is not None:
                self.log.info("health_recovered", after=round(now - since, 1))
        else:
            self.health_failing(now, started, health.error, w, out)
        if out.failed:
            return out.out
        stalled = 0.0
        if metrics.ok:
            self.last_metrics, self.metrics_at = metrics, now
            prog = _progress(metrics, front)
            self.serving.hang.set_steps(self.bound_step,
                                        front.longest_gap if front is not None else None)
            hang = self.serving.hang.judge(now, prog)
            stalled = hang.stalled
            if hang.hung:
                self.log.error("hang_detected", stalled_seconds=round(stalled, 1),
                               running=prog.running, waiting=prog.waiting,
                               bound_seconds=round(hang.bound, 2),
                               longest_step_seconds=round(self.bound_step or 0.0, 3),
                               longest_gap_seconds=round(
                                   (front.longest_gap if front is not None else None) or 0.0,
                                   3))
                out.fail(ExitVerdict(Cause.HANG, f"{prog.running:g} running, "
                                                 f"{prog.waiting:g} waiting, no token "
                                                 f"progress for {stalled:.0f}s", True),
                         HangSeen(stalled))
                return out.out
            if out.state is State.READY and hang.stalling:
                out.move(State.DEGRADED, f"no token progress for {stalled:.0f}s")
                return out.out
        if out.state is State.DEGRADED and health.ok and not metrics.timed_out \
                and stalled == 0:
            out.move(State.READY, "healthy again")
        return out.out

    def on_canary(self, res: tuple[MetricsResult, CompletionResult, MetricsResult]
                  ) -> ExitVerdict | None:
        before, result, after = res
        if result.ok:
            self.log.debug("canary_ok", ms=round(result.seconds * 1000, 1))
            return None
        if result.unseen:  # not sent (no file descriptor left): no word on vLLM
            fdlimit.PRESSURE.note("vLLM's canary", result.error)
            return None
        b = _progress_of(before) if before.ok else None
        a = _progress_of(after) if after.ok else None
        if not canary_counts(result.ok, result.timed_out, b, a):
            self.log.warning("canary_slow", error=result.error, tokens_before=b, tokens_after=a,
                             running=after.get(RUNNING), waiting=after.get(WAITING),
                             verdict="tokens moving: busy, not hung")
            return None
        self.log.error("canary_failed", error=result.error, tokens_before=b, tokens_after=a)
        return ExitVerdict(Cause.CANARY, f"canary: {result.error}", True)

    # --- the exit --------------------------------------------------------------------------

    def exited(self) -> int | None:
        """vLLM's own exit code, once (None while it runs): noted with the kernel's word."""
        rc = self.child.poll()
        if rc is None:
            return None
        self.exit_rc = rc
        self.exit_oom = self.child.oom_evidence() if rc == -signal.SIGKILL else None
        return rc

    def exit_verdict(self, tail: list[str] | None = None) -> ExitVerdict:
        """The exit judged from vLLM's last lines (``tail``: the full tail, once in)."""
        assert self.exit_rc is not None
        return classify_exit(self.exit_rc, self.child.tail_lines() if tail is None else tail,
                             oom_evidence=self.exit_oom)

    def final_verdict(self, failure: ExitVerdict, tail: list[str],
                      judge: Callable[[ExitVerdict], ExitVerdict]) -> ExitVerdict:
        """``failure`` judged again from vLLM's full last lines (``judge``: the port guard's
        word on a held port)."""
        if self.exit_rc is None and failure.cause is Cause.ENGINE_DEAD:
            final = engine_dead_verdict(tail, failure.detail)
            # the engine's own OOM text came after its death line
            return final if final.cause is Cause.OOM else failure
        # exit_rc is set only by reap, for an exit vLLM chose itself: a child we stopped has
        # none, since reap does not run once we left the child's states.
        if self.exit_rc is None \
                or failure.cause in (Cause.GPU_FATAL, Cause.PORT_HELD, Cause.PREFLIGHT):
            return failure  # judged already (a held port's wait must not be judged twice)
        return judge(self.exit_verdict(tail))

    def tail_decides(self, failure: ExitVerdict | None) -> bool:
        """Can vLLM's last lines still change this verdict (final_verdict)?  Only for an exit
        of its own (classify_exit reads them) and for an engine death (its OOM text may follow
        the death line); a hang, a canary or failing health that we ended stays what it is."""
        return failure is None or self.exit_rc is not None or failure.cause is Cause.ENGINE_DEAD

    def engine_died(self, line: str) -> ExitVerdict:
        """vLLM said its engine died (``line``): the verdict, said in the journal."""
        return self.said_dead(engine_dead_verdict(self.child.tail_lines(), line))

    def said_dead(self, verdict: ExitVerdict) -> ExitVerdict:
        """One journal line for an engine death, whoever saw it first (vLLM's line, /proc)."""
        self.log.warning("engine_died", pid=self.child.pid, cause=verdict.cause.value,
                         detail=verdict.detail)
        return verdict

    # --- stopping the group ----------------------------------------------------------------

    def drain_step(self, now: float, timeout: float, front: FrontSample | None
                   ) -> tuple[str, dict[str, Any]] | None:
        """While draining: take the next look (the front's count, else vLLM's gauges), or say
        the drain is over (its hurry and the fields of its log line)."""
        assert self.drain is not None
        if front is not None:
            # Counted only once the front has stopped taking requests: a request that came in
            # between SIGTERM and the front's drain would otherwise meet a vLLM that is being
            # stopped (seen once behind a balancer: no answer until the daemon exited).
            self.drain.on_clients(front.in_flight if front.draining else max(1, front.in_flight))
        over, busy, expired = self.drain.over(now, self.child.poll() is not None)
        if over:
            sample = self.drain.sample
            fields: dict[str, Any] = {"busy": busy}
            if front is not None:
                fields["in_flight"] = front.in_flight
            else:
                fields.update(running=sample.running if sample else None,
                              waiting=sample.waiting if sample else None)
            self.drain = None
            return ("the drain deadline passed" if busy and expired else ""), fields
        if front is None and self.drain.gauges_due(now, Job.DRAIN_GAUGES in self.tasks):
            self.submit(now, Job.DRAIN_GAUGES, _drain_gauges_job(self.probe, timeout))
        return None

    def abort(self, now: float, term_timeout: float, hung: bool) -> list[int]:
        """The run failed: no more jobs, and its group is stopped; the pids that were in it
        (the GPU must let go of them before the next launch)."""
        self.cancel_tasks()
        self.last_metrics = None
        pids = [self.child.pid, *self.child.group_members()]
        # A hung engine will not shut down politely: no term_timeout wait for it.
        self.begin_kill(now, term_timeout,
                        hurry="hang: the engine makes no progress" if hung else None)
        if self.child.poll() is not None and self.child.group_alive():
            # The API server is gone: what is left of its group (the EngineCore) serves
            # nobody, and vLLM's own shutdown force-kills it too ("Process manager: force
            # killing remaining processes").  Its SIGTERM teardown took 1.3 s of an
            # API-server kill's restart on the H200 (issue 10).
            self.kill_group(now, "the API server is gone; its EngineCore serves nobody")
        return pids

    def start_drain(self, now: float, timeout: float) -> None:
        """SIGTERM while serving: the clients' requests may finish within ``timeout``."""
        self.phase = Phase.STOPPING
        self.drain = Drain(deadline=now + timeout, next_poll=now)

    def begin_kill(self, now: float, term_timeout: float, hurry: str | None = None) -> None:
        """SIGTERM the group; SIGKILL after term_timeout, or after KILL_GRACE with a reason."""
        self.kill = KillSchedule(now, term_timeout, hurry)
        self.phase = Phase.STOPPING
        self.gone_at = None
        # what vLLM says from here on is its shutdown's, which we caused (child.LineRouter)
        self.child.mark_ending(f"qwen4090 stopped this vLLM ({hurry})" if hurry else
                               "qwen4090 stopped this vLLM")
        if self.child.signal_group(signal.SIGTERM):
            # A stopped process (SIGSTOP, a debugger) acts on TERM only once continued.
            self.child.signal_group(signal.SIGCONT)
            self.log.info("group_signalled", signal="SIGTERM", pgid=self.child.pid,
                          hurry=hurry)

    def kill_group(self, now: float, why: str) -> None:
        assert self.kill is not None
        self.log.warning("group_kill", reason=why, pgid=self.child.pid)
        self.child.signal_group(signal.SIGKILL)
        self.kill.killed(now)

    def reap_group(self, now: float) -> bool:
        """True once no process of the group is left (TERM, then KILL)."""
        assert self.kill is not None
        if self.gone_at is not None:
            return True
        rc = self.child.poll()
        if rc is not None and not self.child.group_alive():
            self.gone_at, self.phase = now, Phase.GONE
            self.log.info("group_gone", pid=self.child.pid, code=rc,
                          seconds_after_term=round(now - self.kill.term_sent, 2))
            return True
        if self.kill.killed_at is None:
            why = self.kill.reason(now, lambda: bool(self.child.engine_pids()))
            if why is not None:
                self.kill_group(now, why)
        if self.kill.survived(now):
            self.log.error("group_survives_kill", pids=self.child.group_members())
            self.gone_at, self.phase = now, Phase.GONE
            return True
        return False

    def last_lines_in(self, now: float) -> bool:
        """vLLM's last lines are in (or OUTPUT_WAIT passed): never blocking the loop."""
        assert self.gone_at is not None
        return self.child.output_closed() or now - self.gone_at >= OUTPUT_WAIT


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


def _drain_gauges_job(probe: ProbeLike, timeout: float
                      ) -> Callable[[], tuple[float | None, float | None]]:
    def job() -> tuple[float | None, float | None]:
        m = probe.metrics(timeout)
        return (m.get(RUNNING), m.get(WAITING)) if m.ok else (None, None)
    return job


def _progress(m: MetricsResult, front: FrontSample | None) -> Progress:
    """The engine's work: vLLM's gauges and token counters, and with the front the requests
    it has at the engine (running) and the answer bytes it has seen (progress too)."""
    running, waiting, tokens = m.get(RUNNING), m.get(WAITING), _progress_of(m)
    if front is None:
        return Progress(running, waiting, tokens, engine_running=running,
                        answered_in=m.seconds)
    return Progress(max(running, front.in_flight - front.holding), waiting,
                    tokens + front.bytes_from_engine, front.last_byte_at,
                    engine_running=max(running, front.at_engine), answered_in=m.seconds)


def _quiet_since(front: FrontSample | None, now: float) -> float | None:
    """Since when the front, with requests at the engine, has relayed no answer byte (None:
    no front, or nothing at the engine)."""
    if front is None or front.in_flight - front.holding <= 0:
        return None
    if front.last_byte_at is not None:
        return front.last_byte_at
    return now - front.oldest_unanswered


def _busy(m: MetricsResult) -> bool:
    return m.get(RUNNING) + m.get(WAITING) > 0


def _progress_of(m: MetricsResult) -> float:
    """The engine's progress counter in one /metrics answer (vllmfacts says which metrics)."""
    return vllmfacts.progress_counter(m.values)
