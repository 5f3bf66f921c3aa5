"""Issue 28.5, the loop is never starved: its step times on /metrics, and the bench's reading
of the histogram (bench/loop_steps.py)."""

from __future__ import annotations

import math

import pytest
from bench import loop_steps
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.fakes import Clock, Log

from qwen4090 import cli
from qwen4090.httpapi import StatusApi, StepTimes

DEADLINE = 10.0  # seconds any wait on the test server may take (never reached when it works)


def step_family(text: str) -> dict[str, float]:
    for fam in text_string_to_metric_families(text):
        if fam.name == "qwen4090_loop_step_seconds":
            return {s.name.rsplit("_", 1)[1] + s.labels.get("le", ""): s.value
                    for s in fam.samples}
    raise AssertionError("no qwen4090_loop_step_seconds")


def test_the_step_histogram_is_on_metrics() -> None:
    api = StatusApi(lambda: {"state": "ready"}, clock=Clock(), log=Log())
    for took in (0.0004, 0.002, 0.5, 0.7, 3.0):
        api.steps.observe(took)
    fam = step_family(generate_latest(api.registry).decode())
    assert fam["bucket0.001"] == 1
    assert fam["bucket0.0025"] == 2
    assert fam["bucket0.5"] == 3  # le: a step of exactly 0.5 s is within the target
    assert fam["bucket1.0"] == 4
    assert fam["bucket+Inf"] == fam["count"] == 5
    assert fam["sum"] == pytest.approx(4.2024)


def test_step_times_need_an_infinite_last_bucket() -> None:
    with pytest.raises(ValueError):
        StepTimes((0.1, 1.0))


class OneStepSup:
    """Done after ``steps`` steps; the loop's sleep is never waited for."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.state = cli.State.READY

    @property
    def done(self) -> bool:
        return self.left == 0

    def step(self) -> None:
        self.left -= 1

    def next_wakeup(self, now: float) -> float:
        return 0.0


class Flushed:
    pending = 0

    def flush(self) -> bool:
        return True


class NoWait:
    def wait(self, timeout: float) -> None:
        pass


def test_the_loop_observes_every_step() -> None:
    api = StatusApi(lambda: {}, log=Log())
    cli.loop(OneStepSup(3), api, Flushed(), NoWait(), Log())  # type: ignore[arg-type]
    assert sum(api.steps.counts) == 3
    assert step_family(generate_latest(api.registry).decode())["count"] == 3


# --- the bench's reading of the histogram ---------------------------------------------------


def test_the_bench_reads_the_steps_of_its_window() -> None:
    api = StatusApi(lambda: {}, clock=Clock(), log=Log())
    api.steps.observe(9.0)  # before the window: not counted
    before = loop_steps.step_buckets(generate_latest(api.registry).decode())
    for took in [0.002] * 98 + [0.3, 0.8]:
        api.steps.observe(took)
    after = loop_steps.step_buckets(generate_latest(api.registry).decode())
    assert before is not None and after is not None
    s = loop_steps.summarize(before, after)
    assert s.count == 100
    assert s.over_target == 1
    assert s.max_bound == 1.0
    assert s.p50 is not None and 0.001 < s.p50 <= 0.0025
    assert s.p99 is not None and 0.25 < s.p99 <= 0.5


def test_the_bench_says_when_the_daemon_has_no_histogram() -> None:
    assert loop_steps.step_buckets("# nothing\nqwen4090_ready 1.0\n") is None


def test_quantile_of_an_empty_window_and_of_the_inf_bucket() -> None:
    assert loop_steps.quantile([(0.5, 0.0), (math.inf, 0.0)], 0.5) is None
    assert loop_steps.quantile([(0.5, 1.0), (math.inf, 4.0)], 0.99) == 0.5
