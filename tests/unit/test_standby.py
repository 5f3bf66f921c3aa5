"""The standby engine (issue 21) in the state machine: fake clock, fake children and probes
(one probe per engine port, as the real ones are), no processes.  The same failover runs on
the CPU vLLM in tests/integration/test_standby.py."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from test_supervisor import Harness, measured, warm_ok
from tests.support.fakes import FakeChild, FakeFront, FakeProbe

from qwen4090.base.events import Event, StandbyWoken, Transition
from qwen4090.base.states import State
from qwen4090.base.steering import Serve
from qwen4090.decide.results import CompletionResult, HealthResult, PortOwner
from qwen4090.launching.launchvalue import Launch
from qwen4090.running.standby import SLEEP_TIMEOUT, Failover, Phase, Step

S = State
ENGINE = 18000  # front.engine_port: the serving engine's first port; the standby's is + 1


class StandbyHarness(Harness):
    def __init__(self, mode: str, raw: dict[str, Any] | None = None,
                 warmup: Any = warm_ok) -> None:
        self.probes: dict[int, FakeProbe] = {}
        self.ports: dict[int, int] = {}  # child pid -> the port it was launched on
        self.events: list[Event] = []
        self.front = FakeFront()
        self.front.draining = False
        base: dict[str, dict[str, Any]] = {
            "restart": {"standby": mode, "standby_quiet": 5.0, "wake_timeout": 10.0},
                "front": {"enabled": True, "engine_port": ENGINE}}
        for k, v in (raw or {}).items():
            base.setdefault(k, {}).update(v)
        super().__init__(base, warmup=warmup, front=self.front)
        self.sup.p.make_probe = self.make_probe
        self.sup.keeper.make_probe = self.make_probe
        self.sup.p.listeners.append(self.events.append)

    def make_probe(self, chosen: Launch) -> FakeProbe:
        return self.probes.setdefault(chosen.engine.port, FakeProbe())

    def spawn(self, launch: Launch) -> FakeChild:
        c = super().spawn(launch)
        self.ports[c.pid] = launch.engine.port
        c.lines = 1  # its first line: a standby is not stepped by run_until
        return c

    def probe_of(self, port: int) -> FakeProbe:
        return self.probes[port]

    def until(self, cond: Any, dt: float = 0.25, limit: int = 2000) -> None:
        for _ in range(limit):  # one step at least: what the test just did is seen
            self.step(dt)
            if cond():
                return
        raise AssertionError(f"never true; state {self.sup.state}, standby "
                             f"{self.sup.keeper.phase}")

    def standby_ready(self) -> None:
        self.run_until(S.READY)
        self.until(lambda: self.sup.keeper.ready and self.sup.state is S.READY)

    def moved(self) -> list[int]:
        """The ports the front was moved to: each READY names its engine (steering.Serve); a
        move is one that names another than the last (the first engine is on ENGINE)."""
        out, last = [], ENGINE
        for c in self.front.commands:
            if isinstance(c, Serve) and c.port != last:
                out.append(c.port)
                last = c.port
        return out

    def spawned_ports(self) -> list[int]:
        return [self.ports[c.pid] for c in self.children]


def test_awake_standby_is_built_beside_and_takes_over_a_crash_without_a_start() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    assert h.spawned_ports() == [ENGINE, ENGINE + 1]  # the standby on the other port
    serving, standby = h.children
    assert not h.sup.keeper.sleeps and h.probe_of(ENGINE + 1).controls == []
    serving.exit(1, ["RuntimeError: boom"])
    h.until(lambda: h.sup.state is S.READY)
    # no third vLLM: the standby serves, the front points at its port, READY again
    assert len(h.children) == 2 and h.sup.child is standby
    assert h.moved() == [ENGINE + 1]
    assert h.sup.keeper.failovers == 1 and h.sup.keeper.last_failover is not None
    assert h.sup.keeper.last_failover.ok and h.sup.keeper.last_failover.cause == "crash"
    assert [t.dst for t in h.events if isinstance(t, Transition)][-2:] == [S.RESTARTING,
                                                                           S.READY]
    assert h.sup.restarts.crashes.restarts == 1  # the fault still counts (crash-loop budget)
    assert "failover_done" in h.log.names()


def test_after_a_failover_a_new_standby_is_built_on_the_freed_port() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    h.children[0].exit(1)
    h.until(lambda: h.sup.state is S.READY and h.sup.keeper.ready)
    assert h.spawned_ports() == [ENGINE, ENGINE + 1, ENGINE]
    snap = h.sup.snapshot()["standby"]
    assert snap["ready"] and snap["port"] == ENGINE and snap["failovers"] == 1
    assert snap["rebuilds"] == 2


def test_no_build_until_the_engine_is_quiet_for_standby_quiet() -> None:
    h = StandbyHarness("awake")
    h.run_until(S.WARMING)
    h.front.in_flight = 1  # clients came while it started
    h.run_until(S.READY)
    h.probe_of(ENGINE).tokens_per_metrics = 1.0  # busy, not hung
    h.step(1.0, 30)
    assert len(h.children) == 1 and h.sup.keeper.phase is Phase.WAITING
    h.front.in_flight = 0
    h.step(1.0, 4)
    assert len(h.children) == 1  # quiet for 4 s of 5
    h.step(1.0, 3)
    assert len(h.children) == 2


def test_the_boots_first_build_waits_standby_quiet_after_ready() -> None:
    # The idle minutes of a start are no quiet moment: on the H200 under the unit the first
    # build began 1.5 ms after READY=1, and the completion sent on READY waited 50 s for it.
    h = StandbyHarness("sleep")
    h.run_until(S.READY)
    h.probe_of(ENGINE).tokens_per_metrics = 1.0  # serving, not hung
    h.step(1.0, 4)
    assert h.sup.state is S.READY and len(h.children) == 1  # READY for 4 s of 5: serving
    assert h.probe_of(ENGINE).controls == []
    h.step(1.0, 2)
    assert h.sup.state is S.REBUILDING  # 5 s without a request while READY: the build


def test_sleep_mode_build_holds_sleeps_the_serving_engine_and_wakes_it() -> None:
    h = StandbyHarness("sleep")
    h.run_until(S.READY)
    h.until(lambda: h.sup.state is S.REBUILDING)
    h.until(lambda: h.sup.state is S.READY)
    assert h.sup.keeper.ready
    # the serving engine slept while the standby started, then woke; the standby sleeps
    assert h.probe_of(ENGINE).controls == ["/sleep?level=1", "/wake_up"]
    assert h.probe_of(ENGINE + 1).controls == ["/sleep?level=1"]
    seen = [(t.src, t.dst) for t in h.events if isinstance(t, Transition)]
    assert (S.READY, S.REBUILDING) in seen and (S.REBUILDING, S.READY) in seen
    assert h.sup.launch.config.vllm.extra_args[-1] == "--enable-sleep-mode"


def test_sleep_mode_hang_wakes_the_standby_and_checks_its_known_answer() -> None:
    h = StandbyHarness("sleep")
    h.standby_ready()
    serving = h.probe_of(ENGINE)
    serving.running, serving.tokens_per_metrics = 2.0, 0.0  # requests in flight, no tokens
    h.until(lambda: h.sup.state is S.RESTARTING)
    assert h.failure.cause.value == "hang"
    h.until(lambda: h.sup.state is S.READY)
    assert h.probe_of(ENGINE + 1).controls == ["/sleep?level=1", "/wake_up"]
    assert len(h.children) == 2 and h.sup.keeper.failovers == 1
    assert any(isinstance(e, StandbyWoken) for e in h.events)
    assert h.children[0].signals[0] == signal.SIGTERM  # then SIGKILL at once: no grace
    assert signal.SIGKILL in h.children[0].signals


def test_a_wrong_answer_after_the_wake_falls_back_to_the_normal_restart() -> None:
    h = StandbyHarness("sleep")
    h.standby_ready()
    h.probe_of(ENGINE + 1).answer = "garbage after a broken wake"
    h.children[0].exit(-9)
    h.until(lambda: len(h.children) == 3)  # a fresh vLLM: the normal restart
    assert "failover_failed" in h.log.names()
    assert h.sup.keeper.failovers == 0 and h.sup.keeper.fallbacks == 1
    assert not h.children[1].alive  # the standby that answered wrong is stopped
    h.run_until(S.READY)
    assert h.sup.child is h.children[2]


def test_a_failed_wake_falls_back_to_the_normal_restart() -> None:
    h = StandbyHarness("sleep")
    h.standby_ready()
    h.probe_of(ENGINE + 1).control_ok = False
    h.children[0].exit(1)
    h.until(lambda: len(h.children) == 3)
    assert h.sup.keeper.fallbacks == 1
    assert h.log.named("failover_failed")[0]["reason"].startswith("the wake failed")


def test_an_oom_goes_to_the_ladder_not_to_the_standby() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    h.children[0].exit(1, ["torch.OutOfMemoryError: CUDA out of memory."])
    h.until(lambda: len(h.children) == 3)
    assert h.log.named("restart_scheduled")[-1]["cause"] == "oom"
    assert h.sup.keeper.failovers == 0
    assert not h.children[1].alive  # the standby had the settings that failed
    assert "standby_discarded" in h.log.names()


def test_a_standby_is_never_counted_as_serving() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    for probe in h.probes.values():  # the restarted serving engine does not come up
        probe.healthy = False
    h.children[0].exit(1, ["torch.OutOfMemoryError: CUDA out of memory."])
    h.step(0.25, 8)
    assert h.sup.state in (S.RESTARTING, S.PREFLIGHT, S.STARTING, S.LOADING)
    assert h.sup.snapshot()["state"] != "ready"  # the standby alone serves nobody


def test_standby_off_keeps_one_engine() -> None:
    h = StandbyHarness("off")
    h.run_until(S.READY)
    h.step(1.0, 60)
    assert len(h.children) == 1 and h.sup.snapshot()["standby"]["state"] == "none"
    h.children[0].exit(1)
    h.until(lambda: len(h.children) == 2)  # the normal restart


def test_a_standby_that_dies_is_rebuilt_after_a_backoff() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    h.children[1].exit(1)
    h.step(0.25, 4)
    assert h.sup.keeper.phase is Phase.WAITING and "standby_failed" in h.log.names()
    assert h.sup.state is S.READY  # serving goes on
    h.step(1.0, 20)
    assert len(h.children) == 2  # the backoff (30 s) is not over
    h.until(lambda: len(h.children) == 3)


def test_stop_stops_the_standby_too() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    h.sup.inbox.deliver(signal.SIGTERM)
    h.until(lambda: h.sup.done)
    assert not h.children[0].alive and not h.children[1].alive


def test_a_dead_engine_core_is_seen_before_vllm_says_so() -> None:
    """vLLM's own "engine core exited unexpectedly" came 2.6-2.8 s after the SIGKILL on the
    H200; the watch reads the EngineCore's /proc entry at each step while serving."""
    h = StandbyHarness("awake")
    h.standby_ready()
    h.children[0].engine_alive = False  # the API server lives on, says nothing yet
    h.step(0.25)
    assert h.sup.state is S.RESTARTING
    assert h.failure.cause.value == "engine_dead" and "EngineCore" in h.failure.detail
    assert h.log.names().index("engine_died") < h.log.names().index("vllm_failed")
    assert h.sup.next_wakeup(h.clock.t) <= 0.2 or h.sup.state is not S.READY


