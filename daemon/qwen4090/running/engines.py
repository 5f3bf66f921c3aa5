"""The table of engines: every vLLM process group of the daemon is a row, a :class:`run.Run`
with its role (issue 29.3).

The supervisor keeps one table and steps every row the same way: one harvest of finished jobs,
one reap, one deadline query.  Which row serves is the row's role, changed only here (``add``,
``promote``, ``retire``, ``drop``); the rows being stopped (a standby discarded, a failed one)
stay until their group is gone, and the pids of every group stopped are kept until the GPU has
let go of them (the next launch waits for that: ``gpu_pids``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

from qwen4090.decide.policy import Cause
from qwen4090.decide.results import FrontSample
from qwen4090.parts.contracts import GpuLike, LogLike
from qwen4090.running.run import Role, Run, Task
from qwen4090.settings.config import StopConfig, WatchConfig


class Engines:
    def __init__(self, now: float, log: LogLike) -> None:
        self.log = log
        self.rows: list[Run] = []
        self.gpu_pids: list[int] = []  # groups stopped: the GPU must let go of them ...
        self.gone_at = now  # ... since this moment (the failed serving group's end)

    # --- the rows, by role ----------------------------------------------------------------

    def _one(self, role: Role) -> Run | None:
        return next((r for r in self.rows if r.role is role), None)

    @property
    def serving(self) -> Run | None:
        """The serving row: from its spawn until its group is gone and its end judged."""
        return self._one(Role.SERVING)

    @property
    def standby(self) -> Run | None:
        return self._one(Role.STANDBY)

    @property
    def retiring(self) -> list[Run]:
        return [r for r in self.rows if r.role is Role.RETIRING]

    def add(self, run: Run) -> None:
        assert run.role is Role.RETIRING or self._one(run.role) is None, run.role
        self.rows.append(run)

    def promote(self, run: Run) -> None:
        """The standby becomes the serving row (the failed one was dropped)."""
        assert run.role is Role.STANDBY and self.serving is None
        run.assign(Role.SERVING)

    def stop(self, run: Run, now: float, term_timeout: float, hung: bool) -> None:
        """Stop a row's group (its jobs cancelled); its pids wait for the GPU's release."""
        self.gpu_pids += run.abort(now, term_timeout, hung)

    def stop_failed(self, run: Run, now: float, term_timeout: float, cause: Cause,
                    takeover: bool) -> None:
        """The serving row failed: its group is stopped (a hung engine is not waited for), and
        killed outright when nothing of it could serve again: a standby takes over (a polite
        stop would only delay it), or its EngineCore is dead (its API server serves nobody
        and only waits for its clients' connections to close: 4.1 s of every such restart on
        the H100, issue 30.5)."""
        self.stop(run, now, term_timeout, hung=cause is Cause.HANG)
        if takeover:
            run.kill_group(now, "failover: the standby takes over")
        elif cause is Cause.ENGINE_DEAD:
            run.kill_group(now, "its EngineCore is dead: the API server serves nobody")

    def retire(self, run: Run, now: float, term_timeout: float, why: str) -> None:
        """A row nobody waits for any more (a standby not needed): killed, kept until gone."""
        self.stop(run, now, term_timeout, hung=False)
        run.kill_group(now, why)
        run.assign(Role.RETIRING)

    def drop(self, run: Run, now: float) -> None:
        """A row whose group is gone and whose end was judged (the serving one's)."""
        self.rows.remove(run)
        self.gone_at = now

    def gpu_released(self, now: float, gpu: GpuLike, device: int, timeout: float) -> bool:
        """Before a relaunch: the stopped groups' GPU memory is free, or we waited
        gpu.release_timeout (the preflight then names what holds memory)."""
        if not self.gpu_pids:
            return True
        held = gpu.held(device, self.gpu_pids)
        waited = round(now - self.gone_at, 2)
        if held is None:
            self.log.info("gpu_released", waited=waited)
        elif waited < timeout:
            return False
        else:
            self.log.warning("gpu_not_released", waited=waited, holders=held,
                             hint="relaunching anyway; preflight will name what holds memory")
        self.gpu_pids = []
        return True

    def room_for_standby(self, now: float, gpu: GpuLike) -> bool:
        """The GPU has room for the woken standby now (its gpu_memory_utilization free): no
        need to wait for the failed group's memory (True only when NVML says so)."""
        standby = self.standby
        if not self.gpu_pids or standby is None:
            return False
        v = standby.config
        if not gpu.room(v.gpu.device, v.vllm.gpu_memory_utilization):
            return False
        self.log.info("gpu_room_for_standby", waited=round(now - self.gone_at, 2),
                      held=gpu.held(v.gpu.device, self.gpu_pids))
        self.gpu_pids = []
        return True

    # --- the daemon's stop ------------------------------------------------------------------

    def begin_stop(self, now: float, stop: StopConfig, drain: bool) -> None:
        """SIGTERM: the serving row drains first when it serves (``drain``) and
        stop.drain_timeout allows, else its group is signalled at once (the standby's row
        was retired by its keeper)."""
        run = self.serving
        if run is None:
            return
        run.cancel_tasks()
        if drain and stop.drain_timeout > 0:
            run.start_drain(now, stop.drain_timeout)
        else:
            run.begin_kill(now, stop.term_timeout)

    def skip_drain(self, now: float, stop: StopConfig, why: str) -> None:
        """A second stop request while draining: no more draining, the group is signalled."""
        run = self.serving
        if run is not None and run.drain is not None:
            self.log.warning("drain_skipped", reason=why)
            run.skip_drain(now, stop.term_timeout)

    def step_stop(self, now: float, stop: StopConfig, health_timeout: float,
                  front: FrontSample | None, since: float) -> bool:
        """One step of the stop: the drain's next look (and its end, said in the journal),
        then the groups' TERM and KILL; True once no row is left."""
        run = self.serving
        if run is not None and run.drain is not None:
            over = run.drain_step(now, health_timeout, front)
            if over is not None:
                hurry, fields = over
                fields["seconds"] = round(now - since, 2)
                if hurry:
                    self.log.warning("drain_timeout", timeout=stop.drain_timeout, **fields)
                self.log.info("drained", **fields)
                run.begin_kill(now, stop.term_timeout, hurry=hurry or None)
            return False
        if run is not None:
            if not run.reap_group(now):
                return False
            self.drop(run, now)
        return self.reap_retiring(now)

    # --- every row the same way -----------------------------------------------------------

    def finished(self, now: float) -> Iterator[tuple[Run, Task, Any]]:
        """The finished jobs of every row that still has them (a retired row's were
        cancelled), each with its row."""
        for run in [r for r in self.rows if r.role is not Role.RETIRING]:
            for task, result in run.finished(now):
                yield run, task, result

    def reap_retiring(self, now: float) -> bool:
        """Step the stops of the retired rows, drop the gone ones; True when none is left."""
        for run in self.retiring:
            if run.reap_group(now):
                self.rows.remove(run)
        return not self.retiring

    def waits(self, now: float, w: WatchConfig, serving: bool) -> list[float]:
        """Seconds until each row's next deadline (Run.deadlines, by its phase).  A deadline
        already passed was acted on or is waited for by polling, except the serving row's poll
        not yet sent while it serves (``serving``): that one is due now."""
        out: list[float] = []
        for run in self.rows:
            due_now = serving and run.role is Role.SERVING
            out += [d - now for d in run.deadlines(w) if d > now or due_now]
        return out

    def alive(self) -> bool:
        """Some row's group still has a process (cli: the instance lock's record)."""
        return any(r.child.poll() is None or r.child.group_alive() for r in self.rows)

    def kill_all(self) -> None:
        """The loop ends now (an internal error, giving up): no waiting for any group."""
        for run in self.rows:
            run.child.signal_group(signal.SIGKILL)

    def phases(self) -> list[dict[str, Any]]:
        """Every row, for /status: its role, phase and pid."""
        return [{"role": r.role.value, "phase": r.phase.value, "pid": r.child.pid}
                for r in self.rows]

