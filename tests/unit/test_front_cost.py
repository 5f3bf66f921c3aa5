"""bench/front_cost.py's pure part: percentiles, pooling rounds, the bar and the verdict."""

from __future__ import annotations

import os

import pytest
from bench import front_cost as fc


def rq(ttft_ms: float, tokens: int = 10, error: str = "") -> fc.RequestResult:
    return fc.RequestResult(ttft_ms / 1000, tokens, error)


def summary(path: str, p50: float | None, p99: float | None, tok_s: float,
            cores: float | None = None, errors: int = 0, c: int = 32) -> fc.PathSummary:
    return fc.PathSummary(path, c, 4, 100, errors, p50, p99, tok_s, [tok_s], cores)


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert fc.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5        # unsorted in, mean of middle
    assert fc.percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert fc.percentile(list(map(float, range(1, 101))), 99) == pytest.approx(99.01)
    assert fc.percentile([7.0], 99) == 7.0
    assert fc.percentile([1.0, 5.0], 0) == 1.0
    assert fc.percentile([1.0, 5.0], 100) == 5.0


def test_percentile_refuses_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        fc.percentile([], 50)
    with pytest.raises(ValueError):
        fc.percentile([1.0], 101)


def test_summarize_pools_rounds_and_leaves_failed_requests_out_of_ttft() -> None:
    r1 = fc.RoundResult("p", 2, 2.0, [rq(10), rq(20), rq(999, 3, "HTTP 502: x")], cpu_s=0.5)
    r2 = fc.RoundResult("p", 2, 3.0, [rq(30), rq(40)], cpu_s=1.0)
    s = fc.summarize([r1, r2])
    assert (s.requests, s.errors, s.rounds) == (5, 1, 2)
    assert s.ttft_p50_ms == pytest.approx(25.0)                 # 10, 20, 30, 40: not 999
    assert s.tok_per_s == pytest.approx(40 / 5.0)               # all tokens / all wall time
    assert s.round_tok_per_s == [pytest.approx(10.0), pytest.approx(20 / 3)]
    assert s.cores == pytest.approx(1.5 / 5.0)
    assert s.first_errors == ["HTTP 502: x"]


def test_summarize_direct_has_no_cores_and_mixed_rounds_are_refused() -> None:
    assert fc.summarize([fc.RoundResult("direct", 1, 1.0, [rq(5)])]).cores is None
    with pytest.raises(ValueError):
        fc.summarize([fc.RoundResult("a", 1, 1.0, [rq(5)]),
                      fc.RoundResult("a", 32, 1.0, [rq(5)])])


def test_compare_passes_inside_the_bar() -> None:
    c = fc.compare(summary("direct", 50.0, 80.0, 1000.0),
                   summary("front", 50.9, 82.9, 990.0, cores=0.99), fc.Bar())
    assert c.verdict == "PASS", c.checks
    assert c.throughput_ratio == pytest.approx(0.99)
    assert c.ttft_p50_delta_ms == pytest.approx(0.9)
    assert c.ttft_p99_delta_ms == pytest.approx(2.9)


@pytest.mark.parametrize(("proxy", "failed"), [
    (summary("front", 50.0, 80.0, 989.0, cores=0.1), "throughput"),
    (summary("front", 51.1, 80.0, 1000.0, cores=0.1), "ttft_p50"),
    (summary("front", 50.0, 83.1, 1000.0, cores=0.1), "ttft_p99"),
    (summary("front", 50.0, 80.0, 1000.0, cores=1.0), "cores"),        # "under one core"
    (summary("front", 50.0, 80.0, 1000.0, cores=None), "cores"),       # not measured: a miss
    (summary("front", None, None, 1000.0, cores=0.1), "ttft_p50"),     # no TTFT at all
    (summary("front", 50.0, 80.0, 1000.0, cores=0.1, errors=1), "no_errors"),
])
def test_compare_misses_on_each_check_alone(proxy: fc.PathSummary, failed: str) -> None:
    c = fc.compare(summary("direct", 50.0, 80.0, 1000.0), proxy, fc.Bar())
    assert c.verdict == "MISS"
    assert [k for k, ok in c.checks.items() if not ok] == (
        [failed] if proxy.ttft_p50_ms is not None else ["ttft_p50", "ttft_p99"])


def test_compare_without_direct_throughput_is_a_miss_not_a_division_error() -> None:
    c = fc.compare(summary("direct", 50.0, 80.0, 0.0), summary("f", 50.0, 80.0, 10.0, 0.1),
                   fc.Bar())
    assert c.throughput_ratio is None and not c.checks["throughput"] and c.verdict == "MISS"


def test_abba_order_alternates_so_drift_hits_every_path_alike() -> None:
    assert fc.abba_order(["direct", "a", "b"], 3) == [
        "direct", "a", "b", "b", "a", "direct", "direct", "a", "b"]


def test_table_names_the_failed_checks() -> None:
    d, p = summary("direct", 50.0, 80.0, 1000.0), summary("front", 55.0, 80.0, 1000.0, 0.2)
    text = fc.render_table([d, p], [fc.compare(d, p, fc.Bar())], fc.Bar())
    assert "| 32 | front |" in text and "MISS (ttft_p50)" in text


def test_requests_per_level_one_value_or_one_each() -> None:
    base = ["--engine", "http://127.0.0.1:1", "--model", "m", "--proxy", "f", "127.0.0.1:2", "1"]
    assert fc.parse_args([*base, "--requests", "64"]).requests == [64, 64]
    assert fc.parse_args([*base, "--requests", "8", "64"]).requests == [8, 64]
    with pytest.raises(SystemExit):
        fc.parse_args([*base, "--requests", "8", "64", "3"])
    with pytest.raises(SystemExit):
        fc.parse_args([*base, "--requests", "8", "16"])           # fewer than c=32


def test_tree_cpu_seconds_reads_this_process() -> None:
    t0 = fc.tree_cpu_seconds(os.getpid())
    deadline = fc.time.process_time() + 0.05
    while fc.time.process_time() < deadline:
        pass
    assert fc.tree_cpu_seconds(os.getpid()) > t0
    with pytest.raises(ProcessLookupError):
        fc.tree_cpu_seconds(2**22 + 1)      # above pid_max's ceiling: never a process


def test_the_control_row_has_no_cpu_to_check() -> None:
    c = fc.compare(summary("direct", 50.0, 80.0, 1000.0),
                   summary(fc.CONTROL, 50.0, 80.0, 1000.0, cores=None), fc.Bar(), control=True)
    assert "cores" not in c.checks and c.verdict == "PASS"
