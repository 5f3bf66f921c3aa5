"""The failure being handled and the restart that follows it (issue 29.3): the crash-loop
budget and its backoff (policy.CrashLoop), the verdict judged again from vLLM's last lines,
the OOM ladder's step down, and when the next start is due.  It never changes the daemon's
state: the supervisor asks and acts (a give-up, a takeover, a start)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from qwen4090.base.events import Event, Restarted, SteppedDown
from qwen4090.base.redact import safe_error
from qwen4090.decide.policy import (
    EX_CONFIG,
    EX_GPU,
    EX_TEMPFAIL,
    Cause,
    CrashLoop,
    ExitVerdict,
    GiveUp,
    backoff_delay,
)
from qwen4090.launching.launchvalue import Launch
from qwen4090.parts.contracts import GpuLike, LogLike, Parts
from qwen4090.running.engines import Engines
from qwen4090.running.portguard import PortGuard
from qwen4090.running.run import Run
from qwen4090.running.standby import Keeper, Step
from qwen4090.running.takeover import Takeover
from qwen4090.settings.config import Config, RestartConfig


class Restarts:
    def __init__(self, cfg: RestartConfig, log: LogLike, emit: Callable[[Event], None]) -> None:
        self.log = log
        self.emit = emit
        self.crashes = CrashLoop(cfg)  # restarts, history, budget, backoff
        self.failure: ExitVerdict | None = None
        self.restart_at: float | None = None
        self.ready_since: float | None = None  # the serving run's READY (None: not yet)
        self.served = False  # the failing run had been READY

    # --- the start, serving, and for how long -----------------------------------------------

    def started(self) -> None:
        """A new engine was spawned: the failure is behind, and it has not served yet."""
        self.failure = None
        self.ready_since = None

    def ready(self, now: float) -> None:
        self.ready_since = now

    def restart_now(self, now: float) -> None:
        """The next start is due at once (a fallen-back takeover, a standby lost before its
        wake: the failure was counted already)."""
        self.restart_at = now

    def due(self, now: float) -> bool:
        """The next start is due (the backoff is over); ``begun`` takes it."""
        return self.restart_at is not None and now >= self.restart_at

    def begun(self) -> None:
        self.restart_at = None

    def fatal_gpu(self, verdict: ExitVerdict, group_gone: bool) -> None:
        """A fatal Xid while no run is in its states: the group still going gives up once
        gone (after_child_gone); with none, no restart is due."""
        self.failure = verdict
        if group_gone:
            self.restart_at = None

    def served_stably(self, now: float, serving: bool, cfg: Config) -> bool:
        """The run has been serving for restart.stable_after."""
        return serving and self.ready_since is not None \
            and now - self.ready_since >= cfg.restart.stable_after

    def note_stable(self, now: float, serving: bool, cfg: Config) -> None:
        """A run READY for restart.stable_after starts the backoff over."""
        if self.crashes.consecutive and self.served_stably(now, serving, cfg) \
                and self.crashes.stable():
            assert self.ready_since is not None
            self.log.info("stable", seconds=round(now - self.ready_since), backoff_reset=True)

    def failed(self, now: float, verdict: ExitVerdict, serving: bool, cfg: Config) -> None:
        # A failure found in this step's harvest comes before step_ready's own check.
        self.note_stable(now, serving, cfg)
        # A run that served is restarted at once (issue 30.5; issue 10.2 did so only after
        # restart.stable_after): the front holds its clients through the restart, and a
        # backoff would only lengthen their wait.  The backoff is for an engine that cannot
        # even start (a real crash loop); the budget counts every failure either way.
        self.served = self.ready_since is not None
        self.failure = verdict

    # --- the group is gone --------------------------------------------------------------------

    def reclassify(self, run: Run, tail: list[str],
                   judge: Callable[[ExitVerdict], ExitVerdict]) -> None:
        """The failure judged again now that vLLM's last lines are in (the tail; ``judge``:
        the port guard's word on a held port)."""
        if self.failure is None:
            return
        final = run.final_verdict(self.failure, tail, judge)
        if final != self.failure:
            self.log.warning("exit_classified", cause=final.cause.value, detail=final.detail,
                             was=self.failure.cause.value)
            self.failure = final

    def gone(self, now: float, wall: float, tail: list[str], cfg: Config, gpu: GpuLike,
             launch: Launch) -> GiveUp | bool:
        """The failed group is gone: the failure counted (True when it counts against the
        budget), or the end (not retried; the budget spent).  An OOM steps down first."""
        v = self.failure
        assert v is not None
        counted = self.crashes.record(now, wall, v)
        self.emit(Restarted(v.cause.value, counted))
        if not v.retry:
            return GiveUp(EX_GPU if v.cause == Cause.GPU_FATAL else EX_CONFIG,
                          f"{v.cause.value}: {v.detail}")
        if v.cause == Cause.OOM:
            self.step_down(v, tail, cfg, gpu, launch)
        if counted and (spent := self.crashes.spent(now, cfg.restart, v)) is not None:
            return GiveUp(EX_TEMPFAIL, spent)
        return counted

    def schedule(self, now: float, counted: bool, cfg: Config, rand: random.Random) -> None:
        """The next start: at once after a run that served or an uncounted failure, else
        after the backoff (a start that failed)."""
        v = self.failure
        assert v is not None
        delay = backoff_delay(self.crashes.consecutive, cfg.restart, rand) \
            if counted and not self.served else 0.0
        self.restart_at = now + delay
        self.log.warning("restart_scheduled", cause=v.cause.value, delay=round(delay, 2),
                         served=self.served,
                         restarts=self.crashes.restarts,
                         failures_in_window=self.crashes.budget.count(now),
                         budget=cfg.restart.budget_failures)

    def step_down(self, v: ExitVerdict, tail: list[str], cfg: Config, gpu: GpuLike,
                  launch: Launch) -> None:
        """OOM: one rung down the ladder for the next launch (the GPU part remembers it).  The
        ladder's own settings are the current config's (a reload applies to the next OOM)."""
        if not cfg.gpu.oom_ladder:
            self.log.error("oom_not_stepped_down", cause=v.detail,
                           reason="gpu.oom_ladder is off: the next launch uses the same "
                                  "settings", hint="set gpu.oom_ladder = true, or lower "
                                                   "vllm.max_model_len / max_num_seqs")
            return
        try:
            changes = gpu.step_down(launch, cfg, v, tail)
        except Exception as e:
            self.log.error("oom_step_down_failed", error=safe_error(e, where=True))
            return
        if changes:
            self.log.warning("oom_step_down", changes="; ".join(changes), cause=v.detail)
            self.emit(SteppedDown(tuple(changes)))
        else:
            self.log.error("oom_ladder_exhausted", cause=v.detail,
                           hint="lower vllm.max_model_len / max_num_seqs, or use a smaller "
                                "or quantized model")


