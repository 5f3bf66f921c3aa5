"""The state machine with a fake clock and fake parts: no processes, no sleeps."""

from __future__ import annotations

import dataclasses
import json
import random
import signal
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import (
    CheckedGpu,
    Clock,
    FakeChild,
    FakeFront,
    FakeProbe,
    Inline,
    Log,
    Notifier,
)

from qwen4090.base.states import State
from qwen4090.decide.policy import WARMUP_JOIN_GRACE, Cause, ExitVerdict, warmup_bound
from qwen4090.decide.results import PreflightResult, WarmupResult, WarmupRow
from qwen4090.launching import steptime
from qwen4090.launching.launchvalue import Launch
from qwen4090.parts.contracts import Parts
from qwen4090.probes.http import (
    HealthResult,
    MetricsResult,
)
from qwen4090.running.run import Job, Run
from qwen4090.settings.config import Config, ConfigError, from_dict
from qwen4090.supervision.supervisor import Supervisor


def is_poll(fn: Any) -> bool:
    return type(fn).__name__ == "_PollJob"


def is_canary(fn: Any) -> bool:
    return "_canary_job" in getattr(fn, "__qualname__", "")


def warm_ok(cfg: Config, probe: Any, progress: Any) -> WarmupResult:
    progress("1 tokens x1")
    return WarmupResult(True, [WarmupRow(1024, 1, 42.0, 42.0, 0.1)], 0.5)


class Harness:
    def __init__(self, raw: dict[str, Any] | None = None, warmup: Any = warm_ok,
                 preflight: Any = None, reload_to: Any = None, front: Any = None) -> None:
        base = {"restart": {"backoff_initial": 1.0, "backoff_max": 4.0, "jitter": 0.0,
                            "budget_failures": 3, "budget_window": 600.0},
                # hang_floor = hang_timeout: no fast hang verdict unless a test asks for one
                "watch": {"poll_interval": 1.0, "hang_timeout": 10.0, "hang_floor": 10.0,
                          "canary_interval": 5.0, "canary_timeout": 2.0, "load_timeout": 100.0,
                          "unhealthy_timeout": 3.0},
                "stop": {"drain_timeout": 5.0, "term_timeout": 3.0}}
        for k, v in (raw or {}).items():
            base.setdefault(k, {}).update(v)
        self.cfg = from_dict(base)
        self.clock = Clock()
        self.children: list[FakeChild] = []
        self.probe = FakeProbe()
        self.notifier = Notifier()
        self.log = Log()
        self.reload_to = reload_to
        self.executor = Inline()
        self.sup = Supervisor(self.cfg, Parts(
            spawn=self.spawn, make_probe=lambda c: self.probe,
            gpu=CheckedGpu(preflight), warmup=warmup,
            load_config=self.load, notifier=self.notifier, executor=self.executor, log=self.log,
            step_times=steptime.StepTimes(self.log), clock=self.clock, wall=lambda: 0.0,
            rand=random.Random(0),
            **({"front": front} if front is not None else {})))

    @property
    def failure(self) -> ExitVerdict:
        """The verdict on the last failure (there must be one)."""
        assert self.sup.restarts.failure is not None
        return self.sup.restarts.failure

    def spawn(self, launch: Launch) -> FakeChild:
        c = FakeChild()
        self.children.append(c)
        return c

    def load(self) -> Config:
        if isinstance(self.reload_to, Exception):
            raise self.reload_to
        return self.reload_to

    @property
    def child(self) -> FakeChild:
        return self.children[-1]

    @property
    def run(self) -> Run:
        """The current vLLM run (there must be one)."""
        assert self.sup.run is not None
        return self.sup.run

    def step(self, dt: float = 0.0, n: int = 1) -> State:
        for _ in range(n):
            self.clock.t += dt
            self.sup.step()
        return self.sup.state

    def run_until(self, state: State, dt: float = 0.25, limit: int = 2000) -> None:
        for _ in range(limit):
            if self.sup.state == state:
                return
            if self.sup.state == State.STARTING and self.children and self.child.lines == 0:
                self.child.lines = 1  # vLLM prints its first line
                self.child.last_output = self.clock.t
            self.step(dt)
        raise AssertionError(f"never reached {state}, stuck in {self.sup.state}")

    def transitions(self) -> list[tuple[str, str]]:
        return [(kw["from"], kw["to"]) for lvl, e, kw in self.log.events if e == "state_changed"]


def test_start_to_ready_notifies_once_after_warmup() -> None:
    h = Harness()
    h.run_until(State.READY)
    assert h.transitions() == [("preflight", "starting"), ("starting", "loading"),
                               ("loading", "warming"), ("warming", "ready")]
    assert h.notifier.sent.count("READY=1") == 1
    ready_status = h.notifier.sent[h.notifier.sent.index("READY=1") + 1]
    assert ready_status.startswith("STATUS=ready: ") and "TTFT@1k=42ms" in ready_status
    assert "restarts=0" in ready_status


def test_not_ready_before_health_and_load_timeout_restarts() -> None:
    h = Harness()
    h.probe.healthy = False
    h.run_until(State.LOADING)
    h.step(1.0, n=50)
    assert h.sup.state == State.LOADING and "READY=1" not in h.notifier.sent
    h.run_until(State.RESTARTING)
    assert h.sup.restarts.failure is not None and h.failure.cause is Cause.LOAD_TIMEOUT
    assert h.child.signals[0] == signal.SIGTERM


def test_extend_timeout_only_while_output_flows() -> None:
    h = Harness({"watch": {"load_timeout": 1000.0}})
    h.probe.healthy = False
    h.run_until(State.LOADING)
    h.step(11.0)
    extends = sum(m.startswith("EXTEND_TIMEOUT_USEC") for m in h.notifier.sent)
    assert extends >= 1
    h.step(200.0)  # no output for 200 s: no more extensions
    h.step(11.0)
    assert sum(m.startswith("EXTEND_TIMEOUT_USEC") for m in h.notifier.sent) == extends


def test_engine_death_line_restarts_at_once_not_at_the_api_servers_exit() -> None:
    # vLLM's API server outlives its EngineCore by up to its watchdog interval (4.5-4.9 s
    # measured): its own line is the earliest sign.
    h = Harness()
    h.run_until(State.READY)
    first = h.child
    h.sup.inbox.engine_dead(first, "[shutdown] MPClient: engine core exited unexpectedly")
    h.step(0.1)
    assert h.sup.state == State.RESTARTING
    assert h.failure.cause is Cause.ENGINE_DEAD
    # the group is killed at once, not waited for: its API server serves nobody and would
    # only wait for client connections to close (4.1 s of each such restart, issue 30.5)
    assert first.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    kill = next(kw for _, e, kw in h.log.events if e == "group_kill")
    assert "EngineCore is dead" in kill["reason"]
    assert "engine_died" in h.log.names()
    h.run_until(State.READY)
    assert h.child is not first and h.sup.restarts.crashes.restarts == 1
    # a late line of the old child says nothing about the new one
    h.sup.inbox.engine_dead(first, "vllm.v1.engine.exceptions.EngineDeadError: ...")
    h.step(0.1)
    assert h.sup.state == State.READY


