"""Issue 20: faults that clients do not see.  One real supervisor, its front on the client port
and the real CPU vLLM behind it, under a steady load of short requests (and a few long
streams) while the EngineCore is SIGKILLed, while it is SIGSTOPped (a hang), and across a
[vllm] reload: no client is refused, no request that arrived during the restart fails, the
unstarted ones are answered after a replay, and a stream that had started ends with the
error event.  Each test records what the clients saw (``record``) for docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.support.clients import record
from tests.support.daemon import Daemon
from tests.support.load import CLIENTS, Load, stream_endings, summary
from tests.support.runtime import cpu_config, free_port, on_one_core, write_toml

START_TIMEOUT = 240.0
RESTART_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("front")
    port = free_port()
    cfg = write_toml(tmp / "qwen4090.toml", on_one_core(cpu_config(
        port, front={"enabled": True, "engine_port": free_port(), "hold_timeout": 150.0},
        watch={"poll_interval": 1.0, "hang_timeout": 8.0, "canary_interval": 5.0,
               "canary_timeout": 10.0, "unhealthy_timeout": 15.0})))
    (tmp / "conf.d").mkdir()
    d = Daemon(cfg, tmp, port=port, log_path=tmp / "daemon.log")
    yield d
    d.close()


def restarted(d: Daemon, mark: int) -> dict[str, Any]:
    d.wait_event("state_changed", 60, after=mark, to="restarting")
    return d.wait_event("state_changed", RESTART_TIMEOUT, after=mark, to="ready")


def test_ready_behind_the_front(daemon: Daemon) -> None:
    daemon.wait_state("ready", START_TIMEOUT)
    listening = daemon.event("front_listening")
    assert listening is not None and listening["url"].endswith(f":{daemon.port}")
    # vLLM itself is not on the client port
    spawned = daemon.event("child_spawned")
    assert spawned is not None and f"--port {daemon.port} " not in spawned["argv"] + " "


def check_fault(daemon: Daemon, fault: str, inject: Any, streams: int,
                streams_cut: bool = True) -> None:
    """``streams_cut``: the fault ends the streams in flight (a SIGKILL); a hung engine is
    continued when its group is stopped and may finish them in its last seconds."""
    load = Load(daemon.port, streams=streams).start()
    try:
        load.wait_streaming()  # the long streams are under way (2000 tokens: seconds more)
        mark = daemon.mark()
        fault_at = time.monotonic()
        inject()
        ready = restarted(daemon, mark)
        time.sleep(3.0)  # served again for a while, and at least until a client's request
        # sent after the fault is answered: the replays on a fresh CPU engine may take longer
        # than 3 s (a fresh-clone CI run: none within them after a hang, 9 requests in all)
        end = time.monotonic() + 60.0
        while time.monotonic() < end and not any(
                not o.stream and o.sent >= fault_at for o in list(load.outcomes)):
            time.sleep(0.2)
    finally:
        load.abandon()  # a failure here must not leave its clients loading the next tests
    outcomes = load.finish()
    s = summary(outcomes, fault_at)
    endings = stream_endings(outcomes)
    released = daemon.event("front_released", after=mark)
    record(f"front_{fault}", ready["_t"] - fault_at, **s, streams=endings,
           front_released={k: v for k, v in (released or {}).items()
                           if not k.startswith("_")})
    assert s["refused_or_reset"] == 0, s
    assert s["not_200"] == 0, s  # held, or replayed: answered
    assert s["sent_after_fault"] > 0 and s["requests"] > 2 * CLIENTS, s
    assert released is not None and released["held"] > 0, released
    assert all(e in ("done", "error event") for e in endings), endings  # never a silent cut
    # a stream still open at the fault ends with the error event (vLLM's or the front's)
    open_then = [e for o, e in zip([o for o in outcomes if o.stream], endings, strict=True)
                 if o.ended > fault_at]
    assert len(open_then) == streams, (endings, open_then)
    if streams_cut:
        assert open_then.count("error event") == streams, (endings, open_then)


def test_engine_sigkill_under_load_is_a_blip(daemon: Daemon) -> None:
    engine = daemon.engine_core()
    check_fault(daemon, "engine_sigkill", lambda: os.kill(engine.pid, signal.SIGKILL),
                streams=2)
    replayed = daemon.event("front_released", after=0)
    assert replayed is not None


def test_hung_engine_under_load_is_a_blip(daemon: Daemon) -> None:
    engine = daemon.engine_core()
    check_fault(daemon, "engine_sigstop", lambda: os.kill(engine.pid, signal.SIGSTOP),
                streams=1, streams_cut=False)
    hang = daemon.event("hang_detected")
    canary = daemon.event("canary_failed")
    assert hang is not None or canary is not None


def test_vllm_reload_under_load_is_a_blip(daemon: Daemon) -> None:
    drop = daemon.tmp / "conf.d" / "50-seqs.toml"
    drop.write_text("[vllm]\nmax_num_seqs = 6\n")
    check_fault(daemon, "vllm_reload", lambda: daemon.signal(signal.SIGHUP), streams=0)
    assert daemon.event("restart_for_reload") is not None


def test_sigterm_drains_through_the_front(daemon: Daemon) -> None:
    load = Load(daemon.port, streams=0).start()
    try:
        time.sleep(2.0)
        mark = daemon.mark()
        stop_at = time.monotonic()
        daemon.signal(signal.SIGTERM)
        drained = daemon.wait_event("drained", 60, after=mark)
    finally:
        load.abandon()
    outcomes = load.finish(60)
    assert daemon.wait_exit(60) == 0
    assert drained["busy"] is False and drained["in_flight"] == 0, drained
    # those taken before the stop were answered; later ones were refused at the door
    taken = [o for o in outcomes if o.sent < stop_at - 0.5]
    assert taken and all(o.status == 200 for o in taken), summary(outcomes, stop_at)
    assert daemon.event("front_draining", after=mark) is not None