def test_a_standby_needs_the_front_and_a_free_port_above_the_engine_port() -> None:
    import pytest

    from qwen4090.settings.config import ConfigError, from_dict
    with pytest.raises(ConfigError, match=r"restart\.standby"):
        from_dict({"restart": {"standby": "sleep"}, "front": {"enabled": False}})
    with pytest.raises(ConfigError, match=r"front\.engine_port"):
        from_dict({"restart": {"standby": "awake"}, "vllm": {"port": 8001},
                   "front": {"engine_port": 8000}, "status": {"port": 9000}})
    assert from_dict({"restart": {"standby": "sleep"}}).restart.standby == "sleep"


def test_status_line_says_the_standby() -> None:
    h = StandbyHarness("awake")
    h.standby_ready()
    assert "standby ready" in h.sup.status_line(h.clock.t)
    h.children[0].exit(1)
    h.step(0.25)
    h.step(0.25)
    line = h.sup.status_line(h.clock.t)
    assert h.sup.state is S.READY or "failing over to the standby" in line, line


def test_a_hang_is_dated_from_the_fronts_last_answer_byte() -> None:
    """The stall starts at the front's last byte from the engine when it came after the
    previous look, not at the look that saw the tokens move (H200: up to 2 s later)."""
    from qwen4090.decide.policy import HangDetector, Progress
    h = HangDetector(15.0, 2.0)
    h.judge(100.0, Progress(2, 0, 10.0, moved_at=99.0))
    assert h.judge(102.0, Progress(2, 0, 11.0, moved_at=100.5)).stalled == 0.0
    assert h.deadline() == 115.5  # not 117.0
    assert h.judge(115.5, Progress(2, 0, 11.0, moved_at=100.5)).hung
    # a byte older than the previous look is no witness: the look's own time counts
    h2 = HangDetector(15.0, 2.0)
    h2.judge(100.0, Progress(2, 0, 10.0))
    h2.judge(102.0, Progress(2, 0, 11.0, moved_at=99.0))
    assert h2.deadline() == 117.0