def test_engine_death_after_an_oom_text_is_an_oom_for_the_ladder() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.child.tail = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    h.sup.inbox.engine_dead(h.child, "[shutdown] MPClient: engine core exited unexpectedly")
    h.step(0.1)
    assert h.failure.cause is Cause.OOM


def test_exit_zero_is_a_failure_and_restarts() -> None:
    h = Harness()
    h.run_until(State.READY)
    first = h.child
    first.exit(0, ["RuntimeError: cancelled"])
    h.step(0.1)
    assert h.sup.state == State.RESTARTING
    assert h.failure.cause is Cause.EXIT_0
    assert h.sup.restarts.restart_at == pytest.approx(h.clock.t, abs=0.01)  # it served: at once
    h.run_until(State.READY)
    assert h.child is not first and h.sup.restarts.crashes.restarts == 1
    assert h.notifier.sent.count("READY=1") == 1  # READY=1 once per service start


def test_crash_loop_ends_in_failed_75() -> None:
    h = Harness()
    for _ in range(3):
        h.run_until(State.LOADING)
        h.child.exit(1, ["ValueError: boom"])
        h.step(0.1, n=2)
    h.run_until(State.FAILED)
    assert h.sup.exit_code == 75
    assert [r.cause for r in h.sup.restarts.crashes.history] == ["crash"] * 3
    delays = [kw["delay"] for _, e, kw in h.log.events if e == "restart_scheduled"]
    assert delays == [1.0, 2.0]


def test_a_run_that_served_restarts_at_once_a_failed_start_backs_off() -> None:
    # issue 30.5: the front holds the clients of a run that served through its restart; a
    # backoff would only lengthen their wait.  A start that fails backs off (a real crash
    # loop), and the budget counts both.
    h = Harness({"restart": {"budget_failures": 10}})
    h.run_until(State.READY)
    h.child.exit(1, ["ValueError: boom"])
    h.step(0.1, n=2)
    h.run_until(State.LOADING)
    h.child.exit(1, ["ValueError: boom"])  # the next start fails before serving
    h.step(0.1, n=2)
    h.run_until(State.READY)
    h.child.exit(1, ["ValueError: boom"])  # served again: at once, however many before
    h.step(0.1, n=2)
    events = [kw for _, e, kw in h.log.events if e == "restart_scheduled"]
    assert [(kw["delay"], kw["served"]) for kw in events] == [(0.0, True), (2.0, False),
                                                             (0.0, True)]
    assert h.sup.restarts.crashes.budget.count(h.clock.t) == 3


def test_stable_run_resets_backoff() -> None:
    h = Harness({"restart": {"stable_after": 30.0}})
    h.run_until(State.READY)
    h.child.exit(1)
    assert h.step(0.1) == State.RESTARTING
    h.run_until(State.READY)
    assert h.sup.restarts.crashes.consecutive == 1
    h.step(1.0, n=25)
    assert h.sup.restarts.crashes.consecutive == 1
    h.step(1.0, n=31)
    assert h.sup.restarts.crashes.consecutive == 0


def test_config_error_in_preflight_is_78_without_spawning() -> None:
    err = ConfigError("/etc/q.toml", "vllm.model", "directory /m does not exist")
    h = Harness(preflight=lambda c: PreflightResult(fatal=err))
    h.step()
    assert h.sup.state == State.FAILED and h.sup.exit_code == 78 and not h.children


def test_vllm_argument_error_is_not_retried() -> None:
    h = Harness()
    h.run_until(State.LOADING)
    h.child.exit(2, ["api_server.py: error: unrecognized arguments: --bogus"])
    h.step(0.1, n=3)
    assert h.sup.state == State.FAILED and h.sup.exit_code == 78


def test_transient_preflight_problem_is_retried() -> None:
    results = [PreflightResult(transient="port 127.0.0.1:8000 is in use"), PreflightResult()]
    h = Harness(preflight=lambda c: results.pop(0) if len(results) > 1 else results[0])
    h.step()
    assert h.sup.state == State.RESTARTING and not h.children
    h.run_until(State.READY)


def test_hang_detected_within_timeout_plus_two_polls() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.running, h.probe.tokens = 1.0, 50.0
    h.step(1.0, n=3)
    start = h.clock.t  # tokens freeze from here on, request still running
    h.run_until(State.RESTARTING, dt=0.25)
    assert h.failure.cause is Cause.HANG
    assert h.clock.t - start <= 10.0 + 2 * 1.0
    assert ("ready", "degraded") in h.transitions()  # degraded while stalled
    assert h.log.names().count("hang_detected") == 1


def test_a_wedged_engine_whose_gauges_read_zero_is_a_hang_by_the_fronts_count() -> None:
    # vLLM's gauges can read running=0 on a wedged engine (vLLM PR #46811): the front's
    # requests at the engine are the witness (issue 20.5); canaries off, so only the hang
    # detector can see it.
    front = FakeFront()
    h = Harness({"watch": {"canary_interval": 0.0}}, front=front)
    h.run_until(State.READY)
    front.in_flight = 3
    for _ in range(3):
        front.bytes += 500
        h.step(1.0)
    assert h.sup.state is State.READY  # bytes flowing: not stalled
    start = h.clock.t
    h.run_until(State.RESTARTING, dt=0.25, limit=100)  # bytes and tokens frozen from here
    assert h.failure.cause is Cause.HANG and "3 running" in h.failure.detail
    assert h.clock.t - start <= 10.0 + 2 * 1.0


def test_answer_bytes_through_the_front_are_progress() -> None:
    # a long non-streamed answer moves no gauge the detector reads... but its stream did:
    # bytes seen by the front keep a busy engine from being called hung
    front = FakeFront()
    h = Harness({"watch": {"canary_interval": 0.0}}, front=front)
    h.run_until(State.READY)
    front.in_flight = 2
    for _ in range(40):
        front.bytes += 100
        h.step(0.5)
    assert h.sup.state is State.READY and "hang_detected" not in h.log.names()


def test_a_canary_withheld_while_busy_does_not_make_the_loop_spin() -> None:
    # Measured on the H200 (issue 20.8): under a steady load the canary was due but withheld
    # (the engine busy), its past deadline made next_wakeup 0 and the loop took a core.
    h = Harness({"watch": {"poll_interval": 1.0, "canary_interval": 5.0}})
    h.run_until(State.READY)
    h.probe.running, h.probe.tokens_per_metrics = 2.0, 10.0  # busy, tokens moving
    h.step(0.5, n=16)  # 8 s: the canary is overdue, withheld
    assert h.probe.canaries == 0 and h.sup.state is State.READY
    waits = []
    for _ in range(8):
        h.step(0.25)
        waits.append(h.sup.next_wakeup(h.clock.t))
    assert min(waits) > 0.0, waits
    h.probe.running = 0.0  # idle again: the next poll lets the canary go
    h.step(1.0, n=3)
    assert h.probe.canaries == 1


