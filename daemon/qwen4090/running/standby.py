"""The standby engine (issue 21): a second vLLM of the same model that takes over in a blip.

``restart.standby = "sleep"``: the standby is started in full (weights, KV cache, compiled
graphs), gives its known answer (a greedy completion: the same weights give the same text),
and is put to sleep at level 1 (vLLM's sleep mode: the weights wait in pinned host memory,
about 1 GiB stays on the GPU).  On one GPU an engine can size its KV cache only while the
memory is free, so the serving engine sleeps while a standby starts (the supervisor's
REBUILDING state; the front holds requests meanwhile).  ``"awake"`` keeps a full second engine
beside the serving one (twice the memory: CPU vLLM, the tests), with no sleeping at all.

On a crash or a hang of the serving engine, the supervisor kills the failed group, wakes the
standby, checks its known answer and points the front at it: READY again in about a second.
Not for an OOM (the same settings would fail again: the ladder's) or a reload (new settings).

The :class:`Keeper` owns the standby's slot (its row of the table of engines, engines.py: the
Run with the standby role, its jobs and its phase) and the build, which needs the serving
engine's sleep and wake; it never changes the daemon's state: it asks the supervisor
(:class:`Ask`), which owns it.  Its decisions about time are pure
(``due``, ``quiet``) and its clock is the supervisor's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwen4090.base.redact import safe_error
from qwen4090.base.states import State
from qwen4090.decide.policy import Cause, ExitVerdict
from qwen4090.decide.results import CompletionResult, FrontSample, HealthResult, Patient, ProbeLike
from qwen4090.launching.launchvalue import Endpoint, Launch
from qwen4090.parts.contracts import ChildLike, LogLike
from qwen4090.running.engines import Engines
from qwen4090.running.run import Fail, Job, Role, Run
from qwen4090.settings.config import Config

# The known answer: a greedy completion of these token ids (ids < 1000 exist in every
# vocabulary we serve), long enough that a broken wake cannot give it by chance.
CHECK_PROMPT = (785, 11, 330, 4, 42, 17)
CHECK_TOKENS = 8
SLEEP_LEVEL = 1  # the weights to host memory, the KV cache dropped: the wake is a copy back
# Faults the standby takes over from.  Not OOM (the same settings fail again: the ladder),
# not a reload (new settings), nor anything of a start (a standby is built after READY).
TAKES_OVER = frozenset({Cause.CRASH, Cause.SIGNAL, Cause.EXIT_0, Cause.HANG, Cause.CANARY,
                        Cause.UNHEALTHY, Cause.ENGINE_DEAD})
REBUILD_BACKOFF = (30.0, 60.0, 120.0, 300.0)  # seconds before the next try after a failed build
# The first sleep pins the weights in host memory: 18 s for 15.9 GiB on the H200 (issue 21).
SLEEP_TIMEOUT = 300.0


class Phase(enum.Enum):
    NONE = "none"  # off
    WAITING = "waiting"  # due once the engine is quiet (or after a failed build's backoff)
    STARTING = "starting"  # spawned (sleep mode: the serving engine sleeps meanwhile)
    LOADING = "loading"
    CHECKING = "checking"  # its known answer
    SLEEPING = "sleeping"  # the sleep request in flight
    READY = "ready"  # can take over
    WAKING = "waking"  # taking over (the failover)


# What the build does to the serving engine (sleep mode only), in order.
SERVING_STEPS = ("reference", "sleep", "standby", "wake", "check")


@dataclass(frozen=True)
class Ask:
    """What the keeper asks of the supervisor: ``hold`` (READY -> REBUILDING), ``resume``
    (REBUILDING -> READY) or ``fail`` (the serving engine did not come back: ``verdict``)."""

    what: str
    reason: str
    verdict: ExitVerdict | None = None


class Step(enum.Enum):
    """Where a takeover is: one value, not four flags (issue 29.3)."""

    KILL = "kill"  # the failed group is killed (a polite stop would only delay the standby)
    GPU = "gpu"  # it is gone: an asleep standby waits for its GPU memory, or for room
    WAKE = "wake"  # the standby's /wake_up is in flight (sleep mode)
    CHECK = "check"  # its known answer is asked for
    FALL_BACK = "fall_back"  # it did not take over: its group is stopped, then a normal restart


# The takeover's only moves; anything else is a bug (as states.ALLOWED for the daemon).
STEPS_NEXT: dict[Step, frozenset[Step]] = {
    Step.KILL: frozenset({Step.GPU}),
    Step.GPU: frozenset({Step.WAKE, Step.CHECK}),
    Step.WAKE: frozenset({Step.CHECK, Step.FALL_BACK}),
    Step.CHECK: frozenset({Step.FALL_BACK}),
    Step.FALL_BACK: frozenset(),
}


@dataclass
class Failover:
    """One takeover, from the fault seen to serving again (or to the normal restart): the
    supervisor holds the one in progress (its sub-state of RESTARTING), the keeper the last
    one's figures.  Its decisions are pure: each returns why it failed ("" when it did not)."""

    cause: str
    started: float
    step: Step = Step.KILL
    since: float = 0.0  # when the step began
    promoted: float | None = None  # the standby's run became the serving one
    woken: float | None = None
    ok: bool = False
    seconds: float | None = None
    kv_tokens: int | None = None
    answer: str | None = None  # the promoted standby's known answer, taken before it slept

    def to(self, step: Step, now: float) -> None:
        if step not in STEPS_NEXT[self.step]:
            raise ValueError(f"failover step {self.step.value} -> {step.value} is not allowed")
        self.step, self.since = step, now

    @property
    def waking(self) -> bool:
        """The standby is being woken and checked (STATUS= says so)."""
        return self.step in (Step.WAKE, Step.CHECK)

    def overdue(self, now: float, wake_timeout: float) -> str:
        """The wake and the check are bounded together, from the promotion."""
        limit = 2 * wake_timeout + 5
        if self.waking and self.promoted is not None and now - self.promoted > limit:
            return f"no wake and check within {limit:g}s"
        return ""

    def promoted_at(self, now: float, kv_tokens: int | None, answer: str | None) -> None:
        """The standby's row serves now: its KV size and its known answer come with it."""
        self.promoted, self.kv_tokens, self.answer = now, kv_tokens, answer

    def awake(self, now: float) -> None:
        """An awake standby has nothing to wake: its check is next."""
        self.woken = now

    def on_wake(self, now: float, res: HealthResult) -> str:
        if not res.ok:
            return f"the wake failed: {res.error}"
        self.woken = now
        self.to(Step.CHECK, now)
        return ""

    def on_check(self, res: CompletionResult) -> str:
        why = answered(res, self.answer)
        return f"its check: {why}" if why else ""

    def ended(self, now: float, ok: bool) -> None:
        self.ok = ok
        self.seconds = now - self.started

    def as_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "ok": self.ok,
                "seconds": None if self.seconds is None else round(self.seconds, 3),
                "wake_seconds": None if self.woken is None else round(self.woken - self.started,
                                                                      3),
                "kv_tokens": self.kv_tokens}


