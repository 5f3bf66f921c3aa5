"""The takeover (issue 21; issue 29.3): the serving engine failed while a standby was ready.

One failover at a time, as one typed machine (standby.Failover: kill -> wait for the GPU ->
wake -> check -> served | fall back).  :class:`Takeover` drives it against the table of
engines (engines.py) and the standby's keeper; the supervisor keeps the daemon's state
(RESTARTING until the standby serves) and acts on what each step returns: the run that serves
now, or the word that the normal restart is next.
"""

from __future__ import annotations

from collections.abc import Callable

from qwen4090.base.events import Event, StandbyWoken
from qwen4090.decide.results import CompletionResult, HealthResult
from qwen4090.parts.contracts import LogLike
from qwen4090.running.engines import Engines
from qwen4090.running.run import Job, Run
from qwen4090.running.standby import Failover, Keeper, Step, check_job, control_job
from qwen4090.settings.config import Config


class Takeover:
    def __init__(self, engines: Engines, keeper: Keeper, log: LogLike,
                 emit: Callable[[Event], None]) -> None:
        self.engines = engines
        self.keeper = keeper
        self.log = log
        self.emit = emit
        self.current: Failover | None = None  # RESTARTING's sub-state while one is under way

    def at(self, step: Step) -> bool:
        return self.current is not None and self.current.step is step

    @property
    def waking(self) -> bool:
        """The standby is being woken and checked (STATUS= says so)."""
        return self.current is not None and self.current.waking

    def begin(self, now: float, cause: str) -> None:
        """The failed group is killed (a polite stop would only delay the standby)."""
        self.current = Failover(cause, now, since=now)

    def end(self) -> None:
        """No takeover (a stop, or the failure turned out to be one the standby does not
        take: an OOM judged from vLLM's last lines)."""
        self.current = None

    def group_gone(self, now: float) -> None:
        """The failed group is gone: next, the GPU's memory (or room for the standby)."""
        assert self.current is not None
        self.current.to(Step.GPU, now)

    def overdue(self, now: float, cfg: Config) -> None:
        """The wake and the check are bounded together: past the bound, the fall back."""
        f = self.current
        if f is not None and (why := f.overdue(now, cfg.restart.wake_timeout)):
            self.failed(now, why, cfg)

    def wake(self, now: float) -> bool:
        """The GPU let go (or has room): the standby's row becomes the serving one and is
        woken (asleep) or checked (awake).  False: the standby was lost while the GPU let go;
        the normal restart is next."""
        f = self.current
        assert f is not None
        if not self.keeper.ready:
            self.current = None
            self.log.warning("failover_failed", reason="the standby was lost before its wake",
                             fallback="the normal restart")
            return False
        run = self.keeper.promote(now, f)  # its row serves now
        self.log.info("failover_started", cause=f.cause, pid=run.child.pid,
                      port=run.launch.engine.port, asleep=self.keeper.sleeps)
        timeout = run.config.restart.wake_timeout
        if self.keeper.sleeps:
            f.to(Step.WAKE, now)
            run.submit(now, Job.FAILOVER_WAKE, control_job(run.probe, "/wake_up", timeout))
        else:  # awake: nothing to wake
            f.awake(now)
            self._check(now, f, run, timeout)
            self.emit(StandbyWoken(0.0))
        return True

    def _check(self, now: float, f: Failover, run: Run, timeout: float) -> None:
        """Its known answer is asked for (the one place: awake, or once woken)."""
        if f.step is not Step.CHECK:
            f.to(Step.CHECK, now)
        run.submit(now, Job.FAILOVER_CHECK, check_job(run.probe, timeout))

    def on_wake(self, now: float, run: Run, res: HealthResult, started: float,
                cfg: Config) -> None:
        f = self.current
        if f is None or f.step is not Step.WAKE:
            return
        if why := f.on_wake(now, res):
            self.failed(now, why, cfg)
            return
        self.emit(StandbyWoken(now - started))
        self._check(now, f, run, cfg.restart.wake_timeout)

    def on_check(self, now: float, run: Run, res: CompletionResult, cfg: Config) -> bool:
        """The promoted standby's known answer: True when it serves now."""
        f = self.current
        if f is None or f.step is not Step.CHECK:
            return False
        if why := f.on_check(res):
            self.failed(now, why, cfg)
            return False
        self.current = None
        self.keeper.failover_done(now, f)
        self.log.info("failover_done", cause=f.cause, pid=run.child.pid,
                      port=run.launch.engine.port,
                      seconds=round(f.seconds, 3) if f.seconds is not None else None,
                      wake_seconds=f.as_json()["wake_seconds"], kv_tokens=f.kv_tokens)
        return True

    def failed(self, now: float, why: str, cfg: Config) -> None:
        """A wake that failed, hung or answered wrong: the promoted standby is stopped, then
        the normal restart (issue 21.5; the supervisor's step_restarting)."""
        f, run = self.current, self.engines.serving
        assert f is not None and run is not None
        self.log.error("failover_failed", reason=why, pid=run.child.pid,
                       fallback="the normal restart")
        f.to(Step.FALL_BACK, now)
        self.keeper.failover_done(now, f, why)
        self.engines.stop(run, now, cfg.stop.term_timeout, hung=True)
        run.kill_group(now, "the standby did not take over")