def slow_polls(unhealthy_timeout: float) -> Harness:
    """READY with polls 4 s apart and hang_timeout 10 s (no canary)."""
    h = Harness({"watch": {"poll_interval": 4.0, "hang_timeout": 10.0, "canary_interval": 0.0,
                           "unhealthy_timeout": unhealthy_timeout}})
    h.run_until(State.READY)
    return h


def stall_after_progress(h: Harness) -> float:
    """One request running, tokens moving for three polls; then frozen.  Returns the time of
    the last poll that saw them move (where the stall's clock starts)."""
    h.probe.running = 1.0
    for _ in range(3):
        h.probe.tokens += 5.0
        h.step(4.0)
    return h.clock.t


def test_hang_is_seen_at_hang_timeout_after_the_last_progress_not_a_poll_later() -> None:
    # poll 4 s, hang 10 s: the regular polls after the last progress are 4, 8, 12 s later, so
    # the poll at 12 s used to find the hang (2 s late); one is sent at the deadline instead.
    h = slow_polls(unhealthy_timeout=8.0)
    moved_at = stall_after_progress(h)
    assert h.run.serving.hang.deadline() == moved_at + 10.0
    h.run_until(State.RESTARTING, dt=0.25)
    assert h.failure.cause is Cause.HANG
    # sent at the deadline, its answer harvested a step (0.25 s) later; the old way: 12.25 s
    assert moved_at + 10.0 <= h.clock.t <= moved_at + 10.0 + 2 * 0.25


def test_a_stale_hang_deadline_sends_one_poll_not_one_per_step() -> None:
    # /health fails after the last progress, so the stall's clock is never reset: its deadline
    # lies in the past, and each step would poll again (vLLM hammered until unhealthy_timeout).
    h = slow_polls(unhealthy_timeout=30.0)
    moved_at = stall_after_progress(h)
    calls: list[float] = []
    health = h.probe.health

    def counted(timeout: float) -> Any:
        calls.append(h.clock.t)
        return health(timeout)

    h.probe.health = counted  # type: ignore[method-assign]
    h.probe.healthy = False
    h.probe.metrics = lambda timeout: MetricsResult(  # type: ignore[method-assign]
        False, error="connection refused")
    while h.clock.t < moved_at + 20.0:
        h.step(0.25)
    assert h.sup.state == State.DEGRADED
    late = [t for t in calls if t > moved_at + 10.5]
    assert len(late) <= 3  # the regular polls at 12-ish, 16-ish, 20-ish; not one per step


def test_the_loop_sleeps_until_the_next_deadline_not_a_fixed_tick() -> None:
    h = slow_polls(unhealthy_timeout=8.0)
    assert h.sup.next_wakeup(h.clock.t) == 0.0  # just became READY: its first step at once
    h.step(0.0)
    h.step(0.1)
    due = h.run.serving.next_poll_at(h.sup.cfg.watch.poll_interval)
    h.clock.t = due - 0.1
    assert h.sup.next_wakeup(h.clock.t) == pytest.approx(0.1)  # the poll, not a 0.5 s tick
    h.child.closed = False  # the group is gone, its last lines still in the pipes
    h.child.exit(1, ["ValueError: boom"])
    h.step(0.0, n=2)
    assert h.sup.state == State.RESTARTING and h.sup.child is not None
    assert h.sup.next_wakeup(h.clock.t) == 0.02  # not a 0.2 s tick for them
    h.child.closed = True
    h.step(0.0)
    assert h.sup.state == State.RESTARTING and h.sup.child is None
    assert h.sup.restarts.restart_at is not None
    h.clock.t = h.sup.restarts.restart_at - 0.05
    assert h.sup.next_wakeup(h.clock.t) == pytest.approx(0.05)  # the backoff ends on time
    h.clock.t = h.sup.restarts.restart_at + 1.0
    h.sup.moved = False
    assert h.sup.next_wakeup(h.clock.t) == 0.2  # overdue (the GPU still held): no busy loop
    h.step(0.0)
    assert h.sup.state == State.PREFLIGHT and h.sup.next_wakeup(h.clock.t) == 0.0


def test_the_engine_left_behind_by_a_dead_api_server_is_killed_at_once() -> None:
    # SIGKILL of the API server: its EngineCore lives on, serving nobody; SIGTERM let it tear
    # down for 1.3 s on the H200 before the restart could begin.
    h = Harness()
    h.run_until(State.READY)
    c = h.child
    c.rc, c.ignores_term = -9, True  # the leader is dead, the group (its EngineCore) is not
    h.step(0.1)
    assert h.sup.state == State.RESTARTING
    assert c.signals[-1] == signal.SIGKILL and not c.alive
    kills = [kw for _, e, kw in h.log.events if e == "group_kill"]
    assert len(kills) == 1 and "API server is gone" in kills[0]["reason"]


def test_progress_keeps_it_ready() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.running = 4.0
    for _ in range(60):
        h.probe.tokens += 10
        h.step(1.0)
    assert h.sup.state == State.READY


def test_idle_canary_failure_restarts() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.step(1.0, n=6)
    assert h.probe.canaries >= 1 and h.sup.state == State.READY
    h.probe.canary_ok = False
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.CANARY


def test_no_canary_while_busy() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.running = 1.0
    for _ in range(20):
        h.probe.tokens += 1
        h.step(1.0)
    assert h.probe.canaries == 0


def test_unhealthy_degrades_then_restarts() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.healthy = False
    h.step(1.0, n=2)
    assert h.sup.state == State.DEGRADED
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.UNHEALTHY


def test_degraded_recovers() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.healthy = False
    h.step(1.0, n=2)
    h.probe.healthy = True
    h.step(1.0, n=2)
    assert h.sup.state == State.READY


def test_sigterm_drains_then_stops_group() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.running, h.probe.tokens = 2.0, 5.0
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    assert h.sup.state == State.STOPPING and "STOPPING=1" in h.notifier.sent
    h.step(0.5, n=4)
    assert h.child.signals == []  # still draining: requests are running
    h.probe.running = 0.0
    h.step(0.5, n=3)
    assert h.child.signals == [signal.SIGTERM, signal.SIGCONT]
    h.run_until(State.STOPPED)
    assert h.sup.exit_code == 0


def test_stop_escalates_to_sigkill_after_term_timeout() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.child.ignores_term = True  # and its EngineCore stays: nothing says "hurry"
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.step(0.1, n=2)  # the drain sample, in two parts (connections, then gauges): idle
    assert h.child.signals == [signal.SIGTERM, signal.SIGCONT]
    term = h.clock.t
    h.run_until(State.STOPPED, dt=0.25)
    assert h.child.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    kill = next(kw for _, e, kw in h.log.events if e == "group_kill")
    assert "3s after SIGTERM" in kill["reason"]
    assert h.clock.t - term >= 3.0