@dataclass
class Build:
    """One build of a standby; in sleep mode with the serving engine's sleep around it."""

    started: float
    step: str = "standby"  # sleep mode: SERVING_STEPS; awake: "standby" only
    step_since: float = 0.0
    serving_answer: str | None = None
    outcome: str = ""  # why the standby did not get READY ("" while it goes on or when it did)


@dataclass
class Keeper:
    """The standby and its build (see the module's text)."""

    mode: str
    log: LogLike
    spawn: Callable[[Launch], ChildLike]
    make_probe: Callable[[Launch], ProbeLike]
    submit: Callable[[Callable[[], Any]], Any]
    clock: Callable[[], float]
    engines: Engines
    # the GPU part's resolver: a config's launch on the engine endpoint other than the one
    # given (the serving engine's), with its fixed KV budget
    launch_for: Callable[[Config, Endpoint | None], Launch]
    phase: Phase = Phase.NONE
    since: float = 0.0
    answer: str | None = None  # its known answer, taken before it slept
    kv_tokens: int | None = None
    build: Build | None = None
    quiet_since: float | None = None
    next_try: float = 0.0
    failed_builds: int = 0
    failovers: int = 0
    fallbacks: int = 0
    rebuilds: int = 0
    interruptions: int = 0  # builds a client's request ended (issue 30.4), in all
    interrupted_in_a_row: int = 0  # ... since the last standby ready: the next try's backoff
    clients_waiting: int = 0  # the front's held requests at this step (note_quiet)
    last_failover: Failover | None = None
    detail: str = ""
    configured: str = "off"  # restart.standby as configured (the mode: as the launch resolved it)
    why: str = ""  # why "auto" resolved to the mode ("" when not auto)

    def __post_init__(self) -> None:
        if self.on:
            self.phase = Phase.WAITING

    @property
    def run(self) -> Run | None:
        """The standby's row of the table, while it has one."""
        return self.engines.standby

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def sleeps(self) -> bool:
        return self.mode == "sleep"

    @property
    def ready(self) -> bool:
        return self.run is not None and self.phase is Phase.READY

    def set_mode(self, mode: str, now: float) -> None:
        if mode != self.mode:
            self.mode = mode
            self.phase = Phase.WAITING if mode != "off" else Phase.NONE
            self.since = now

    def follow(self, launch: Launch, now: float, term_timeout: float) -> None:
        """The mode of the serving engine's launch, where restart.standby is resolved ("auto"
        is "sleep" or "off" there): a standby of another mode is discarded."""
        self.configured, self.why = launch.standby_configured, launch.standby_why
        mode = launch.standby if launch.config.front.enabled else "off"
        if mode != self.mode:
            self.discard(now, f"restart.standby = {mode!r} now"
                         + (f" (auto: {self.why})" if self.why else ""), term_timeout)
            self.set_mode(mode, now)

    # --- the daemon's side ------------------------------------------------------------------

    def takes_over(self, verdict: ExitVerdict, serving: bool) -> bool:
        """Would the standby take over this failure of a serving engine?"""
        return serving and self.ready and verdict.retry and verdict.cause in TAKES_OVER

    def promote(self, now: float, f: Failover) -> Run:
        """The failover: the standby's row becomes the serving one, with its known answer and
        KV size handed to the takeover (takeover.py sends its wake or its check)."""
        run = self.run
        assert run is not None and self.phase is Phase.READY
        self.engines.promote(run)
        run.warming()
        f.promoted_at(now, self.kv_tokens, self.answer)
        self.phase, self.since = Phase.WAKING, now
        self.answer = None
        return run

    def failover_done(self, now: float, f: Failover, why: str = "") -> None:
        """The takeover ended: served (``why`` empty), or fell back (why)."""
        f.ended(now, not why)
        self.last_failover = f
        if not why:
            self.failovers += 1
        else:
            self.fallbacks += 1
            self.detail = f"last failover failed: {why}"
        self.phase, self.since = Phase.WAITING, now
        self.quiet_since = None
        self.next_try = now

    def serving_failed(self, now: float, term_timeout: float) -> None:
        """The serving engine failed: a build ends with the engine it slept for, and a standby
        not ready yet is discarded (its settings are the failed run's)."""
        self.build = None
        if self.run is not None and not self.ready:
            self.discard(now, "the serving engine failed during the standby's build",
                         term_timeout)

    def discard(self, now: float, why: str, term_timeout: float) -> None:
        """Stop the standby (and any build): its row retires (the GPU must let go of it)."""
        run = self.run
        self.build = None
        self.answer = None
        if self.on:
            self.phase, self.since = Phase.WAITING, now
        if run is not None:
            self.log.warning("standby_discarded", reason=why, pid=run.child.pid)
            self.engines.retire(run, now, term_timeout, "the standby is not needed")

    # --- the build --------------------------------------------------------------------------

    def note_quiet(self, now: float, front: FrontSample | None, serving: bool) -> None:
        """Quiet is counted only while the engine serves READY: the idle seconds of a start
        (loading, warming) are no quiet moment, else the boot's first build began the instant
        READY=1 went out and the first clients, sent on READY, waited out a sleep-mode build
        (50 s under the unit on the H200, 2026-12-03)."""
        busy = front is not None and (front.in_flight > 0 or front.holding > 0)
        self.clients_waiting = front.holding if front is not None else 0
        if busy or not serving:
            self.quiet_since = None
        elif self.quiet_since is None:
            self.quiet_since = now

    def deadlines(self, cfg: Config) -> list[float]:
        """When the standby, the build around it and the standby groups being stopped want the
        loop back (Supervisor.next_wakeup; before, only the serving run was asked, and these
        fell to the loop's idle tick): its load timeout and /health polls, the bound of its
        check or sleep, each build step's bound, each kill schedule, the next try."""
        limit = SLEEP_TIMEOUT + cfg.restart.wake_timeout
        out: list[float] = []
        run = self.run
        if run is not None and self.phase in (Phase.CHECKING, Phase.SLEEPING):
            out.append(self.since + limit)
        b = self.build
        if b is not None:
            out.append(b.step_since + (cfg.stop.drain_timeout if b.step == "drain" else limit))
        elif self.on and run is None:
            out.append(self.next_try)
            if self.quiet_since is not None:
                out.append(self.quiet_since + cfg.restart.standby_quiet)
        return out

    def due(self, now: float, state: State, cfg: Config) -> bool:
        """A build may begin: on, none built or building, serving READY, after the backoff,
        and the engine quiet for restart.standby_quiet."""
        return (self.on and self.run is None and self.build is None
                and state is State.READY and now >= self.next_try
                and self.quiet_since is not None
                and now - self.quiet_since >= cfg.restart.standby_quiet)

    def begin(self, now: float, serving: Run,
              cfg: Config) -> Ask | None:
        """Begin a build: sleep mode holds requests, waits for those in flight, asks the
        serving engine for its known answer and puts it to sleep, then spawns the standby;
        awake mode spawns the standby at once, beside the serving engine."""
        self.build = Build(now, step_since=now)
        self.rebuilds += 1
        self.log.info("standby_rebuild", mode=self.mode, attempt=self.failed_builds + 1,
                      serving_pid=serving.child.pid)
        if not self.sleeps:
            self.build.step = "standby"
            self.start_standby(now, self.launch_for(cfg, serving.launch.engine))
            if self.run is None:
                self.build = None
            return None
        # requests in flight finish first: vLLM's sleep would abort them
        self.build.step = "drain"
        return Ask("hold", "building the standby: the serving engine sleeps meanwhile")

    def start_standby(self, now: float, launch: Launch) -> None:
        """Spawn the standby: the serving engine's settings (and KV budget) on the engine
        endpoint the serving engine does not hold (``launch_for``)."""
        try:
            # the probe first: its key file read may fail too (no file descriptor left), and a
            # spawned child without a Run would be nobody's to stop
            probe = self.make_probe(launch)
            child = self.spawn(launch)
        except Exception as e:  # OSError, ConfigError: the build failed, serving goes on
            self.build_failed(now, f"cannot start the standby: {safe_error(e)}")
            return
        self.engines.add(Run(child, probe, launch, now, launch.config.watch, self.log,
                             self.submit, self.clock, role=Role.STANDBY))
        self.phase, self.since = Phase.STARTING, now
        self.log.info("standby_spawned", pid=child.pid, port=launch.engine.port,
                      argv=" ".join(launch.argv))

    def build_failed(self, now: float, why: str) -> None:
        self.failed_builds += 1
        backoff = REBUILD_BACKOFF[min(self.failed_builds, len(REBUILD_BACKOFF)) - 1]
        self.next_try = now + backoff
        self.detail = why
        self.log.error("standby_failed", reason=why, retry_in=backoff,
                       failed_builds=self.failed_builds)
        if self.build is not None:
            self.build.outcome = why
        self.phase, self.since = Phase.WAITING, now

    def standby_ready(self, now: float) -> None:
        assert self.run is not None
        self.phase, self.since = Phase.READY, now
        self.run.hold()
        self.failed_builds = 0
        self.interrupted_in_a_row = 0
        self.detail = ""
        tokens, _ = self.run.child.kv_cache()
        self.kv_tokens = tokens
        self.log.info("standby_ready", pid=self.run.child.pid, port=self.run.launch.engine.port,
                      asleep=self.sleeps, kv_tokens=tokens,
                      seconds=round(now - self.run.spawned_at, 1))

    def tick(self, now: float, cfg: Config, ports: Any, serving: Run | None,
             front: FrontSample | None, state: State) -> list[Ask]:
        """The supervisor's step for the standby: its own start, the build around it, and a
        build begun when it is due (quiet, READY, after the backoff)."""
        self.note_quiet(now, front, serving=state is State.READY)
        asks = self.step(now, cfg, ports, serving, front)
        if serving is not None and not asks and self.due(now, state, cfg):
            ask = self.begin(now, serving, cfg)
            asks += [ask] if ask is not None else []
        return asks

    def step(self, now: float, cfg: Config, ports: Any, serving: Run | None,
             front: FrontSample | None) -> list[Ask]:
        """One step of the standby and of the build around it; what the supervisor must do."""
        asks: list[Ask] = []
        run = self.run
        if run is not None:  # (its jobs' results come through on_job, its exit on_exit)
            asks += self._watch(now, run, cfg, ports, serving)
        b = self.build
        if b is not None and serving is not None and self.sleeps:
            asks += self._serving_step(now, b, cfg, serving, front)
        return asks

    def engine_died(self, now: float, child: object, line: str, cfg: Config,
                    serving: Run | None) -> list[Ask] | None:
        """vLLM's line that an EngineCore died: the standby's, a loss (None: not its own)."""
        run = self.run
        if run is None or child is not run.child:
            return None
        return self.lost(now, f"its engine died: {line[:200]}", cfg, serving)

    def on_exit(self, now: float, run: Run, rc: int, cfg: Config, serving: Run | None
                ) -> list[Ask]:
        """The standby's group exited on its own (Supervisor.reap)."""
        return self.lost(now, f"the standby exited (code {rc}): {run.exit_verdict().detail}",
                         cfg, serving)

    def _watch(self, now: float, run: Run, cfg: Config, ports: Any, serving: Run | None
               ) -> list[Ask]:
        if self.phase in (Phase.STARTING, Phase.LOADING):
            for v in run.start_step(now, cfg, ports):
                if isinstance(v, Fail):
                    return self.lost(now, v.verdict.detail, cfg, serving)
                self.phase, self.since = Phase.LOADING, now  # the Move: vLLM's first line
        elif self.phase in (Phase.CHECKING, Phase.SLEEPING) \
                and now - self.since > SLEEP_TIMEOUT + cfg.restart.wake_timeout:
            return self.lost(now, f"no answer to its {self.phase.value} within "
                                  f"{SLEEP_TIMEOUT + cfg.restart.wake_timeout:g}s", cfg, serving)
        return []

    def on_job(self, now: float, kind: Job, result: Any, cfg: Config, serving: Run | None
               ) -> list[Ask]:
        """A job of the standby's own run is done (Supervisor.route)."""
        run = self.run
        if run is None:
            return []
        timeout = cfg.restart.wake_timeout
        if kind is Job.HEALTH and self.phase is Phase.LOADING:
            health, owner = result
            # another program's 200 on the standby's port is not the standby's (journaled)
            if health.ok and run.child.poll() is None \
                    and (owner is None or run.stranger(owner) is None):
                self.phase, self.since = Phase.CHECKING, now
                run.warming()
                run.submit(now, Job.CHECK, check_job(run.probe, timeout))
        elif kind is Job.CHECK and self.phase is Phase.CHECKING:
            if (why := answered(result, None)):
                return self.lost(now, f"its check: {why}", cfg, serving)
            self.answer = result.text
            if self.sleeps:
                self.phase, self.since = Phase.SLEEPING, now
                run.submit(now, Job.SLEEP, control_job(run.probe, f"/sleep?level={SLEEP_LEVEL}",
                                                     SLEEP_TIMEOUT))
            else:
                self.standby_ready(now)
                return self._built(now, serving)
        elif kind is Job.SLEEP and self.phase is Phase.SLEEPING:
            if not result.ok:
                return self.lost(now, f"it did not sleep: {result.error}", cfg, serving)
            self.standby_ready(now)
            return self._built(now, serving)
        return []

    def lost(self, now: float, why: str, cfg: Config, serving: Run | None) -> list[Ask]:
        """The standby failed (exited, timed out, answered wrong): stopped; the build goes on
        to wake the serving engine (sleep mode), and is tried again after a backoff."""
        run = self.run
        self.answer = None
        if run is not None:
            self.engines.retire(run, now, cfg.stop.term_timeout, "the standby is not needed")
        self.build_failed(now, why)
        return self._built(now, serving)

    def _built(self, now: float, serving: Run | None) -> list[Ask]:
        """The standby is ready or failed: wake the serving engine (sleep mode), else done."""
        b = self.build
        if b is None:
            return []
        if not self.sleeps or serving is None:
            self.build = None
            return []
        if b.step in ("reference", "drain"):  # it never slept: serving again at once
            self.build = None
            return [Ask("resume", b.outcome or "standby ready")]
        return self._wake_after(now, b, serving)

    def _serving_step(self, now: float, b: Build, cfg: Config, serving: Run,
                      front: FrontSample | None) -> list[Ask]:
        """Sleep mode: the serving engine's part of the build, bounded at each step; a client
        that comes while the serving engine is awake or the standby starts ends the build."""
        waiting = front.holding if front is not None else 0
        if waiting and b.step in ("drain", "reference", "standby"):
            return self._interrupt(now, b, cfg, serving, waiting)
        if b.step == "drain":
            left = 0 if front is None else front.in_flight - front.holding
            if left <= 0:
                b.step, b.step_since = "reference", now
                serving.submit(now, Job.BUILD_REFERENCE,
                               check_job(serving.probe, cfg.restart.wake_timeout))
            elif now - b.step_since > cfg.stop.drain_timeout:
                self.build_failed(now, f"{left} requests still in flight after "
                                       f"stop.drain_timeout ({cfg.stop.drain_timeout:g}s)")
                return self._built(now, serving)
            return []
        limit = SLEEP_TIMEOUT + cfg.restart.wake_timeout
        if b.step in ("reference", "sleep", "wake", "check") and now - b.step_since > limit:
            if b.step in ("wake", "check"):
                self.build = None
                return [Ask("fail", "", ExitVerdict(Cause.UNHEALTHY, f"no {b.step} answer "
                                                    f"within {limit:g}s after the standby's "
                                                    "build", True))]
            self.build_failed(now, f"the serving engine's {b.step}: no answer within "
                                   f"{limit:g}s")
            return self._wake_after(now, b, serving)
        return []

    def _interrupt(self, now: float, b: Build, cfg: Config, serving: Run, waiting: int
                   ) -> list[Ask]:
        """A client's request came during the build (issue 30.4): the build ends and the
        serving engine serves again, at once while it is awake, else after its wake and its
        check (about half a second on the H200, instead of the standby's whole start); the
        standby being started is stopped.  The build is tried again at a later quiet moment,
        later each time it is interrupted again (REBUILD_BACKOFF), and says so: the journal's
        standby_build_interrupted, /status's standby.interruptions."""
        self.interruptions += 1
        self.interrupted_in_a_row += 1
        backoff = REBUILD_BACKOFF[min(self.interrupted_in_a_row, len(REBUILD_BACKOFF)) - 1]
        self.next_try, self.quiet_since = now + backoff, None
        why = f"interrupted: {waiting} requests came during its {b.step} step"
        self.log.warning("standby_build_interrupted", step=b.step, waiting=waiting,
                         retry_in=backoff, interruptions=self.interruptions)
        b.outcome = why
        run, self.answer = self.run, None
        if run is not None:  # the standby being started: not needed now
            self.engines.retire(run, now, cfg.stop.term_timeout, "its build was interrupted")
        self.phase, self.since = Phase.WAITING, now
        if b.step in ("drain", "reference"):  # the serving engine never slept
            self.build = None
            return [Ask("resume", why)]
        return self._wake_after(now, b, serving)

    def _wake_after(self, now: float, b: Build, serving: Run) -> list[Ask]:
        b.step, b.step_since = "wake", now
        serving.submit(now, Job.BUILD_WAKE, control_job(serving.probe, "/wake_up",
                                                        serving.config.restart.wake_timeout))
        return []

    def on_serving_job(self, now: float, kind: Job, result: Any, serving: Run,
                       cfg: Config) -> list[Ask]:
        """The serving engine's answers during a build (sleep mode)."""
        b = self.build
        if b is None:
            return []
        if kind is Job.BUILD_REFERENCE and b.step == "reference":
            if (why := answered(result, None)):
                self.build_failed(now, f"the serving engine's check before it sleeps: {why}")
                return self._built(now, serving)
            b.serving_answer = result.text
            b.step, b.step_since = "sleep", now
            serving.submit(now, Job.BUILD_SLEEP, control_job(
                serving.probe, f"/sleep?level={SLEEP_LEVEL}", SLEEP_TIMEOUT))
        elif kind is Job.BUILD_SLEEP and b.step == "sleep":
            if not result.ok:
                self.build_failed(now, f"the serving engine did not sleep: {result.error}")
                return self._wake_after(now, b, serving)
            if self.clients_waiting:  # came during the sleep: wake it, no standby now
                return self._interrupt(now, b, cfg, serving, self.clients_waiting)
            b.step, b.step_since = "standby", now
            self.start_standby(now, self.launch_for(cfg, serving.launch.engine))
            if self.run is None:  # could not even start
                return self._wake_after(now, b, serving)
        elif kind is Job.BUILD_WAKE and b.step == "wake":
            if not result.ok:
                self.build = None
                return [Ask("fail", "", ExitVerdict(Cause.UNHEALTHY, "the serving engine did "
                                                    f"not wake: {result.error}", True))]
            b.step, b.step_since = "check", now
            serving.submit(now, Job.BUILD_CHECK, check_job(
                serving.probe, serving.config.restart.wake_timeout))
        elif kind is Job.BUILD_CHECK and b.step == "check":
            self.build = None
            if (why := answered(result, b.serving_answer)):
                return [Ask("fail", "", ExitVerdict(Cause.CANARY, "after its sleep for the "
                                                    f"standby's build: {why}", True))]
            return [Ask("resume", b.outcome or "standby ready")]
        return []

    # --- status -----------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        run = self.run
        return {"mode": self.mode, "configured": self.configured, "why": self.why,
                "state": self.phase.value, "ready": self.ready,
                "pid": run.child.pid if run is not None else None,
                "port": run.launch.engine.port if run is not None else None,
                "seconds": round(now - self.since, 1), "kv_tokens": self.kv_tokens,
                "failovers": self.failovers, "fallbacks": self.fallbacks,
                "rebuilds": self.rebuilds, "interruptions": self.interruptions,
                "last_failover": None if self.last_failover is None
                else self.last_failover.as_json(),
                "detail": self.detail}


# Each a verdict when it fails (a lost standby, a serving engine that did not wake): asked
# again while no file descriptor is left to ask with (probes.http.Patient, issue 28.3).
def control_job(probe: ProbeLike, path: str, timeout: float) -> Callable[[], HealthResult]:
    return lambda: Patient(probe).control(path, timeout)


def check_job(probe: ProbeLike, timeout: float) -> Callable[[], CompletionResult]:
    return lambda: Patient(probe).complete(list(CHECK_PROMPT), CHECK_TOKENS, timeout)


def answered(res: CompletionResult, known: str | None) -> str:
    """Why a check answer is not the known one ("" when it is)."""
    if not res.ok:
        return f"no answer: {res.error}"
    if known is not None and res.text != known:
        return f"a different answer ({res.text[:40]!r}, known {known[:40]!r})"
    return ""