def test_a_hang_right_after_ready_is_dated_from_the_last_byte_not_the_first_poll() -> None:
    """READY starts the watch over with a sample at once: a hang in the first poll interval
    after READY is timed from the front's last byte (H200, the first fault of a run: READY,
    the rebuild began before any poll, and the SIGSTOP 0.3 s after the wake was detected 1.7 s
    late, 16.7 s after the fault with hang_timeout 15)."""
    h = StandbyHarness("sleep", {"restart": {"standby_quiet": 0.1},
                                 "watch": {"poll_interval": 4.0, "hang_timeout": 10.0,
                                           "unhealthy_timeout": 8.0, "canary_interval": 0.0}})
    h.run_until(S.READY)
    # the fakes build the standby within a step once READY has been quiet for 0.1 s
    h.until(lambda: h.sup.keeper.ready and h.sup.state is S.READY, dt=0.05)
    seen = [(t.src, t.dst) for t in h.events if isinstance(t, Transition)]
    assert seen[-2:] == [(S.READY, S.REBUILDING), (S.REBUILDING, S.READY)]
    h.step(0.25, 2)
    serving = h.probe_of(ENGINE)
    h.front.in_flight, serving.running = 2, 2.0  # clients' answers come, then the engine stops
    h.front.bytes, h.front.last_byte_at = h.front.bytes + 500, h.clock.t
    fault = h.clock.t
    h.until(lambda: h.sup.state is S.RESTARTING, dt=0.05)
    assert h.clock.t - fault < 10.0 + 0.3  # not hang_timeout after a poll up to 4 s later


