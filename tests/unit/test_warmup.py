from __future__ import annotations

from typing import Any

from qwen4090.decide.policy import WARMUP_JOIN_GRACE, warmup_bound
from qwen4090.engine import warmup
from qwen4090.probes.http import (
    GENERATION_TOKENS,
    RUNNING,
    WAITING,
    CompletionResult,
    MetricsResult,
)
from qwen4090.settings.config import from_dict


def test_steps_are_capped_by_context_and_seqs() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 2048, "max_num_seqs": 8,
                              "max_num_batched_tokens": 1024},
                     "warmup": {"lengths": [1, 16, 1024, 2048, 4096], "concurrency": [1, 4, 8, 32],
                                "max_tokens": 4}})
    steps, skipped = warmup.plan_steps(cfg)
    assert [(s.length, s.concurrency) for s in steps] == [
        (1, 1), (16, 1), (1024, 1), (256, 4), (256, 8)]
    assert any("2048" in s for s in skipped) and any("32" in s for s in skipped)


class FakeProbe:
    """Completions answered at once (TTFT: a millisecond per prompt token); /metrics with a
    token counter that grows by ``tokens_per_look`` at each look, and clients' gauges."""

    def __init__(self, fail_at: int | None = None, timeout_at: int | None = None,
                 tokens_per_look: float = 0.0, waiting: float = 0.0, running: float = 0.0):
        self.prompts: list[int] = []
        self.timeouts: list[float] = []
        self.fail_at = fail_at
        self.timeout_at = timeout_at  # prompts of this length time out
        self.tokens = 0.0
        self.tokens_per_look = tokens_per_look
        self.waiting, self.running = waiting, running
        self.metrics_ok = True

    def metrics(self, timeout: float) -> MetricsResult:
        if not self.metrics_ok:
            return MetricsResult(False, error="connection refused")
        self.tokens += self.tokens_per_look
        return MetricsResult(True, {GENERATION_TOKENS: self.tokens, RUNNING: self.running,
                                    WAITING: self.waiting})

    def complete(self, prompt: Any, max_tokens: int, timeout: float) -> Any:
        self.prompts.append(len(prompt))
        self.timeouts.append(timeout)
        if self.fail_at is not None and len(prompt) == self.fail_at:
            return CompletionResult(False, None, 0.1, 0, "HTTP 500: boom")
        if self.timeout_at is not None and len(prompt) == self.timeout_at:
            return CompletionResult(False, None, timeout, 0,
                                    f"no end of stream within {timeout:g}s", timed_out=True)
        return CompletionResult(True, len(prompt) / 1000, 0.2, max_tokens)


def test_run_sends_exact_lengths_and_tabulates() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 4096, "max_num_seqs": 8,
                              "max_num_batched_tokens": 1024},
                     "warmup": {"lengths": [1, 256, 1024], "concurrency": [1, 4]}})
    probe = FakeProbe()
    res = warmup.run(cfg, probe, seed=0)  # type: ignore[arg-type]
    assert res.ok
    assert sorted(probe.prompts) == sorted([1, 256, 1024] + [256] * 4)
    assert res.ttft_at(1024) == 1024.0
    assert res.ttft_near(1000) == (1024, 1024.0)
    assert "1024:1024ms" in res.table() and "x4:" in res.table()


def test_run_fails_on_first_bad_request() -> None:
    cfg = from_dict({"warmup": {"lengths": [1, 16, 256], "concurrency": [1]}})
    res = warmup.run(cfg, FakeProbe(fail_at=16), seed=0)  # type: ignore[arg-type]
    assert not res.ok and "16 tokens" in res.error and "boom" in res.error
    assert [r.length for r in res.rows] == [1]


# --- issue 18.4: a warmup queued behind clients' requests ------------------------------------

BUSY: dict[str, dict[str, Any]] = {"vllm": {"max_model_len": 4096, "max_num_batched_tokens": 4096},
        "warmup": {"lengths": [1, 16, 256], "concurrency": [1, 4], "request_timeout": 120.0},
        "watch": {"hang_timeout": 20.0, "poll_interval": 1.0}}


def test_a_request_timed_out_while_the_tokens_moved_ends_the_warmup_ok_cut_short() -> None:
    probe = FakeProbe(timeout_at=1, tokens_per_look=500.0, waiting=24.0, running=8.0)
    res = warmup.run(from_dict(BUSY), probe, seed=0)  # type: ignore[arg-type]
    assert res.ok, res.error
    assert res.cut_short.startswith("engine busy with client requests: 500 tokens generated "
                                    "meanwhile (8 running, 24 waiting)"), res.cut_short
    assert probe.prompts == [1]  # the rest was not sent
    assert [s for s in res.skipped if "cut short" in s] == [
        "1 tokens x1 (warmup cut short: engine busy)", "16 tokens x1 (warmup cut short: "
        "engine busy)", "256 tokens x1 (warmup cut short: engine busy)",
        "4092 tokens x1 (warmup cut short: engine busy)",
        "256 tokens x4 (warmup cut short: engine busy)"]
    assert res.longest_step is None  # not measured: the last value on disk stays
    # clients were queued at the step's start: it waited hang_timeout, not request_timeout
    assert probe.timeouts == [20.0]