@dataclass(frozen=True)
class Relaunch:
    """The backoff is over and the GPU let go of the failed group: PREFLIGHT (``reason``)."""

    reason: str


@dataclass(frozen=True)
class Waking:
    """The standby's row was promoted: the failover's wake and check are under way."""

    pid: int


Outcome = Relaunch | Waking | GiveUp | None


class Restarting:
    """RESTARTING, step by step (issue 29.3): the failed group's end (TERM, then KILL; its
    last lines, judged again), the takeover's wait for the GPU and the standby's wake, the
    budget and the backoff, then the next start.  It decides and acts on the table, the keeper
    and the takeover, and returns what the supervisor must do with the daemon's state: a
    Relaunch (PREFLIGHT), Waking (the failover goes on), GiveUp, or nothing yet."""

    def __init__(self, restarts: Restarts, engines: Engines, takeover: Takeover, keeper: Keeper,
                 port: PortGuard, parts: Parts) -> None:
        self.r = restarts
        self.engines = engines
        self.takeover = takeover
        self.keeper = keeper
        self.port = port
        self.p = parts

    def step(self, now: float, cfg: Config, launch: Launch) -> Outcome:
        run, t, r = self.engines.serving, self.takeover, self.r
        if t.waking:  # the standby is taking over: its answers are harvested
            t.overdue(now, cfg)
            return None
        if run is not None:
            return self._group(now, run, cfg, launch)
        if t.at(Step.GPU):
            # an asleep standby wakes into the memory the failed group held: once it is
            # released, or as soon as there is room for the standby anyway
            if not self.engines.room_for_standby(now, self.p.gpu) \
                    and not self.gpu_released(now, cfg, launch):
                return None
            if t.wake(now):
                promoted = self.engines.serving
                assert promoted is not None
                return Waking(promoted.child.pid)
            r.restart_now(now)  # it failed while the GPU let go: the normal restart
            return None
        if r.due(now) and self.gpu_released(now, cfg, launch):
            r.begun()
            return Relaunch(f"restart {r.crashes.restarts}")
        return None

    def _group(self, now: float, run: Run, cfg: Config, launch: Launch) -> Outcome:
        """The failed group: gone, and its last lines in (never blocking the loop)."""
        t, r = self.takeover, self.r
        if not run.reap_group(now):
            return None
        if not run.last_lines_in(now) and not (t.at(Step.KILL)
                                               and not run.tail_decides(r.failure)):
            # a takeover does not wait for lines that cannot change it (a hang we ended: on
            # the H200 the wait took 2 s of the failover, up to OUTPUT_WAIT)
            return None
        if t.at(Step.FALL_BACK):  # now a normal restart
            t.end()
            self.engines.drop(run, now)
            r.restart_now(now)
            r.log.warning("restart_scheduled", cause="failover_failed", delay=0.0,
                          restarts=r.crashes.restarts)
            return None
        tail = run.child.tail_lines()
        r.reclassify(run, tail, lambda v: self.port.judge(now, cfg.restart.port_wait, v))
        self.engines.drop(run, now)
        return self.gone(now, tail, cfg, launch)

    def gone(self, now: float, tail: list[str], cfg: Config, launch: Launch) -> Outcome:
        """The failed group is gone (or there was none): the end, the takeover, or the
        restart after its backoff (the standby, with the old settings, is discarded)."""
        r = self.r
        counted = r.gone(now, self.p.wall(), tail, cfg, self.p.gpu, launch)
        v = r.failure
        assert v is not None
        # the tail may have changed the verdict (an OOM is not taken over: the ladder's)
        if isinstance(counted, GiveUp) or not self.keeper.takes_over(v, True):
            self.takeover.end()
        if isinstance(counted, GiveUp):
            return counted
        if self.takeover.current is not None:
            self.takeover.group_gone(now)
            return None
        if self.keeper.run is not None:
            self.keeper.discard(now, f"a restart after {v.cause.value}", cfg.stop.term_timeout)
        r.schedule(now, counted, cfg, self.p.rand)
        return None

    def gpu_released(self, now: float, cfg: Config, launch: Launch) -> bool:
        """Before a relaunch: the stopped groups' GPU memory is free (engines.py)."""
        return self.engines.gpu_released(now, self.p.gpu, launch.config.gpu.device,
                                         cfg.gpu.release_timeout)