def test_a_takeover_of_a_hang_does_not_wait_for_vllms_last_lines() -> None:
    h = StandbyHarness("sleep")
    h.standby_ready()
    h.children[0].closed = False  # its pipes stay open (a process of the tree holds them)
    serving = h.probe_of(ENGINE)
    serving.running, serving.tokens_per_metrics = 2.0, 0.0
    h.until(lambda: h.sup.state is S.RESTARTING)
    t0 = h.clock.t
    h.until(lambda: h.sup.state is S.READY, dt=0.02)
    assert h.clock.t - t0 < 1.0  # not OUTPUT_WAIT (2 s) for the lines of a hang we ended


class HeldGpu:
    """NVML's word while the failed group's memory is being released."""

    def __init__(self, room: bool | None) -> None:
        from tests.support.fakes import CheckedGpu
        self.base = CheckedGpu()
        self.has_room = room
        self.releasing = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def held(self, device: int, pids: list[int]) -> str | None:
        return "pid 4242 (VLLM::EngineCore) 20.0 GiB" if self.releasing else None

    def room(self, device: int, fraction: float) -> bool | None:
        return self.has_room


def test_the_standby_wakes_as_soon_as_the_gpu_has_room_for_it() -> None:
    h = StandbyHarness("sleep")
    h.sup.p.gpu = HeldGpu(room=True)
    h.standby_ready()
    h.children[0].exit(1)
    h.until(lambda: h.sup.state is S.READY, dt=0.02, limit=200)
    assert "gpu_room_for_standby" in h.log.names()