def test_without_clients_queued_a_request_may_wait_request_timeout() -> None:
    probe = FakeProbe(timeout_at=16, tokens_per_look=500.0)
    res = warmup.run(from_dict(BUSY), probe, seed=0)  # type: ignore[arg-type]
    assert res.ok and res.cut_short and [r.length for r in res.rows] == [1]
    assert probe.timeouts == [120.0, 120.0]


def test_a_timeout_with_the_tokens_flat_is_a_failed_warmup() -> None:
    probe = FakeProbe(timeout_at=1, tokens_per_look=0.0, waiting=24.0)
    res = warmup.run(from_dict(BUSY), probe, seed=0)  # type: ignore[arg-type]
    assert not res.ok and not res.cut_short and "no end of stream within 20s" in res.error


def test_a_timeout_with_metrics_unreadable_is_a_failed_warmup() -> None:
    probe = FakeProbe(timeout_at=1, tokens_per_look=500.0)
    probe.metrics_ok = False
    res = warmup.run(from_dict(BUSY), probe, seed=0)  # type: ignore[arg-type]
    assert not res.ok and not res.cut_short


def test_an_error_answer_fails_even_while_the_tokens_move() -> None:
    probe = FakeProbe(fail_at=16, tokens_per_look=500.0, waiting=3.0)
    res = warmup.run(from_dict(BUSY), probe, seed=0)  # type: ignore[arg-type]
    assert not res.ok and "boom" in res.error and not res.cut_short


class StepClock:
    """A clock the test's completions move."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_warmup_deadline_with_clients_served_is_cut_short_without_is_a_failure() -> None:
    for clients, ok in ((4.0, True), (0.0, False)):
        clock = StepClock()
        probe = FakeProbe(tokens_per_look=100.0, running=clients)
        done = probe.complete

        def slow(prompt: Any, max_tokens: int, timeout: float, done: Any = done,
                 clock: StepClock = clock) -> Any:
            clock.t += 70.0
            return done(prompt, max_tokens, timeout)

        probe.complete = slow  # type: ignore[method-assign]
        cfg = from_dict({**BUSY, "warmup": {**BUSY["warmup"], "timeout": 100.0,
                                                     "request_timeout": 60.0}})
        res = warmup.run(cfg, probe, clock=clock, seed=0)  # type: ignore[arg-type]
        assert res.ok is ok, res
        assert [r.length for r in res.rows] == [1, 16]
        if ok:
            assert "warmup.timeout (100s) reached while the engine serves clients" \
                in res.cut_short
        else:
            assert "warmup.timeout (100s)" in res.error


# --- issue 18.5: the longest engine step --------------------------------------------------


def test_the_longest_step_is_a_prefill_of_max_num_batched_tokens() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 2048, "max_num_batched_tokens": 2048},
                     "warmup": {"lengths": [1, 256], "concurrency": [1], "max_tokens": 4}})
    assert warmup.step_length(cfg) == 2044  # capped below max_model_len
    steps, _ = warmup.plan_steps(cfg)
    assert [s.length for s in steps] == [1, 256, 2044]  # added: the lengths lack it
    res = warmup.run(cfg, FakeProbe(), seed=0)  # type: ignore[arg-type]
    assert res.longest_step == (2.044, 2044)


def test_without_chunked_prefill_the_longest_prompt_sent_is_the_longest_step() -> None:
    for vllm in ({"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
                 {"max_num_batched_tokens": "auto"}):
        cfg = from_dict({"vllm": {"max_model_len": 4096, **vllm},
                         "warmup": {"lengths": [1, 256, 1024], "concurrency": [1, 4]}})
        assert warmup.step_length(cfg) is None
        assert [s.length for s in warmup.plan_steps(cfg)[0]] == [1, 256, 1024, 256]
        res = warmup.run(cfg, FakeProbe(), seed=0)  # type: ignore[arg-type]
        assert res.longest_step == (1.024, 1024)


def test_the_supervisors_warming_limit_is_above_what_the_warmup_can_take() -> None:
    cfg = from_dict({"warmup": {"timeout": 60.0, "request_timeout": 10.0},
                     "watch": {"health_timeout": 2.0}})
    # a step starts before warmup.timeout, waits request_timeout, its threads the join grace more,
    # and the warmup looks at /metrics twice around it
    assert warmup_bound(cfg) >= 60.0 + 10.0 + WARMUP_JOIN_GRACE + 2 * 2.0