def test_drain_waits_for_the_fronts_requests_though_the_gauges_read_zero() -> None:
    # vLLM's gauges miss requests still in the API server (8 streams open, running 0.0); the
    # front counts every client request exactly (issue 20.4).
    front = FakeFront()
    h = Harness({"stop": {"drain_timeout": 30.0}}, front=front)
    h.run_until(State.READY)
    front.in_flight = 8
    jobs: list[str] = []

    def note(fn: Any) -> bool:
        jobs.append(getattr(fn, "__qualname__", ""))
        return False

    h.executor.hold = note
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.step(0.5, n=20)
    assert h.sup.state == State.STOPPING and h.child.signals == []
    assert "drained" not in h.log.names()
    assert "draining: 8 in flight" in h.sup.tell.last_status
    front.in_flight = 0
    h.step(0.5)
    assert h.child.signals[:1] == [signal.SIGTERM]
    drained = next(kw for _, e, kw in h.log.events if e == "drained")
    assert drained["busy"] is False and drained["in_flight"] == 0
    assert drained["seconds"] >= 10.0
    assert not any("_drain_gauges_job" in j for j in jobs)  # the front's count only
    h.run_until(State.STOPPED)


def test_the_drain_is_not_over_before_the_front_stopped_taking_requests() -> None:
    # SIGTERM reaches the front through its own event loop: until it has closed its door a
    # count of 0 says nothing (a request may be on its way in)
    front = FakeFront()
    front.draining = False
    h = Harness({"stop": {"drain_timeout": 30.0}}, front=front)
    h.run_until(State.READY)
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.step(0.5, n=4)
    assert h.sup.state == State.STOPPING and "drained" not in h.log.names()
    front.draining = True
    h.step(0.5)
    drained = next(kw for _, e, kw in h.log.events if e == "drained")
    assert drained["busy"] is False
    h.run_until(State.STOPPED)


def test_drain_without_the_front_waits_for_the_gauges() -> None:
    h = Harness({"stop": {"drain_timeout": 30.0}})
    h.run_until(State.READY)
    h.probe.running = 2.0
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.step(0.5, n=10)
    assert h.sup.state == State.STOPPING and h.child.signals == []
    h.probe.running = 0.0
    h.step(0.5, n=3)
    assert h.child.signals[:1] == [signal.SIGTERM]
    drained = next(kw for _, e, kw in h.log.events if e == "drained")
    assert drained["busy"] is False and drained["running"] == 0.0
    h.run_until(State.STOPPED)


def test_drain_that_cannot_tell_is_busy_until_the_deadline() -> None:
    h = Harness({"stop": {"drain_timeout": 5.0, "term_timeout": 30.0}})
    h.run_until(State.READY)
    h.probe.metrics_fail = True  # the gauges cannot be read
    h.child.ignores_term = True
    h.sup.inbox.deliver(signal.SIGTERM)
    stop = h.clock.t
    h.step(0.1)
    h.step(0.25, n=15)
    assert h.child.signals == []  # 3.85 s: still draining
    h.run_until(State.STOPPED, dt=0.25)
    names = h.log.names()
    assert names.index("drain_timeout") < names.index("drained")
    drained = next(kw for _, e, kw in h.log.events if e == "drained")
    assert drained["busy"] is True and drained["seconds"] >= 5.0
    # past the deadline there is nothing to wait for: SIGKILL after the grace, not 30 s
    kill = next(kw for _, e, kw in h.log.events if e == "group_kill")
    assert "drain deadline passed" in kill["reason"]
    assert h.child.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    assert h.clock.t - stop <= 5.0 + 2.0 + 1.0


def test_drain_reads_the_front_while_the_metrics_probe_hangs() -> None:
    # A busy API server may not even accept the /metrics connection in time (seen in CI: no
    # drain sample at all by the deadline); the front's count never asks it.
    front = FakeFront()
    h = Harness({"stop": {"drain_timeout": 3.0, "term_timeout": 30.0}}, front=front)
    h.run_until(State.READY)
    front.in_flight = 8
    h.executor.hold = lambda fn: "_drain_gauges_job" in getattr(fn, "__qualname__", "")
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.run_until(State.STOPPED, dt=0.25)
    drained = next(kw for _, e, kw in h.log.events if e == "drained")
    assert drained["busy"] is True and drained["in_flight"] == 8
    assert drained["seconds"] >= 3.0
    assert h.executor.held == []  # no gauges asked


def test_api_server_waiting_for_connections_after_its_engine_is_gone_is_killed() -> None:
    # The restart of a failed canary: TERM ends the EngineCore, the API server lingers.
    h = Harness({"stop": {"term_timeout": 15.0}})
    h.run_until(State.READY)
    h.child.term_stops_engine_only = True
    h.probe.canary_error = True
    h.probe.canary_ok = False
    h.run_until(State.RESTARTING)
    term = h.clock.t
    h.run_until(State.PREFLIGHT, dt=0.25)
    kill = next(kw for _, e, kw in h.log.events if e == "group_kill")
    assert "no EngineCore left" in kill["reason"]
    assert h.sup.engines.gone_at - term <= 2 * 2.0 + 0.5  # the grace, the look, + grace
    assert h.children[0].signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]


def test_hang_restart_continues_the_group_and_kills_without_term_timeout() -> None:
    h = Harness({"stop": {"term_timeout": 15.0}})
    h.run_until(State.READY)
    hung = h.child
    hung.ignores_term = True  # a stopped EngineCore does not act on TERM
    h.probe.running, h.probe.tokens = 1.0, 50.0
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.HANG
    term = h.clock.t
    assert hung.signals == [signal.SIGTERM, signal.SIGCONT]
    h.run_until(State.PREFLIGHT, dt=0.25)
    assert hung.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
    kill = next(kw for _, e, kw in h.log.events if e == "group_kill")
    assert kill["reason"].startswith("hang")
    assert h.sup.engines.gone_at - term <= 2.0 + 0.5


def test_a_restart_we_asked_for_keeps_its_cause_whatever_the_tail_says() -> None:
    """Only an exit vLLM chose itself is judged again from its last lines (reclassify_exit):
    the SIGTERM we sent for a hang makes vLLM print its own errors on the way down."""
    h = Harness()
    h.run_until(State.READY)
    stopped = h.child
    h.probe.running, h.probe.tokens = 1.0, 50.0
    h.run_until(State.RESTARTING)
    stopped.tail = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"]
    h.run_until(State.PREFLIGHT, dt=0.25)
    assert h.sup.restarts.failure is not None and h.sup.restarts.failure.cause is Cause.HANG
    assert "exit_classified" not in h.log.names()
    assert h.sup.restarts.crashes.history[-1].cause == Cause.HANG.value


