"""The supervisor owns the daemon's state and its loop: it is the only code that changes state.

What belongs to the daemon is here: signals, sd_notify and the watchdog, reloads, the crash-loop
budget and backoff, the GPU's word (a fatal Xid), the exit code.  What belongs to one vLLM
process group is its :class:`run.Run`, built fresh at each spawn; the Run judges (run.py,
judges.py) and the supervisor acts on the verdicts.

The loop is steppable: :meth:`Supervisor.step` takes ``now`` and does one pass of named steps
(signals, the GPU's reports, harvest finished jobs, reap the child, vLLM's word that its
engine died, the current state's step, heartbeat), so unit tests drive it with a fake clock and
fake parts.  Everything that touches processes, HTTP, NVML or systemd comes in through
:class:`contracts.Parts`; blocking work (probes, warmup) runs on an executor and its results
are harvested here, so a slow vLLM never blocks signals or the watchdog.
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from qwen4090.base import fdlimit, states
from qwen4090.base.events import ChildExitSeen, Inbox, Reloaded, Transition
from qwen4090.base.states import State
from qwen4090.base.steering import Drain, Hold, Refuse, Serve
from qwen4090.decide.policy import EX_GPU, EX_OK, NOT_FAILURES, Cause, ExitVerdict
from qwen4090.decide.results import (
    CompletionResult,
    HealthResult,
    MetricsResult,
    PortOwner,
    WarmupResult,
)
from qwen4090.launching import reloading
from qwen4090.launching.launchvalue import engine_endpoint
from qwen4090.parts import statusline
from qwen4090.parts.contracts import ChildLike, Parts, Published
from qwen4090.parts.telling import Teller
from qwen4090.running.engines import Engines
from qwen4090.running.restarts import Outcome, Relaunch, Restarting, Restarts, Waking
from qwen4090.running.run import Job, Move, Ready, Role, Run, Task, Verdict
from qwen4090.running.standby import Ask, Keeper, Step
from qwen4090.running.starter import GiveUp, Started, Starter
from qwen4090.running.takeover import Takeover
from qwen4090.settings.config import Config, changed_sections

S = State

PROGRESS_WINDOW = 120.0  # output or warmup steps within this long count as "making progress"
# The loop's longest sleep with nothing due, and its tick while it waits for something that has
# no deadline (a process to end, the GPU to be released); a signal or a job's result wakes it.
IDLE_TICK = 0.5
WAIT_TICK = 0.2
LAST_LINES_TICK = 0.02  # vLLM's last lines: the pipes end milliseconds after its group
ENGINE_TICK = 0.2  # while serving: how soon a dead EngineCore is seen (a /proc read per look)
# The states in which the serving row holds an engine that serves (asleep for a build too).
ROW_SERVES = (S.READY, S.DEGRADED, S.REBUILDING)
BUILD_JOBS = frozenset({Job.BUILD_REFERENCE, Job.BUILD_SLEEP, Job.BUILD_WAKE, Job.BUILD_CHECK})


class Supervisor:
    def __init__(self, cfg: Config, parts: Parts, signals: deque[int] | None = None) -> None:
        """``signals``: the queue the signal handlers fill (installed before the supervisor
        exists, so what came meanwhile is handled at the first step)."""
        self.cfg = cfg
        self.p = parts
        self.log = parts.log
        now = parts.clock()
        self.state = S.PREFLIGHT
        self.state_since = now
        self.state_reason = "start"
        self.exit_code: int | None = None
        self.engines = Engines(now, parts.log)  # every vLLM process group, a row each
        self.launch = parts.gpu.configured(cfg)  # what the last vLLM ran with, and why
        self.warmup: WarmupResult | None = None
        self.inbox = Inbox(signals if signals is not None else deque())  # other threads'
        self.moved = False  # the last step changed the state: the next one is due at once
        self.tell = Teller(parts.notifier, parts.listeners, self.log)  # systemd, listeners
        self.restarts = Restarts(cfg.restart, self.log, self.tell.emit)  # budget, backoff
        self.starter = Starter(parts, self.log)  # the preflight, the port's wait, the spawn
        # the standby engine and its builds (issue 21; standby.py)
        # (its mode is the serving launch's: restart.standby = "auto" is resolved there, and a
        # standby is resolved on the host facts of the engine it stands by)
        self.keeper = Keeper("off", self.log, parts.spawn, parts.make_probe,
                             lambda fn: self.p.executor.submit(fn), parts.clock, self.engines,
                             lambda c, e: self.p.gpu.launch(c, e, self.launch.host), since=now)
        self.keeper.follow(self.launch, now, cfg.stop.term_timeout)
        # the takeover of the failure being handled (RESTARTING's sub-state; takeover.py)
        self.takeover = Takeover(self.engines, self.keeper, self.log, self.tell.emit)
        self.restarting = Restarting(self.restarts, self.engines, self.takeover, self.keeper,
                                     self.starter.port, parts)
        self.published = Published({}, cfg, None, now)
        self.step_safely(now, self.publish)

    # --- public surface ------------------------------------------------------------------

    @property
    def run(self) -> Run | None:
        """The serving row's run: from its spawn until its group is gone and its end judged."""
        return self.engines.serving

    @property
    def child(self) -> ChildLike | None:
        return self.run.child if self.run is not None else None

    @property
    def done(self) -> bool:
        return self.state in states.FINAL_STATES

    def next_wakeup(self, now: float) -> float:
        """Seconds the loop may sleep: the earliest deadline of the daemon, of every row and of
        the standby's build (the step after a transition runs at once; a job's result and a
        signal wake the loop themselves)."""
        if self.moved:
            return 0.0
        run = self.run
        waits_gpu = self.takeover.at(Step.GPU)
        if self.state is S.RESTARTING and ((run is not None and run.gone_at is not None)
                                           or waits_gpu):
            return LAST_LINES_TICK  # (a failover waits for the GPU to let go: not a tick)
        waits = [IDLE_TICK]
        if self.state in (S.RESTARTING, S.STOPPING, S.STARTING, S.LOADING):
            waits.append(WAIT_TICK)
        if self.state in states.SERVING_STATES:
            waits.append(ENGINE_TICK)  # a dead EngineCore is seen within it (Run.watch)
        # the daemon's own deadlines, then every row's (engines.py: a passed one is due now
        # only for the serving row's poll while it serves)
        waits += [t - now for t in (self.restarts.restart_at, self.starter.look_again_at)
                  if t is not None and t > now]
        waits += self.engines.waits(now, self.cfg.watch, self.state in states.SERVING_STATES)
        # the standby's build: only what is still ahead (a passed next try or quiet time waits
        # for the state or the clients, not for the clock)
        waits += [d - now for d in self.keeper.deadlines(self.cfg) if d > now]
        return max(0.0, min(waits))

    def step(self, now: float | None = None) -> None:
        now = self.p.clock() if now is None else now
        before = self.state
        for part in (self.handle_signals, self.handle_reports, self.harvest, self.reap,
                     self.handle_engine_deaths, self.step_standby, self.step_state,
                     self.heartbeat):
            self.step_safely(now, part)
        self.moved = self.state is not before
        self.step_safely(now, self.publish)  # (the front's sample may find no fd: the last stays)

    def step_state(self, now: float) -> None:
        getattr(self, f"step_{self.state.value}")(now)

    def step_safely(self, now: float, part: Callable[[float], None]) -> None:
        """One named step.  One that found no file descriptor to look with (the front's
        clients hold them all) is left for the next step, said once per burst: never the
        loop's end (cli's internal_error, exit 70), and the heartbeat still beats.  The looks
        themselves say "cannot tell" (child.py, instance.py, preflight.py); this is the net
        under them."""
        try:
            part(now)
        except Exception as e:
            if not fdlimit.exhausted(e):
                raise
            fdlimit.PRESSURE.note(f"the loop's {part.__name__} ({self.state.value})", e)

    def publish(self, now: float) -> None:
        """What the status endpoint shows from now on (one attribute write: its threads read
        either this one or the one before, whole)."""
        metrics = self.run.last_metrics if self.run is not None else None  # (/status's gauges)
        self.published = Published(self.snapshot(), self.cfg, metrics, now)

    def snapshot(self) -> dict[str, Any]:
        """Facts for status output (JSON-friendly): /status, `qwen4090 status`, the page."""
        now = self.p.clock()
        snap = statusline.snapshot(self.facts(now),
                                   [asdict(r) for r in self.restarts.crashes.history],
                                   self.tell.last_status)
        snap["standby"] = self.keeper.status(now)
        snap["engines"] = self.engines.phases()  # the table: every row's role, phase, pid
        snap["hang"] = self.run.hang_doc() if self.run is not None else None
        return snap

    # --- loop steps ------------------------------------------------------------------------

    def handle_signals(self, now: float) -> None:
        while self.inbox.signals:
            signum = self.inbox.signals.popleft()
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.handle_stop(now, signal.Signals(signum).name)
            elif signum == signal.SIGHUP:
                self.handle_reload(now)

    def handle_stop(self, now: float, why: str) -> None:
        if self.done:
            return
        if self.state == S.STOPPING:
            self.engines.skip_drain(now, self.cfg.stop, f"second {why}")
            return
        serving = self.state in states.SERVING_STATES
        self.tell.stopping(f"stopping: {why}")
        self.transition(now, S.STOPPING, why)
        self.p.front.command(Drain())
        self.takeover.end()
        self.keeper.discard(now, f"stopping: {why}", self.cfg.stop.term_timeout)
        self.engines.begin_stop(now, self.cfg.stop, serving)

    def handle_reload(self, now: float) -> None:
        """SIGHUP: read the config again; a broken one is refused and the old one stays.
        Changed ``[vllm]`` settings restart vLLM (controlled, not counted), the rest applies live
        (cli.reload_fanout redoes logging, the GPU watch and the status endpoint).  Once READY,
        RELOADING=1 ... READY=1 (also when refused); before it, neither (docs/architecture.md).
        """
        if self.done or self.state == S.STOPPING:
            return
        announce = self.tell.reloading()
        new, refused = reloading.read(self.p.load_config, self.cfg, self.log.error)
        if new is None:
            if announce:
                self.tell.reloaded(self.status_line(now, note=refused))
            return
        changed = changed_sections(self.cfg, new)
        old = self.cfg
        self.cfg = new
        self.restarts.crashes.reconfigure(new.restart)
        # both as they would launch now, on the serving launch's host facts: the standby's
        # mode as resolved, and what a reload restarts (reloading.relaunch_reason)
        was, nxt = (self.p.gpu.launch(c, host=self.launch.host) for c in (old, new))
        self.keeper.follow(nxt, now, new.stop.term_timeout)
        if self.run is not None:
            self.run.reconfigure(new, "watch" in changed, self.p.step_times)
        self.log.info("reloaded", changed=",".join(changed) or "nothing",
                      files=",".join(new.sources))
        self.tell.emit(Reloaded(tuple(changed)))
        why = reloading.relaunch_reason(was, nxt, self.launch)
        if why and self.state in states.CHILD_STATES:
            self.log.warning("restart_for_reload", reason=why,
                             old_argv_len=len(old.vllm.command))
            self.fail(now, ExitVerdict(Cause.RELOAD, why, True))
        if announce:  # READY=1 ends the reload (the restart, if any, goes on)
            self.tell.reloaded(self.status_line(now))

    def handle_reports(self, now: float) -> None:
        """What the NVML threads reported: samples go to the listeners (from the loop's
        thread), a fatal Xid ends the daemon (EX_GPU) once the group is gone."""
        while self.inbox.gpu:
            report = self.inbox.gpu.popleft()
            if not isinstance(report, str):
                self.tell.emit(report)
                continue
            if self.done or self.state == S.STOPPING:
                continue  # stopping anyway
            v = ExitVerdict(Cause.GPU_FATAL, report, retry=False)
            if self.run is not None and self.state in states.CHILD_STATES:
                self.fail(now, v)
                continue
            self.restarts.fatal_gpu(v, group_gone=self.run is None)
            if self.run is None:
                self.give_up(now, EX_GPU, f"{v.cause.value}: {v.detail}")

    def harvest(self, now: float) -> None:
        """Every row's finished jobs, each to ``route`` (a retired row's were cancelled)."""
        for run, task, result in self.engines.finished(now):
            self.route(now, run, task, result)

    def route(self, now: float, run: Run, task: Task, result: Any) -> None:
        """The one place a job's result goes, chosen by the job and the engine's role: the
        standby's own jobs to its keeper; of the serving engine's, the build's to the keeper
        and the rest to this supervisor's ``on_<job>``."""
        job = task.kind
        if run.role is Role.STANDBY:
            self.carry_out(now, self.keeper.on_job(now, job, result, self.cfg,
                                                   self.serving_run()))
        elif job in BUILD_JOBS:  # the serving engine's sleep and wake around a build
            self.carry_out(now, self.keeper.on_serving_job(now, job, result, run,
                                                           self.cfg))
        else:
            HANDLERS[job](self, now, result, task.started)

    def on_failover_wake(self, now: float, res: HealthResult, started: float) -> None:
        if self.run is not None:
            self.takeover.on_wake(now, self.run, res, started, self.cfg)

    def on_failover_check(self, now: float, res: CompletionResult, started: float) -> None:
        run = self.run
        if run is not None and self.takeover.on_check(now, run, res, self.cfg):
            self.launch = run.launch
            self.become_ready(now, "failover: the standby serves")

    def reap(self, now: float) -> None:
        """One reap for every row: a standby that exited is the keeper's loss, the serving
        engine's exit a failure; the retired rows' stops go on until their groups are gone."""
        self.engines.reap_retiring(now)
        standby = self.keeper.run
        if standby is not None and (rc := standby.exited()) is not None:
            self.carry_out(now, self.keeper.on_exit(now, standby, rc, self.cfg,
                                                    self.serving_run()))
        run = self.run
        if run is None or self.state not in states.CHILD_STATES:
            return
        if (rc := run.exited()) is None:
            return
        self.tell.emit(ChildExitSeen(rc))  # recovery: the timeline's fault mark
        # Judged again from the full tail once the group is gone (a surviving EngineCore
        # holds the pipes open: no waiting for them here).
        verdict = self.starter.port.judge(now, self.cfg.restart.port_wait, run.exit_verdict())
        self.log.warning("child_exited", pid=run.child.pid, code=rc, cause=verdict.cause.value,
                         detail=verdict.detail)
        self.fail(now, verdict)

    def handle_engine_deaths(self, now: float) -> None:
        """Restart at once when vLLM says its engine died: its API server would serve errors
        until its own watchdog ends it, seconds later (issue 10.2)."""
        while self.inbox.engine_deaths:
            child, line = self.inbox.engine_deaths.popleft()
            if (asks := self.keeper.engine_died(now, child, line, self.cfg, self.run)) is not None:
                self.carry_out(now, asks)
                continue
            run = self.run
            if run is None or child is not run.child or self.state not in states.CHILD_STATES:
                continue  # an old child's late line, or a stop/restart under way already
            self.fail(now, run.engine_died(line))

    def heartbeat(self, now: float) -> None:
        # Before the first READY=1 (and while stopping), systemd's timeouts run: extended for
        # as long as vLLM makes visible progress.
        starting = not self.tell.ready_notified and self.state in (
            S.PREFLIGHT, S.STARTING, S.LOADING, S.WARMING, S.RESTARTING)
        self.tell.beat(now, self.status_line(now), lambda: (
            starting or self.state == S.STOPPING) and self.making_progress(now))

    def making_progress(self, now: float) -> bool:
        if self.state in (S.PREFLIGHT, S.RESTARTING, S.STOPPING):
            return True  # bounded by our own timers
        run = self.run
        if run is None:
            return False
        if self.state == S.WARMING:
            return now - run.last_warmup_step < PROGRESS_WINDOW
        return now - run.child.last_output < PROGRESS_WINDOW

    # --- the standby (issue 21; standby.py) --------------------------------------------------

    def step_standby(self, now: float) -> None:
        """The standby's own start and the build around it; a build begins when it is due."""
        k = self.keeper
        if not k.on and k.run is None:
            return
        self.carry_out(now, k.tick(now, self.cfg, self.p.ports, self.serving_run(),
                                   self.p.front.sample(), self.state))

    def carry_out(self, now: float, asks: list[Ask]) -> None:
        for ask in asks:
            if ask.what == "hold" and self.state is S.READY:
                assert self.run is not None
                self.run.hold()  # no watch while it sleeps for the build
                self.transition(now, S.REBUILDING, ask.reason)
                self.p.front.command(Hold(ask.reason, self.run.child.pid))  # it sleeps
            elif ask.what == "resume" and self.state is S.REBUILDING:
                assert self.run is not None
                self.run.became_ready(now, self.p.step_times.measured(self.cfg))  # it slept
                self.serve(self.run)
                self.transition(now, S.READY, ask.reason)
            elif ask.what == "fail" and ask.verdict is not None:
                self.fail(now, ask.verdict)

    def serving_run(self) -> Run | None:
        """The serving row's run while it serves (or sleeps for a build), else None."""
        return self.run if self.state in ROW_SERVES else None

    # --- per-state steps -----------------------------------------------------------------

    def step_preflight(self, now: float) -> None:
        out = self.starter.step(now, self.cfg)
        if isinstance(out, Started):
            self.engines.add(out.run)
            self.launch = out.launch
            self.keeper.follow(out.launch, now, self.cfg.stop.term_timeout)
            self.restarts.started()
            self.transition(now, S.STARTING, "spawned")
        elif isinstance(out, GiveUp):
            self.give_up(now, out.code, out.why)
        elif out is not None:
            self.fail(now, out)

    def step_starting(self, now: float) -> None:
        """STARTING, LOADING, WARMING: the run's start, judged (first line, /health, timeouts)."""
        assert self.run is not None
        self.act(now, self.run.start_step(now, self.cfg, self.p.ports))

    step_loading = step_warming = step_starting

    def on_health(self, now: float, res: tuple[HealthResult, PortOwner | None],
                  started: float) -> None:
        if self.state is S.LOADING and (run := self.run) is not None:
            self.act(now, run.on_health(now, res, self.stranger, self.cfg, self.p.warmup))

    def on_warmup(self, now: float, res: WarmupResult, started: float) -> None:
        if self.state is S.WARMING and (run := self.run) is not None:
            self.warmup = res
            self.act(now, run.on_warmup(res, self.cfg, self.p.step_times))

    def stranger(self, owner: PortOwner | None = None) -> str | None:
        return self.starter.stranger(self.run, self.p.ports, owner)

    def become_ready(self, now: float, why: str) -> None:
        run = self.run
        assert run is not None
        self.serve(run)  # before READY: the front opens on this engine's address
        self.transition(now, S.READY, why)
        self.restarts.ready(now)
        run.became_ready(now, self.p.step_times.measured(self.cfg))
        tokens, kv_bytes = run.child.kv_cache()
        if self.p.gpu.remember_kv(run.launch, tokens, kv_bytes):
            self.log.info("kv_budget_recorded", kv_bytes=kv_bytes, kv_tokens=tokens)
        if self.tell.ready(self.status_line(now)):
            self.log.info("ready_notified", seconds_since_launch=round(now - run.spawned_at, 1))

    def serve(self, run: Run) -> None:
        """The serving row changes here and where the front is told to hold, drain or refuse:
        the front gets typed commands naming the engine (steering.py), never a guess from the
        states (issue 29.4)."""
        e = run.launch.engine
        self.p.front.command(Serve(e.host, e.port, run.child.pid))

    def step_ready(self, now: float) -> None:
        assert self.run is not None
        self.restarts.note_stable(now, True, self.cfg)
        self.act(now, self.run.watch(now, self.state, self.cfg.watch, self.p.ports,
                                     self.p.front.sample()))

    step_degraded = step_ready

    def on_poll(self, now: float, res: tuple[HealthResult, MetricsResult, PortOwner | None],
                started: float) -> None:
        run = self.run
        if self.state not in states.SERVING_STATES or run is None:
            return
        health, metrics, owner = res
        stranger = self.stranger(owner) if health.ok else None
        self.act(now, run.on_poll(now, (health, metrics), started, self.state, self.cfg.watch,
                                  stranger, self.p.front.sample()))

    def on_canary(self, now: float, res: tuple[MetricsResult, CompletionResult, MetricsResult],
                  started: float) -> None:
        if self.state in states.SERVING_STATES and self.run is not None \
                and (verdict := self.run.on_canary(res)) is not None:
            self.fail(now, verdict)

    def act(self, now: float, verdicts: list[Verdict]) -> None:
        """Carry out a run's verdicts, in order (a failure or READY ends them)."""
        for v in verdicts:
            if isinstance(v, Move):
                if self.state is not v.to:
                    self.transition(now, v.to, v.reason)
                continue
            if v.event is not None:
                self.tell.emit(v.event)
            if isinstance(v, Ready):
                self.warmup = v.warmup
                self.become_ready(now, v.reason)
            else:
                self.fail(now, v.verdict)
            return

    def step_restarting(self, now: float) -> None:
        """The failed group's end, the takeover or the backoff (restarts.Restarting)."""
        self.on_restart(now, self.restarting.step(now, self.cfg, self.launch))

    def on_restart(self, now: float, out: Outcome) -> None:
        if isinstance(out, Relaunch):
            self.transition(now, S.PREFLIGHT, out.reason)
        elif isinstance(out, Waking):
            self.state_reason = f"failover: waking the standby (pid {out.pid})"
        elif isinstance(out, GiveUp):
            self.give_up(now, out.code, out.why)

    def step_stopping(self, now: float) -> None:
        """The drain, then every group's TERM and KILL (engines.py); STOPPED once none is
        left."""
        if self.engines.step_stop(now, self.cfg.stop, self.cfg.watch.health_timeout,
                                  self.p.front.sample(), self.state_since):
            self.exit_code = EX_OK
            self.transition(now, S.STOPPED, "stopped")

    def step_stopped(self, now: float) -> None:
        """Nothing to step: STOPPED and FAILED are final; in REBUILDING the serving engine
        sleeps (or wakes) for a standby's build: no polls nor canaries (an engine asleep
        answers none), and the keeper bounds each step of the build."""

    step_failed = step_rebuilding = step_stopped

    # --- vLLM's port: ours, or a stranger's (issue 8.2; portguard.py) --------------------------

    # --- failure ----------------------------------------------------------------------------

    def fail(self, now: float, verdict: ExitVerdict) -> None:
        """Leave the running states for RESTARTING: stop the group, then decide."""
        if self.state in (S.RESTARTING, S.STOPPING) or self.done:
            return
        self.restarts.failed(now, verdict, self.state in states.SERVING_STATES, self.cfg)
        started = self.state not in states.SERVING_STATES
        serving = self.state in ROW_SERVES
        takeover = self.keeper.takes_over(verdict, serving)
        self.keeper.serving_failed(now, self.cfg.stop.term_timeout)
        level = self.log.info if verdict.cause in NOT_FAILURES else self.log.error
        run = self.run
        level("vllm_failed", cause=verdict.cause.value, detail=verdict.detail,
              pid=run.child.pid if run else None)
        self.transition(now, S.RESTARTING, f"{verdict.cause.value}: {verdict.detail}")
        self.p.front.command(Hold(f"{verdict.cause.value}: {verdict.detail}",
                                  run.child.pid if run else None))
        if takeover:
            self.takeover.begin(now, verdict.cause.value)
        else:
            self.takeover.end()
        if run is None:
            self.on_restart(now, self.restarting.gone(now, [], self.cfg, self.launch))
            return
        if started and self.p.gpu.forget_kv(run.launch):
            self.log.warning("kv_budget_forgotten", reason="a start with the fixed KV budget "
                                                           "failed; the next one profiles again")
        self.engines.stop_failed(run, now, self.cfg.stop.term_timeout, verdict.cause, takeover)

    def give_up(self, now: float, code: int, why: str) -> None:
        self.keeper.discard(now, f"giving up: {why}", self.cfg.stop.term_timeout)
        self.engines.kill_all()  # the loop ends now: no waiting for the standby's group
        self.exit_code = code
        self.log.critical("giving_up", exit_code=code, reason=why)
        self.transition(now, S.FAILED, why)
        self.p.front.command(Refuse(why))

    # --- telling ----------------------------------------------------------------------------

    def transition(self, now: float, dst: State, reason: str, **fields: Any) -> None:
        src = self.state
        states.check(src, dst)
        self.state, self.state_since, self.state_reason = dst, now, reason
        self.log.info("state_changed", **{"from": src.value}, to=dst.value, reason=reason,
                      pid=self.child.pid if self.child else None,
                      restarts=self.restarts.crashes.restarts, **fields)
        self.tell.emit(Transition(src, dst, reason))

    def status_line(self, now: float, note: str = "") -> str:
        """The one line systemctl status shows (STATUS=)."""
        return statusline.render(self.facts(now), note)

    def facts(self, now: float) -> statusline.Facts:
        run, c, r = self.run, self.cfg, self.restarts
        return statusline.Facts(
            state=self.state, reason=self.state_reason, seconds=now - self.state_since,
            vllm=self.launch.config.vllm, restarts=self.restarts.crashes.restarts,
            warmup=self.warmup,
            pid=run.child.pid if run else None,
            run_seconds=now - run.spawned_at if run else 0.0,
            warming=run.warmup_progress if run else "",
            restart_in=None if r.restart_at is None else r.restart_at - now,
            cause=r.failure.cause.value if r.failure else "?",
            failures=r.crashes.budget.count(now), budget=c.restart.budget_failures,
            stop_phase="stop" if run is None else "drain" if run.drain is not None else "term",
            port=str(run.launch.engine if run else engine_endpoint(c)),
            port_holder=self.starter.port.holder, warnings=run.warnings if run else 0,
            front=self.p.front.sample(),
            standby=self.keeper.phase.value if self.keeper.on else "",
            waking=self.takeover.waking)


# The serving row's own jobs, each to its handler (Supervisor.route: the one place results go).
HANDLERS: dict[Job, Callable[[Supervisor, float, Any, float], None]] = {
    Job.HEALTH: Supervisor.on_health, Job.WARMUP: Supervisor.on_warmup,
    Job.POLL: Supervisor.on_poll, Job.CANARY: Supervisor.on_canary,
    Job.FAILOVER_WAKE: Supervisor.on_failover_wake,
    Job.FAILOVER_CHECK: Supervisor.on_failover_check}