def test_without_room_the_standby_waits_for_the_gpu_to_let_go() -> None:
    h = StandbyHarness("sleep", {"gpu": {"release_timeout": 30.0}})
    gpu = HeldGpu(room=None)  # NVML cannot tell
    h.sup.p.gpu = gpu
    h.standby_ready()
    h.children[0].exit(1)
    h.step(0.25, 20)
    assert h.sup.state is S.RESTARTING and h.sup.keeper.ready  # still waiting, not woken
    gpu.releasing = False
    h.until(lambda: h.sup.state is S.READY)
    assert "gpu_released" in h.log.names() and "gpu_room_for_standby" not in h.log.names()


def test_a_standby_lost_while_the_gpu_lets_go_means_the_normal_restart() -> None:
    h = StandbyHarness("sleep", {"gpu": {"release_timeout": 30.0}})
    gpu = HeldGpu(room=False)
    h.sup.p.gpu = gpu
    h.standby_ready()
    h.children[0].exit(1)
    h.step(0.25, 4)
    assert h.sup.takeover.at(Step.GPU)
    h.children[1].exit(1)  # the standby dies meanwhile
    h.step(0.25, 2)
    gpu.releasing = False
    h.until(lambda: len(h.children) == 3)  # a fresh vLLM, no crash on a missing standby
    assert h.log.named("failover_failed")[-1]["reason"].startswith("the standby was lost")


STRANGER = "pid 4242 (python3 -m http.server 18001)"


class StrangerOnStandbyPort:
    """Another program answers on front.engine_port + 1; the serving engine's port is ours."""

    def holder(self, host: str, port: int) -> str | None:
        return None

    def owner(self, child: Any, host: str, port: int) -> PortOwner:
        return PortOwner(False, STRANGER) if port == ENGINE + 1 else PortOwner(True)



def test_a_stranger_on_the_standby_port_is_never_taken_for_the_standby() -> None:
    """Its 200s are not our standby's: no standby READY, so a crash is the normal restart."""
    h = StandbyHarness("awake")
    h.sup.p.ports = StrangerOnStandbyPort()
    h.run_until(S.READY)
    h.until(lambda: len(h.children) == 2)  # the standby was started on the taken port
    h.step(1.0, 60)
    assert h.sup.state is S.READY and not h.sup.keeper.ready
    said = h.log.named("port_answered_by_stranger")
    assert said and said[0]["holder"] == STRANGER, said
    h.children[0].exit(1, ["RuntimeError: boom"])
    h.until(lambda: len(h.children) == 3)  # a fresh vLLM, not a failover to the stranger
    assert h.sup.keeper.failovers == 0 and h.moved() == []


