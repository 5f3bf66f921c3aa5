"""The start-up and recovery timelines: vLLM's real lines (captured, in data/) and the events."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.fakes import Clock, Log

from qwen4090.base.events import ChildExitSeen, HangSeen, Restarted, Transition
from qwen4090.base.states import State
from qwen4090.base.vllmfacts import match_line
from qwen4090.commandline import cli
from qwen4090.engine.timeline import MARKS, StartupTimeline, TimelineWatch
from qwen4090.parts.contracts import Published
from qwen4090.settings.config import from_dict

DATA = Path(__file__).parent / "data"


def sample(name: str) -> list[tuple[float, str, str]]:
    """A captured log: (seconds since launch, stream, line)."""
    out = []
    for raw in (DATA / f"vllm_startup_{name}.log").read_text(encoding="utf-8").splitlines():
        if raw.startswith("#"):
            continue
        t, stream, line = raw.split("\t", 2)
        out.append((float(t), stream, line))
    return out


def fed(name: str) -> StartupTimeline:
    tl = StartupTimeline(0.0)
    for t, stream, line in sample(name):
        tl.feed(line, t, stream)
    return tl


def in_mark_order(at: dict[str, float]) -> bool:
    ranks = [MARKS.index(k) for k in at]
    return ranks == sorted(ranks) and list(at.values()) == sorted(at.values())


# --- the matcher on real lines ------------------------------------------------------------------


def test_cpu_eager_start_real_lines() -> None:
    tl = fed("cpu032_eager")
    at = tl.seconds()
    assert list(at) == ["spawn", "first_output", "api_up", "engine_up", "weights_loaded",
                        "kv_sized", "engine_ready", "api_listening"]
    assert in_mark_order(at)
    assert at["engine_up"] == 25.722  # "(EngineCore pid=6770) ... Initializing a V1 LLM engine"
    assert at["kv_sized"] == 39.167
    assert tl.kv_tokens == 1_048_576  # "CPU KV cache size: 1,048,576 tokens"
    assert tl.kv_bytes == 1024 ** 3  # "Explicitly set (1.0/10.46) GiB for KV cache"
    assert tl.compile_cache is None  # --enforce-eager: nothing compiled


def test_cpu_compiled_start_real_lines() -> None:
    tl = fed("cpu032_compile")
    at = tl.seconds()
    assert "compiled" in at and at["weights_loaded"] < at["compiled"] <= at["kv_sized"]
    assert at["compiled"] == 64.349  # "Warming up done."
    assert in_mark_order(at)
    assert tl.compile_cache == "miss"  # "saved AOT compiled function to ..."


def test_gpu_026_start_quoted_lines() -> None:
    tl = fed("gpu026_quoted")
    at = tl.seconds()
    assert in_mark_order(at)
    assert set(MARKS) - set(at) == {"health", "ready"}  # ours, not vLLM's
    assert tl.kv_tokens == 650_560
    assert tl.kv_bytes == int(99.27 * 1024 ** 3)
    assert tl.compile_cache == "miss"
    assert tl.phases()["compiled"] == pytest.approx(31.6)


@pytest.mark.parametrize(("line", "field", "value"), [
    ("(EngineCore_DP0 pid=9) INFO 11-30 14:03:06 [backends.py:293] Directly load the compiled "
     "graph(s) for compile range (1, 8192) from the cache, took 2.171 s", "compile_cache", "hit"),
    ("(Worker pid=7) WARNING 12-01 09:30:01 [decorators.py:333] [backbone] Compiling model again "
     "due to a load failure from /c/model, reason: boom", "compile_cache", "miss"),
    ("(EngineCore pid=9) INFO 11-30 14:03:06 [gpu_worker.py:478] Initial free memory 139.2 GiB,"
     " reserved 4.6 GiB memory for KV Cache as specified by kv_cache_memory_bytes config and "
     "skipped memory profiling.", "kv_bytes", int(4.6 * 1024 ** 3)),
    ("(EngineCore pid=9) INFO 11-30 14:03:06 [gpu_worker.py:560] Available KV cache memory: "
     "-14.83 GiB", "kv_bytes", None),
    ("(APIServer pid=6564) ERROR 12-01 08:50:11 [async_llm.py:906] vllm.v1.engine.exceptions."
     "EngineDeadError: EngineCore encountered an issue.", "error", True),
    ("(EngineCore pid=9) INFO 11-30 14:03:06 [model_runner.py:306] Model loading took 15.9 GiB "
     "and 1.965324 seconds", "mark", "weights_loaded"),
])
def test_single_lines(line: str, field: str, value: Any) -> None:
    assert getattr(match_line(line), field) == value


def test_a_later_loading_line_moves_the_mark_but_kv_keeps_the_first() -> None:
    tl = StartupTimeline(0.0)
    tl.feed("(Worker pid=1) INFO 12-01 08:50:07 [base_loader.py:82] Initializing model took "
            "0.15 seconds", 5.0)
    tl.feed("(Worker pid=1) INFO 12-01 08:50:09 [default_loader.py:431] Loading weights took "
            "2.00 seconds", 7.0)
    tl.feed("(EngineCore pid=2) INFO 12-01 08:50:10 [kv_cache_utils.py:2177] GPU KV cache "
            "size: 100 tokens", 8.0)
    tl.feed("(EngineCore pid=2) INFO 12-01 08:50:10 [kv_cache_utils.py:2177] GPU KV cache "
            "size: 200 tokens", 9.0)
    assert tl.seconds()["weights_loaded"] == 7.0
    assert (tl.kv_tokens, tl.seconds()["kv_sized"]) == (100, 8.0)


# --- the watch: events in, events/histograms/status out ------------------------------------------


def tr(w: TimelineWatch, src: str, dst: str, reason: str = "") -> None:
    w(Transition(State(src), State(dst), reason))


def start(w: TimelineWatch, clock: Clock, name: str = "cpu032_eager",
          src: str = "preflight") -> None:
    """One start as the supervisor and the child would drive the watch."""
    tr(w, src, "starting", "spawned")
    t0 = clock.t
    first = True
    for t, stream, line in sample(name):
        clock.t = t0 + t
        w.on_line(stream, line)
        if first:
            tr(w, "starting", "loading")
            first = False
    clock.t += 0.4
    tr(w, "loading", "warming", "/health answered 200")
    clock.t += 2.0
    tr(w, "warming", "ready", "warmed up")


def histogram(reg: CollectorRegistry, name: str) -> dict[str, float]:
    """phase -> count of observations"""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_count"):
                    out[s.labels["phase"]] = s.value
    return out


def test_a_start_logs_one_startup_timeline_and_fills_the_histogram() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock, wall=lambda: 1.7e9)
    reg = CollectorRegistry()
    w.register(reg)
    start(w, clock)
    (ev,) = log.named("startup_timeline")
    assert ev["outcome"] == "ready"
    assert in_mark_order(ev["at"])
    assert list(ev["at"])[-2:] == ["health", "ready"]
    assert ev["took"]["ready"] == 2.0  # health -> READY: the warmup
    assert ev["kv_tokens"] == 1_048_576
    assert ev["summary"].startswith("spawn=0 first_output=6.702")
    counts = histogram(reg, "qwen4090_startup_phase_seconds")
    assert counts["engine_up"] == 1 and counts["total"] == 1 and counts["ready"] == 1
    assert {**w.status()["startup_timeline"], "summary": ev["summary"]} == ev
    assert not log.named("recovery_timeline")  # a first start is not a recovery


def test_a_failed_start_is_logged_but_not_observed() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock)
    reg = CollectorRegistry()
    w.register(reg)
    tr(w, "preflight", "starting")
    clock.t += 3
    w.on_line("stdout", "(APIServer pid=1) INFO 12-01 08:49:35 [api_utils.py:286] non-default "
                        "args: {}")
    clock.t += 5
    tr(w, "starting", "restarting", "crash: exit 1")
    (ev,) = log.named("startup_timeline")
    assert (ev["outcome"], ev["reason"], ev["at"]["api_up"]) == ("failed", "crash: exit 1", 3.0)
    assert histogram(reg, "qwen4090_startup_phase_seconds") == {}


def test_a_crash_logs_a_recovery_timeline_from_vllms_first_error_line() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock, wall=lambda: 1.7e9)
    reg = CollectorRegistry()
    w.register(reg)
    start(w, clock)
    clock.t += 50
    fault = clock.t
    w.on_line("stdout", "(APIServer pid=6564) ERROR 12-01 08:50:11 [async_llm.py:906] AsyncLLM "
                        "output_handler failed.")
    clock.t += 0.3
    tr(w, "ready", "restarting", "exit_0: vLLM exited with code 0")
    clock.t += 1.2
    w(Restarted("exit_0", True))
    clock.t += 0.5
    tr(w, "restarting", "preflight", "restart 1")
    start(w, clock)
    (rec,) = log.named("recovery_timeline")
    assert rec["fault_source"] == "vllm_error_line"
    assert rec["cause"] == "exit_0"
    assert list(rec["at"]) == ["fault", "detected", "group_gone", "relaunched", "ready"]
    assert rec["at"]["detected"] == pytest.approx(0.3)
    assert rec["took"]["stop"] == pytest.approx(1.2)
    assert rec["took"]["backoff"] == pytest.approx(0.5)
    assert rec["total"] == pytest.approx(clock.t - fault)
    assert rec["detected_wall"] == 1.7e9
    assert len(log.named("startup_timeline")) == 2
    counts = histogram(reg, "qwen4090_recovery_phase_seconds")
    assert counts == {"detect": 1, "stop": 1, "backoff": 1, "start": 1, "total": 1}


def test_a_hang_starts_at_the_last_token_progress_and_retries_count_as_one_recovery() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock)
    start(w, clock)
    clock.t += 100
    w(HangSeen(15.0))
    tr(w, "ready", "restarting", "hang: no progress")
    w(Restarted("hang", True))
    tr(w, "restarting", "preflight")
    tr(w, "preflight", "starting")
    clock.t += 5
    tr(w, "starting", "restarting", "crash: exit 1")  # the first relaunch fails
    tr(w, "restarting", "preflight")
    start(w, clock)
    (rec,) = log.named("recovery_timeline")
    assert rec["fault_source"] == "last_token_progress"
    assert rec["at"]["detected"] == 15.0
    assert rec["attempts"] == 2
    assert rec["cause"] == "hang"


def test_an_exit_seen_by_the_loop_is_the_fault_when_vllm_said_nothing() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock)
    start(w, clock)
    clock.t += 10
    w(ChildExitSeen(-9))
    clock.t += 4.0  # reap() waits for vLLM's output before it fails the child
    tr(w, "ready", "restarting", "signal: SIGKILL")
    start(w, clock, src="restarting")
    (rec,) = log.named("recovery_timeline")
    assert (rec["fault_source"], rec["took"]["detect"]) == ("child_exit_seen", 4.0)


def test_a_stop_before_ready_drops_the_recovery() -> None:
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock)
    start(w, clock)
    tr(w, "ready", "restarting", "crash")
    tr(w, "restarting", "stopping", "SIGTERM")
    assert w.recovery is None and not log.named("recovery_timeline")


# --- /status and /metrics of the real endpoint ---------------------------------------------------


class _Parts:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.wall = lambda: 1.7e9
        self.listeners: list[Any] = []


class _Sup:
    def __init__(self, port: int, clock: Clock) -> None:
        self.cfg = from_dict({"status": {"port": port, "host": "127.0.0.1"}})
        self.last_metrics = None
        self.p = _Parts(clock)

    @property
    def published(self) -> Published:
        return Published(self.snapshot(), self.cfg, self.last_metrics, 0.0)

    def snapshot(self) -> dict[str, Any]:
        return {"state": "ready", "state_reason": "warmed up", "state_seconds": 1.0,
                "model": "tiny"}


def test_status_and_metrics_show_the_timelines() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock, log = Clock(100.0), Log()
    w = TimelineWatch(log, clock=clock)
    api = cli.start_status(_Sup(port, clock), log, sources=[w])
    try:
        start(w, clock)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/status")
        doc = json.loads(conn.getresponse().read())
        assert doc["startup_timeline"]["outcome"] == "ready"
        assert doc["recovery_timeline"] is None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert 'qwen4090_startup_phase_seconds_count{phase="kv_sized"} 1.0' in text
    finally:
        api.stop()