def test_second_sigterm_skips_drain() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.running = 1.0
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.1)
    h.sup.inbox.deliver(signal.SIGINT)
    h.step(0.1)
    assert h.child.signals == [signal.SIGTERM, signal.SIGCONT]


def test_sighup_with_broken_config_keeps_serving() -> None:
    err = ConfigError("/etc/q.toml", "vllm.port", "found 0, expected an integer from 1")
    h = Harness(reload_to=err)
    h.run_until(State.READY)
    child = h.child
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert h.sup.state == State.READY and h.child is child and not child.signals
    assert "reload_refused" in h.log.names()
    assert h.notifier.sent[-3:-1] == ["RELOADING=1", "READY=1"]


def test_sighup_supervisor_setting_applies_live() -> None:
    h = Harness()
    new = from_dict({"watch": {"hang_timeout": 3.0, "poll_interval": 1.0},
                     "restart": {"backoff_initial": 1.0, "backoff_max": 4.0, "jitter": 0.0,
                                 "budget_failures": 3, "budget_window": 600.0},
                     "stop": {"drain_timeout": 5.0, "term_timeout": 3.0}})
    h.reload_to = new
    h.run_until(State.READY)
    child = h.child
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert h.sup.state == State.READY and h.child is child and h.sup.cfg.watch.hang_timeout == 3
    assert h.run.serving.hang.hang_timeout == 3


def test_sighup_vllm_change_is_a_controlled_restart_not_a_failure() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.reload_to = from_dict({"vllm": {"max_num_seqs": 4}})
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert h.sup.state == State.RESTARTING and h.failure.cause is Cause.RELOAD
    h.run_until(State.READY)
    crashes = h.sup.restarts.crashes
    assert crashes.budget.count(h.clock.t) == 0 and crashes.restarts == 1


def test_warmup_failure_is_a_failed_start() -> None:
    h = Harness(warmup=lambda c, p, prog: WarmupResult(False, error="HTTP 500: boom"))
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.WARMUP_FAILED
    assert "READY=1" not in h.notifier.sent


def test_stale_probe_results_are_dropped() -> None:
    h = Harness()
    h.run_until(State.READY)
    old = h.run
    f: Future[Any] = Future()
    f.set_running_or_notify_cancel()  # a job already running: cancelling it does nothing
    old.submit(h.clock.t, Job.POLL, lambda: None)
    old.tasks[Job.POLL].future = f
    h.child.exit(1)  # the next vLLM process: a result about the older one must not count
    h.run_until(State.RESTARTING)
    h.run_until(State.READY)
    assert h.run is not old
    f.set_result((HealthResult(False, None, 0, "x"), MetricsResult(False)))
    h.step(0.1)
    assert h.sup.state == State.READY


def test_watchdog_pings_from_the_loop() -> None:
    h = Harness()
    h.notifier.watchdog_interval = 2.0
    h.run_until(State.READY)
    before = h.notifier.sent.count("WATCHDOG=1")
    h.step(1.0, n=10)
    assert h.notifier.sent.count("WATCHDOG=1") - before == 5


def test_canary_timeout_while_tokens_move_is_not_a_restart() -> None:
    # The canary queued behind long prompts: no answer in time, but the engine progresses.
    h = Harness()
    h.run_until(State.READY)
    h.probe.canary_ok = False
    h.probe.tokens_per_metrics = 7.0
    h.step(1.0, n=30)
    assert h.sup.state == State.READY and h.sup.restarts.crashes.restarts == 0
    slow = [kw for lvl, e, kw in h.log.events if e == "canary_slow"]
    assert slow and all(lvl == "warning" for lvl, e, _ in h.log.events if e == "canary_slow")
    assert slow[0]["tokens_after"] > slow[0]["tokens_before"]
    assert "canary_failed" not in h.log.names()
    # the same timeout with the counters flat is a failure
    h.probe.tokens_per_metrics = 0.0
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.CANARY


def test_canary_error_answer_fails_even_while_tokens_move() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.probe.canary_ok, h.probe.canary_error = False, True
    h.probe.tokens_per_metrics = 7.0
    h.run_until(State.RESTARTING)
    assert h.failure.cause is Cause.CANARY and "HTTP 500" in h.failure.detail


def test_stuck_canary_with_progress_is_not_a_restart_without_it_is() -> None:
    h = Harness()
    h.executor.hold = is_canary  # the canary's thread never comes back
    h.run_until(State.READY)
    h.probe.tokens_per_metrics = 5.0  # and the polls see the engine working
    h.step(0.5, n=60)
    assert h.executor.held and h.sup.state == State.READY
    assert [e for e in h.log.names() if e == "canary_slow"] == ["canary_slow"]  # once
    h.probe.tokens_per_metrics = 0.0
    h.run_until(State.RESTARTING, dt=0.5)
    assert h.failure.cause is Cause.CANARY and "stuck" in h.failure.detail


def test_health_probe_without_answer_fails_from_when_it_was_sent() -> None:
    # A SIGSTOPped API server: the kernel accepts the connection, no answer ever comes.
    h = Harness({"watch": {"unhealthy_timeout": 3.0, "health_timeout": 1.0,
                           "poll_interval": 1.0, "canary_interval": 0.0}})
    h.run_until(State.READY)
    stopped = h.clock.t
    h.executor.hold = is_poll
    h.run_until(State.RESTARTING, dt=0.25, limit=200)
    assert h.failure.cause is Cause.UNHEALTHY
    failed = next(i for i, (_, e, _) in enumerate(h.log.events) if e == "health_failed")
    assert "no answer within 1s" in h.log.events[failed][2]["error"]
    # bound: unhealthy_timeout + one poll interval (+ one tick)
    assert h.clock.t - stopped <= 3.0 + 1.0 + 0.25
    assert ("ready", "degraded") in h.transitions()


def test_failed_health_answer_is_dated_from_the_probe_start() -> None:
    h = Harness({"watch": {"unhealthy_timeout": 3.0}})
    h.run_until(State.READY)
    h.probe.healthy = False
    h.step(1.0)
    first = h.clock.t
    h.step(1.0)  # harvested one step after it was sent
    since = h.run.serving.unhealthy_since
    assert since is not None and since <= first