def test_the_loops_wakeup_covers_the_standbys_deadlines() -> None:
    """Issue 29.3: next_wakeup asked only the serving run, so the standby's load timeout, the
    bound of its check or sleep, the build's steps and its kill schedules fell to the idle
    tick.  Now the keeper's row is asked too (only what is still ahead)."""
    h = StandbyHarness("awake")
    h.standby_ready()
    k, now = h.sup.keeper, h.clock.t
    h.sup.moved = False
    limit = SLEEP_TIMEOUT + h.sup.cfg.restart.wake_timeout
    k.phase, k.since = Phase.CHECKING, now  # its check answered nothing yet: bound far ahead
    without = h.sup.next_wakeup(now)
    assert without > 0.001
    k.since = now - limit + 0.001  # ... and now 1 ms before its bound
    assert h.sup.next_wakeup(now) == pytest.approx(0.001)
    k.since = now - limit - 5.0  # a passed bound is acted on by the step, never spun on
    assert h.sup.next_wakeup(now) == pytest.approx(without)


def test_the_takeover_is_one_typed_machine() -> None:
    """Issue 29.3: the failover's sub-states of RESTARTING are one Step with its allowed moves
    (they were four booleans set and reset in six places)."""
    f = Failover("crash", 10.0, since=10.0)
    with pytest.raises(ValueError, match="kill -> wake"):
        f.to(Step.WAKE, 11.0)  # the failed group must be gone first
    f.to(Step.GPU, 11.0)
    f.to(Step.WAKE, 11.5)
    f.promoted = 11.5
    assert f.waking and f.overdue(11.5 + 2 * 5.0 + 4, 5.0) == ""
    assert f.overdue(11.5 + 2 * 5.0 + 6, 5.0) == "no wake and check within 15s"
    failed = HealthResult(False, None, 5.0, "timed out")
    assert f.on_wake(12.0, failed) == "the wake failed: timed out"
    assert f.step is Step.WAKE  # a failed wake leaves the step to the caller's fall-back
    assert f.on_wake(12.0, HealthResult(True, 200, 0.1)) == "" and f.step is Step.CHECK
    f.answer = "known"
    other = CompletionResult(True, 0.1, 0.2, 8, text="other")
    assert f.on_check(other).startswith("its check: a different")
    assert f.on_check(CompletionResult(True, 0.1, 0.2, 8, text="known")) == ""
    f.ended(13.0, ok=True)
    assert f.as_json() == {"cause": "crash", "ok": True, "seconds": 3.0, "wake_seconds": 2.0,
                           "kv_tokens": None}
    f.to(Step.FALL_BACK, 13.0)
    with pytest.raises(ValueError):
        f.to(Step.GPU, 14.0)


def test_every_engine_is_a_row_of_one_table_with_its_role_and_its_own_phase() -> None:
    # issue 29.3: the serving engine, the standby and a discarded standby are rows of one
    # table; each row moves its own phase (not the daemon's state), /status lists them, and
    # the one deadline query sees the standby's load bound (its spawn + watch.load_timeout).
    h = StandbyHarness("sleep")
    h.run_until(S.READY)
    rows = h.sup.snapshot()["engines"]
    assert [(r["role"], r["phase"]) for r in rows] == [("serving", "up")]
    h.probe_of(ENGINE).tokens_per_metrics = 1.0
    h.until(lambda: h.sup.keeper.phase is Phase.LOADING)
    standby = h.sup.keeper.run
    assert standby is not None and standby.phase.value == "loading"
    assert h.sup.state is S.REBUILDING  # the daemon's state is the service's
    assert [(r["role"], r["phase"]) for r in h.sup.snapshot()["engines"]] == [
        ("serving", "held"), ("standby", "loading")]
    bound = standby.spawned_at + h.sup.cfg.watch.load_timeout
    assert bound - h.clock.t in h.sup.engines.waits(h.clock.t, h.sup.cfg.watch, serving=False)
    h.until(lambda: h.sup.keeper.ready and h.sup.state is S.READY)
    assert [(r["role"], r["phase"]) for r in h.sup.snapshot()["engines"]] == [
        ("serving", "up"), ("standby", "held")]
    # a reload that turns the standby off retires its row: killed, kept until its group is
    # gone, and its pids wait for the GPU like a failed group's
    pid = standby.child.pid
    h.sup.keeper.discard(h.clock.t, "test", 1.0)  # (as a reload to standby = "off" does)
    assert ("retiring", pid) in [(r["role"], r["pid"]) for r in h.sup.snapshot()["engines"]]
    assert pid in h.sup.engines.gpu_pids and signal.SIGKILL in h.children[-1].signals
    h.step(0.25)
    assert [r["role"] for r in h.sup.snapshot()["engines"]] == ["serving"]


def test_a_request_during_the_standbys_start_ends_the_build_and_wakes_the_serving_engine(
        ) -> None:
    # issue 30.4: a client that comes while the standby starts waited for the whole build
    # (47-55 s on the H200); now the build ends, the standby being started is stopped, the
    # serving engine wakes and checks its answer, and the build is tried again later.
    h = StandbyHarness("sleep")
    h.run_until(S.READY)
    h.probe_of(ENGINE).tokens_per_metrics = 1.0
    h.until(lambda: h.sup.keeper.run is not None)  # the serving engine slept; the standby starts
    assert h.sup.state is S.REBUILDING and h.probe_of(ENGINE).controls == ["/sleep?level=1"]
    standby = h.children[-1]
    h.front.holding = 1  # a client's request, held by the front
    held = h.clock.t
    h.until(lambda: h.sup.state is S.READY)
    assert h.clock.t - held <= 1.0  # the wake and the check: a few steps, not the build
    assert h.probe_of(ENGINE).controls == ["/sleep?level=1", "/wake_up"]
    assert signal.SIGKILL in standby.signals and not h.sup.keeper.ready
    interrupted = h.log.named("standby_build_interrupted")
    assert interrupted and interrupted[0]["step"] == "standby" and interrupted[0]["waiting"] == 1
    assert h.sup.snapshot()["standby"]["interruptions"] == 1
    h.front.holding = 0
    spawned = len(h.children)
    h.step(1.0, 25)  # quiet again, but the next try waits REBUILD_BACKOFF[0] (30 s)
    assert len(h.children) == spawned
    h.until(lambda: h.sup.keeper.ready and h.sup.state is S.READY)
    assert h.sup.keeper.interrupted_in_a_row == 0


def test_a_request_before_the_serving_engine_sleeps_ends_the_build_at_once() -> None:
    h = StandbyHarness("sleep")
    h.run_until(S.READY)
    h.probe_of(ENGINE).tokens_per_metrics = 1.0
    h.until(lambda: h.sup.state is S.REBUILDING)  # the build's drain: nothing slept yet
    h.front.holding = 1
    h.step(0.25)
    assert h.sup.state is S.READY and h.probe_of(ENGINE).controls == []
    assert len(h.children) == 1 and h.sup.keeper.build is None
    assert h.log.named("standby_build_interrupted")[0]["step"] in ("drain", "reference")


def test_a_promoted_standby_bounds_hangs_by_the_step_on_disk(tmp_path: Any) -> None:
    """A standby never runs a warmup of its own (it is warmed asleep): once it serves, its
    hang bound is the longest step measured for these settings, not the floor alone."""
    h = StandbyHarness("awake", {"gpu": {"state_directory": str(tmp_path)},
                                 "watch": {"hang_floor": 1.0, "hang_timeout": 60.0}},
                       warmup=measured(2.0))
    h.standby_ready()
    assert h.run.hang_doc()["longest_step_seconds"] == 2.0
    h.children[0].exit(1)
    h.until(lambda: h.sup.state is S.READY and h.sup.child is h.children[1])
    doc = h.run.hang_doc()
    assert doc["longest_step_seconds"] == 2.0 and doc["bound_seconds"] == 6.0