def test_dead_child_seen_in_one_step_without_waiting_on_its_pipes() -> None:
    h = Harness()
    h.run_until(State.READY)
    c = h.child
    # The API server died; the surviving EngineCore keeps the pipes open: the loop must
    # not wait for them (output_closed is asked, never waited for).
    c.closed = False
    c.rc, c.tail = 1, ["(APIServer pid=1) INFO 11-30 00:00:00 [x.py:1] serving"]
    h.step(0.01)
    assert h.sup.state == State.RESTARTING  # one step
    assert c.signals[:1] == [signal.SIGTERM]
    # the group goes, and the last lines (the real cause) arrive after it
    c.alive = False
    h.step(0.25)
    assert h.sup.state == State.RESTARTING and h.sup.child is c  # waiting for the lines
    c.tail = [*c.tail, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"]
    c.closed = True
    h.step(0.25)
    assert h.sup.child is None and h.failure.cause is Cause.OOM
    assert "exit_classified" in h.log.names()


def test_output_wait_is_bounded_when_the_pipes_never_close() -> None:
    h = Harness()
    h.run_until(State.READY)
    c = h.child
    c.closed = False
    c.exit(1, ["ValueError: boom"])
    c.closed = False
    h.step(0.01)
    gone = h.clock.t
    h.run_until(State.PREFLIGHT, dt=0.25)
    assert h.clock.t - gone <= 2.0 + 1.0 + 0.5  # OUTPUT_WAIT + the first backoff
    assert h.sup.restarts.failure is None or h.sup.restarts.crashes.history[-1].cause == "crash"


def test_status_says_ready_after_a_restart() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.child.exit(1, ["ValueError: boom"])
    h.run_until(State.WARMING)
    h.run_until(State.READY)
    statuses = [m for m in h.notifier.sent if m.startswith("STATUS=")]
    assert statuses[-1].startswith("STATUS=ready: ") and "restarts=1" in statuses[-1]
    assert h.notifier.sent.count("READY=1") == 1


def test_sigkill_says_oom_only_with_the_kernels_evidence() -> None:
    h = Harness()
    h.run_until(State.READY)
    h.child.rc = -signal.SIGKILL
    h.step(0.01)
    exited = next(kw for _, e, kw in h.log.events if e == "child_exited")
    assert exited["detail"] == "killed by SIGKILL"
    h.run_until(State.READY)
    h.child.oom = "cgroup oom_kill 0 -> 1"
    h.child.rc = -signal.SIGKILL
    mark = len(h.log.events)
    h.step(0.01)
    exited = next(kw for _, e, kw in h.log.events[mark:] if e == "child_exited")
    assert exited["detail"] == ("killed by SIGKILL from the kernel's OOM killer "
                                "(cgroup oom_kill 0 -> 1)")


def test_first_restart_after_a_stable_run_is_immediate_and_the_next_back_off() -> None:
    h = Harness({"restart": {"stable_after": 30.0, "budget_failures": 10}})
    for _ in range(2):  # two quick failures: the backoff grows
        h.run_until(State.LOADING)
        h.child.exit(1, ["ValueError: boom"])
        h.step(0.1, n=2)
    h.run_until(State.READY)
    assert h.sup.restarts.crashes.consecutive == 2
    h.step(1.0, n=10)
    # the canary that fails is harvested in the same step that crosses stable_after
    h.probe.canary_ok, h.probe.canary_error = False, True
    h.run.serving.last_canary = h.clock.t - 100.0
    h.step(0.1)
    h.step(40.0)
    assert h.sup.state == State.RESTARTING
    h.run_until(State.PREFLIGHT)
    delays = [kw["delay"] for _, e, kw in h.log.events if e == "restart_scheduled"]
    assert delays == [1.0, 2.0, 0.0]  # issue 10.2: no backoff after a long healthy period
    h.run_until(State.LOADING)  # a quick failure after it: the backoff is back
    h.child.exit(1, ["ValueError: boom"])
    h.step(0.1, n=2)
    delays = [kw["delay"] for _, e, kw in h.log.events if e == "restart_scheduled"]
    assert delays == [1.0, 2.0, 0.0, 2.0]


def test_reload_that_shortens_the_poll_interval_acts_from_the_last_poll() -> None:
    h = Harness({"watch": {"poll_interval": 20.0, "canary_interval": 0.0,
                           "hang_timeout": 60.0, "unhealthy_timeout": 30.0}})
    h.run_until(State.READY)
    h.step(0.5, n=45)  # a poll went out; the next is ~20 s away
    h.reload_to = from_dict({"watch": {"poll_interval": 1.0, "canary_interval": 0.0,
                                       "unhealthy_timeout": 3.0}})
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    h.probe.healthy = False
    stopped = h.clock.t
    h.run_until(State.RESTARTING, dt=0.25)
    assert h.failure.cause is Cause.UNHEALTHY
    assert h.clock.t - stopped <= 3.0 + 1.0 + 0.5


def test_api_server_stopping_between_health_and_metrics_counts_from_the_metrics_request() -> Any:
    h = Harness({"watch": {"unhealthy_timeout": 3.0, "health_timeout": 1.0,
                           "poll_interval": 1.0, "canary_interval": 0.0}})
    h.run_until(State.READY)
    stopped = h.clock.t
    # the poll job runs its /health (ok) and is then stuck in /metrics
    def hold(fn: Any) -> bool:
        if is_poll(fn):
            fn.health = h.probe.health(1.0)
            fn.metrics_sent = h.clock.t
            return True
        return False
    h.executor.hold = hold
    h.run_until(State.RESTARTING, dt=0.25, limit=200)
    assert h.failure.cause is Cause.UNHEALTHY and "/metrics" in h.failure.detail
    assert h.clock.t - stopped <= 3.0 + 1.0 + 0.25


def test_metrics_timeout_after_a_good_health_is_not_a_recovery() -> None:
    h = Harness({"watch": {"unhealthy_timeout": 3.0}})
    h.run_until(State.READY)
    h.probe.healthy = False
    h.step(1.0, n=2)
    run = h.run
    assert run.serving.unhealthy_since is not None
    since = run.serving.unhealthy_since
    h.probe.healthy = True
    h.probe.metrics = lambda timeout: MetricsResult(  # type: ignore[method-assign]
        False, {}, timeout, f"no answer within {timeout:g}s", timed_out=True)
    h.step(1.0, n=2)
    assert run.serving.unhealthy_since == since and "health_recovered" not in h.log.names()


def test_stale_good_health_with_overdue_metrics_is_no_recovery_and_the_window_runs_on() -> None:
    # Seen on the real vLLM: the poll's /health was answered just before the SIGSTOP, its
    # /metrics timed out; harvesting it flipped DEGRADED -> READY and the next probe's first
    # health_timeout seconds went unjudged (restart 10 s after the stop, not 6 + 1).
    h = Harness({"watch": {"unhealthy_timeout": 3.0, "health_timeout": 1.0,
                           "poll_interval": 1.0, "canary_interval": 0.0}})
    h.run_until(State.READY)
    h.probe.metrics = lambda timeout: MetricsResult(  # type: ignore[method-assign]
        False, {}, timeout, f"no answer within {timeout:g}s", timed_out=True)
    stopped = h.clock.t
    h.step(1.0)  # the poll: /health ok, /metrics overdue -> failing, dated from /metrics
    held: list[Any] = []
    def hold(fn: Any) -> bool:  # then nothing answers
        if is_poll(fn):
            held.append(fn)
            return True
        return False

    h.executor.hold = hold
    h.run_until(State.RESTARTING, dt=0.25, limit=100)
    assert ("degraded", "ready") not in h.transitions()
    assert h.clock.t - stopped <= 3.0 + 1.0 + 0.5


# --- issue 18.4/18.5: a warmup cut short by clients, the longest step (test_busy_start.py) --


def measured(seconds: float, cut_short: str = "") -> Any:
    def warm(c: Config, probe: Any, progress: Any) -> WarmupResult:
        progress("2044 tokens x1")
        return WarmupResult(True, [WarmupRow(2044, 1, seconds * 1000, seconds * 1000, 0.1)],
                            0.5, cut_short=cut_short,
                            longest_step=None if cut_short else (seconds, 2044))
    return warm


def test_a_warmup_cut_short_by_clients_is_ready_and_said(tmp_path: Path) -> None:
    h = Harness({"gpu": {"state_directory": str(tmp_path)}},
                warmup=measured(0.1, "engine busy with client requests: 500 tokens generated "
                                     "meanwhile (8 running, 24 waiting)"))
    h.run_until(State.READY)
    cut = h.log.named("warmup_cut_short")
    assert len(cut) == 1 and cut[0]["reason"].startswith("engine busy with client requests")
    assert h.sup.restarts.crashes.restarts == 0 and "READY=1" in h.notifier.sent
    assert not (tmp_path / steptime.FILE_NAME).exists()  # nothing measured: nothing written


def test_the_longest_step_is_logged_stored_and_held_against_hang_timeout(
        tmp_path: Path) -> None:
    h = Harness({"gpu": {"state_directory": str(tmp_path)}}, warmup=measured(5.0))
    h.run_until(State.READY)
    (fin,) = h.log.named("warmup_finished")
    assert fin["longest_step_seconds"] == 5.0 and fin["longest_step_tokens"] == 2044
    assert json.loads((tmp_path / steptime.FILE_NAME).read_text())["seconds"] == 5.0
    (warn,) = h.log.named("hang_timeout_too_short")  # hang_timeout 10 < 3 x 5
    assert warn["hang_timeout"] == 10.0 and warn["longest_step_seconds"] == 5.0
    assert "raise hang_timeout to at least 15.0" in warn["detail"]
    # a reload that changes [watch] is held against it too
    base = h.cfg
    for hang, warned in ((20.0, 1), (12.0, 2)):
        h.reload_to = from_dict({"watch": {**_watch(base), "hang_timeout": hang},
                                 "restart": _restart(base), "stop": _stop(base),
                                 "gpu": {"state_directory": str(tmp_path)}})
        h.sup.inbox.deliver(signal.SIGHUP)
        h.step(0.1)
        assert len(h.log.named("hang_timeout_too_short")) == warned
    assert h.sup.state is State.READY and h.run.serving.hang.hang_timeout == 12.0


def test_a_step_well_within_hang_timeout_is_quiet(tmp_path: Path) -> None:
    h = Harness({"gpu": {"state_directory": str(tmp_path)}}, warmup=measured(0.5))
    h.run_until(State.READY)
    assert h.log.named("hang_timeout_too_short") == []


def test_the_warming_limit_does_not_fail_a_warmup_within_its_own_bound() -> None:
    h = Harness({"warmup": {"timeout": 30.0, "request_timeout": 10.0}})
    # the warmup's job stays in flight: a warmup that has not returned yet
    h.executor.hold = lambda fn: "begin_warmup" in getattr(fn, "__qualname__", "")
    h.run_until(State.WARMING)
    assert Job.WARMUP in h.run.tasks
    limit = warmup_bound(h.cfg)
    assert limit > 30.0 + 10.0  # request_timeout + its slack: the warmup's last step
    h.step(30.0 + 10.0 + WARMUP_JOIN_GRACE)  # past the old limit, within the bound
    assert h.sup.state is State.WARMING
    h.step(limit)
    assert h.sup.state is State.RESTARTING and "warmup overran" in h.failure.detail


def _watch(c: Config) -> dict[str, Any]:
    w = c.watch
    return {"poll_interval": w.poll_interval, "canary_interval": w.canary_interval,
            "canary_timeout": w.canary_timeout, "load_timeout": w.load_timeout,
            "unhealthy_timeout": w.unhealthy_timeout}


def _restart(c: Config) -> dict[str, Any]:
    r = c.restart
    return {"backoff_initial": r.backoff_initial, "backoff_max": r.backoff_max,
            "jitter": r.jitter, "budget_failures": r.budget_failures,
            "budget_window": r.budget_window}


def _stop(c: Config) -> dict[str, Any]:
    return {"drain_timeout": c.stop.drain_timeout, "term_timeout": c.stop.term_timeout}


def test_status_says_how_many_warnings_the_start_logged() -> None:
    """Issue 18.8: risky settings are warned in the journal and in STATUS= at start, where
    `systemctl status` shows them."""
    risky = "status.host = \"0.0.0.0\": the status endpoint answers on every interface"
    h = Harness(preflight=lambda c: PreflightResult(warnings=[risky]))
    h.run_until(State.READY)
    assert [kw["detail"] for kw in h.log.named("preflight_warning")] == [risky]
    ready = h.notifier.sent[h.notifier.sent.index("READY=1") + 1]
    assert ready.startswith("STATUS=ready: ") and "1 warning at start" in ready
    quiet = Harness()
    quiet.run_until(State.READY)
    assert not any("warning" in m for m in quiet.notifier.sent)


def test_a_stuck_canary_is_judged_on_a_sample_newer_than_itself_not_a_stale_poll() -> None:
    """Polls 20 s apart, canaries every second: a canary stuck behind a busy queue must not be
    condemned on the last poll's counters (taken before it was sent: flat means stale, not
    hung); a poll goes out at once and its answer decides (the integration test
    test_canary_behind_a_busy_queue_is_not_a_restart failed this way under load)."""
    h = Harness({"watch": {"poll_interval": 20.0, "canary_interval": 1.0, "canary_timeout": 2.0,
                           "hang_timeout": 40.0, "unhealthy_timeout": 20.0}})
    h.run_until(State.READY)
    h.step(0.5, n=4)  # a few good canaries after the READY poll
    polls = []
    h.executor.hold = lambda fn: is_canary(fn)  # the next canary never comes back
    orig = h.probe.metrics

    def metrics(timeout: float) -> MetricsResult:
        polls.append(h.clock.t)
        return orig(timeout)

    h.probe.metrics = metrics  # type: ignore[method-assign]
    h.probe.tokens_per_metrics = 5.0  # the engine works meanwhile
    h.step(0.5, n=36)  # 18 s: two canary windows (2 + 5 s), before the next regular poll
    assert h.sup.state == State.READY, h.failure
    assert polls and polls[0] < h.clock.t  # a poll was brought forward for the judgement
    assert "canary_slow" in h.log.names()
    h.probe.tokens_per_metrics = 0.0  # and a canary stuck with the counters flat still fails
    h.run_until(State.RESTARTING, dt=0.5, limit=60)
    assert h.failure.cause is Cause.CANARY and "stuck" in h.failure.detail


def test_the_status_endpoint_reads_what_the_loop_published_never_the_live_supervisor() -> None:
    """Issue 29.6: the loop publishes an immutable view after each step; the endpoint's
    threads read that one whole (they used to copy the live Supervisor and retry on
    RuntimeError while the loop changed it)."""
    from qwen4090.surfaces.httpapi import Telemetry, status_document

    h = Harness()
    h.run_until(State.READY)
    seen = h.sup.published
    assert seen.snapshot["state"] == "ready" and seen.snapshot["restarts"] == 0
    h.child.exit(1, ["ValueError: boom"])
    h.step(0.25)
    now = h.sup.published
    assert now is not seen and now.snapshot["state"] == "restarting"
    assert seen.snapshot["state"] == "ready" and seen.snapshot["restarts"] == 0  # unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.cfg = h.cfg  # type: ignore[misc]

    def live(*_a: object) -> object:
        raise AssertionError("the status thread read the live supervisor")

    h.sup.snapshot = live  # type: ignore[method-assign,assignment]
    doc = status_document(h.sup, Telemetry(clock=h.clock))
    assert doc["state"] == "restarting" and doc["restarts"] == now.snapshot["restarts"]


# --- the fast hang verdict (issue 30.3) -------------------------------------------------------


def fast_hang(front: FakeFront) -> Harness:
    """READY behind a front, polls 5 s apart, hang_timeout 60 s, the floor 1.5 s (no canary,
    no measured step: the bound is the floor)."""
    h = Harness({"watch": {"poll_interval": 5.0, "hang_timeout": 60.0, "hang_floor": 1.5,
                           "canary_interval": 0.0, "unhealthy_timeout": 30.0}}, front=front)
    h.run_until(State.READY)
    return h


def stream(h: Harness, front: FakeFront, seconds: float, dt: float = 0.05) -> None:
    """Two requests streaming: an answer byte every ``dt``."""
    front.in_flight = 2
    h.probe.running = 2.0
    for _ in range(round(seconds / dt)):
        front.bytes += 10
        front.last_byte_at = h.clock.t
        h.step(dt)


def test_a_stopped_engine_under_streams_is_hung_at_the_floor_not_at_hang_timeout() -> None:
    front = FakeFront()
    h = fast_hang(front)
    stream(h, front, 12.0)
    assert h.sup.state is State.READY and h.run.serving.hang.bound == 1.5
    last = front.last_byte_at
    assert last is not None
    h.run_until(State.RESTARTING, dt=0.05, limit=200)  # bytes and tokens frozen from here
    assert h.failure.cause is Cause.HANG
    # the silence brings polls every half bound; the one at 1.5 s after the last byte decides
    assert last + 1.5 <= h.clock.t <= last + 1.5 + 0.5, h.clock.t - last
    (hung,) = h.log.named("hang_detected")
    assert hung["bound_seconds"] == 1.5


def test_streams_flowing_cost_no_polls_and_no_spin() -> None:
    # the silence deadline moves with every byte: the loop wakes at most every half bound,
    # and no poll is sent before the regular one
    front = FakeFront()
    h = fast_hang(front)
    stream(h, front, 5.2)  # past the regular poll after READY
    h.probe.tokens_per_metrics = 1.0  # from here the counter counts the /metrics reads
    reads = h.probe.tokens
    waits = []
    for _ in range(60):  # 3 s, less than poll_interval
        front.bytes += 10
        front.last_byte_at = h.clock.t
        h.step(0.05)
        waits.append(h.sup.next_wakeup(h.clock.t))
    assert min(waits) > 0.0 and h.sup.state is State.READY
    assert h.probe.tokens - reads <= 1  # at most the regular poll


def test_a_request_vllm_has_not_scheduled_is_not_a_fast_hang() -> None:
    # a tokenizer-heavy request: at the front, not in vLLM's gauges; no answer byte for 10 s
    front = FakeFront()
    h = fast_hang(front)
    front.in_flight = 1
    front.last_byte_at = h.clock.t
    h.probe.running = 0.0
    h.step(0.25, n=40)
    assert h.sup.state in (State.READY, State.DEGRADED) and not h.log.named("hang_detected")


def test_the_bound_follows_the_fronts_longest_gap() -> None:
    # the front relayed a stream with 2 s between two chunks (a heavy prefill beside it):
    # a 2 s silence is a step, not a hang; 3 x 2 s is
    front = FakeFront()
    h = fast_hang(front)
    front.longest_gap = 2.0
    stream(h, front, 6.0)
    last = front.last_byte_at
    assert last is not None
    h.step(0.05, n=int(5.0 / 0.05))
    assert h.sup.state is not State.RESTARTING and not h.log.named("hang_detected")
    h.run_until(State.RESTARTING, dt=0.05, limit=100)
    (hung,) = h.log.named("hang_detected")
    assert hung["bound_seconds"] == 6.0 and hung["longest_gap_seconds"] == 2.0
    assert last + 6.0 <= h.clock.t <= last + 6.0 + 3.5, h.clock.t - last


def test_the_hang_bound_shows_in_status_and_metrics() -> None:
    from qwen4090.surfaces import httpapi

    front = FakeFront()
    h = fast_hang(front)
    front.longest_gap = 0.8
    stream(h, front, 0.5)
    h.step(6.0)  # a regular poll takes the front's gap
    doc = h.sup.snapshot()["hang"]
    assert doc["bound_seconds"] == pytest.approx(2.4) and doc["hang_timeout"] == 60.0
    assert doc["longest_gap_seconds"] == 0.8 and doc["floor"] == 1.5
    (fam,) = [m for m in httpapi.metric_families(h.sup.snapshot())
              if m.name == "qwen4090_hang_bound_seconds"]
    assert fam.samples[0].value == pytest.approx(2.4)


def test_short_requests_on_a_stopped_engine_whose_gauge_reads_zero_are_a_fast_hang() -> None:
    # H100, 2026-12-06: two clients of short requests back to back, the EngineCore SIGSTOPped;
    # vLLM's running gauge read 0 (its last step had just finished the batch), so the fast
    # verdict never came and the canary ended it after 60 s.  The front knows better: small
    # requests it sent are the engine's, whatever the gauge says
    front = FakeFront()
    h = fast_hang(front)
    front.in_flight, front.at_engine = 2, 2
    for _ in range(100):  # 5 s of answers
        front.bytes += 10
        front.last_byte_at = h.clock.t
        h.step(0.05)
    last = front.last_byte_at
    assert last is not None and h.probe.running == 0.0
    h.run_until(State.RESTARTING, dt=0.05, limit=200)
    assert h.failure.cause is Cause.HANG
    assert last + 1.5 <= h.clock.t <= last + 1.5 + 0.5, h.clock.t - last
