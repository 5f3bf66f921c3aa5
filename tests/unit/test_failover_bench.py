"""bench/failover.py's pure part: the targets, the verdict over the repeats, the summary per
fault kind, fault -> first answer, the rebuild read from /status transitions."""

from __future__ import annotations

from bench import failover as fo
from tests.support.load import Outcome


def test_targets_are_issue_21s() -> None:
    assert fo.target("kill-engine", 15.0) == fo.Target(1.0, 3.0)
    assert fo.target("hang", 60.0) == fo.Target(3.0, 5.0)
    assert fo.target("hang", 2.0) == fo.Target(3.0, 4.0)  # the ceiling an administrator set
    assert fo.target("kill-api", 15.0) == fo.Target(None, None)
    assert fo.Target(2.0, 3.0).text() == "p50<=2s max<=3s"
    assert fo.Target(None, None).text() == "-"


def test_kill_engine_passes_on_p50_and_max_both_within() -> None:
    s = fo.judge([1.0, 1.5, 2.0, 2.9, 1.2], fo.Target(2.0, 3.0))
    assert (s["n"], s["answered"], s["p50_s"], s["max_s"], s["verdict"]) == \
        (5, 5, 1.5, 2.9, "PASS")


def test_a_high_median_or_one_slow_repeat_misses() -> None:
    assert fo.judge([2.1, 2.2, 1.0], fo.Target(2.0, 3.0))["verdict"] == "MISS"  # p50 2.1
    assert fo.judge([1.0, 1.0, 3.01], fo.Target(2.0, 3.0))["verdict"] == "MISS"  # max
    assert fo.judge([2.0, 2.0, 3.0], fo.Target(2.0, 3.0))["verdict"] == "PASS"  # bounds in


def test_a_repeat_without_an_answer_is_a_miss_with_no_max() -> None:
    s = fo.judge([1.0, None, 1.1], fo.Target(2.0, 3.0))
    assert (s["answered"], s["p50_s"], s["max_s"], s["verdict"]) == (2, 1.1, None, "MISS")
    s = fo.judge([None, None, 1.0], fo.Target(None, 17.0))
    assert (s["p50_s"], s["max_s"], s["verdict"]) == (None, None, "MISS")


def test_no_rows_and_no_target() -> None:
    assert fo.judge([], fo.Target(2.0, 3.0))["verdict"] == "NO DATA"
    assert fo.judge([9.0, 99.0], fo.Target(None, None))["verdict"] == "-"


def test_hang_is_judged_on_p50_and_max_within_the_ceiling() -> None:
    rows = [{"kind": "hang", "repeat": i, "first_answer_new_s": v}
            for i, v in enumerate([2.2, 2.9, 4.4])]
    s = fo.summarize(rows, hang_timeout=60.0)["hang"]
    assert (s["p50_s"], s["max_s"], s["target"], s["verdict"]) == \
        (2.9, 4.4, "p50<=3s max<=5s", "PASS")
    assert fo.summarize(rows, hang_timeout=2.0)["hang"]["verdict"] == "MISS"  # max <= 4 s
    late = [{**r, "first_answer_new_s": v} for r, v in zip(rows, [3.1, 3.2, 3.3], strict=True)]
    assert fo.summarize(late, hang_timeout=60.0)["hang"]["verdict"] == "MISS"  # p50 3.2


def test_summary_per_kind_in_order_with_losses_and_rebuilds() -> None:
    rows = [
        {"kind": "kill-engine", "repeat": 0, "first_answer_new_s": 0.7,
         "served_again_s": 0.9, "refused": 0, "not_200": 1,
         "last_failover": {"ok": True, "seconds": 1.0, "wake_seconds": 0.6},
         "rebuild": {"seconds": 40.0, "longest_wait_s": 30.5}},
        {"kind": "kill-engine", "repeat": 1, "first_answer_new_s": 1.8,
         "served_again_s": 1.1, "refused": 2, "not_200": 0,
         "last_failover": {"ok": False, "seconds": 20.0, "wake_seconds": None},
         "rebuild": {"seconds": 50.0, "longest_wait_s": 41.0}},
        {"kind": "hang", "repeat": 0, "first_answer_new_s": None, "error": "E: x"},
    ]
    s = fo.summarize(rows, 15.0)
    assert list(s) == ["kill-engine", "hang"]
    k = s["kill-engine"]
    assert (k["p50_s"], k["max_s"], k["verdict"]) == (1.25, 1.8, "MISS")  # p50 above 1 s
    assert (k["served_again_p50_s"], k["served_again_max_s"]) == (1.0, 1.1)
    assert (k["failovers_ok"], k["refused"], k["not_200"]) == (1, 2, 1)
    assert k["daemon_seconds"] == [1.0, 20.0] and k["wake_seconds"] == [0.6, None]
    assert (k["rebuilds_done"], k["rebuild_p50_s"], k["rebuild_max_s"],
            k["rebuild_longest_wait_s"]) == (2, 45.0, 50.0, 41.0)
    h = s["hang"]
    assert (h["verdict"], h["errors"], h["rebuilds_done"], h["rebuild_p50_s"]) == \
        ("MISS", ["E: x"], 0, None)
    text = fo.table(s)
    assert "kill-engine" in text and "MISS" in text
    fast = [{**rows[0], "first_answer_new_s": v} for v in (0.6, 0.9, 2.5)]
    assert fo.summarize(fast, 15.0)["kill-engine"]["verdict"] == "PASS"


def o(sent: float, ended: float, status: int | None = 200) -> Outcome:
    return Outcome(sent, ended, status)


def test_first_answer_counts_only_requests_sent_after_the_fault() -> None:
    outs = [o(9.0, 9.5), o(9.8, 11.0), o(10.1, 12.5, None), o(10.2, 11.7), o(10.3, 11.4, 503)]
    assert fo.first_answer(outs, 10.0) == 1.7
    assert fo.first_answer([o(10.1, 12.0, None), o(9.0, 10.5)], 10.0) is None


def test_served_again_is_the_end_of_the_silence_after_the_fault() -> None:
    # one answer the old engine had finished arrives at 10.02; then nothing until 11.3
    outs = [o(9.0, 9.9), o(9.95, 10.02), o(9.97, 11.3), o(10.5, 11.35), o(11.3, 11.4)]
    assert fo.served_again(outs, 10.0) == (1.3, 1.28)
    # the silence is measured from the last answer before the fault when none came just after
    assert fo.served_again([o(9.0, 9.6), o(9.7, 12.0)], 10.0) == (2.0, 2.4)
    assert fo.served_again([o(9.0, 9.6), o(10.1, 11.0, None)], 10.0) == (None, None)


def test_rebuild_starts_once_the_standby_was_taken_and_ends_at_both_ready() -> None:
    tl = [(0.0, "ready", "ready", True),      # the hang: the standby still waits, ready
          (16.0, "ready", "ready", True),     # a stale poll after the failover
          (16.5, "ready", "waiting", False),  # taken; a quiet moment awaited
          (27.0, "ready", "starting", False), (40.0, "ready", "sleeping", False),
          (55.2, "ready", "ready", True)]
    r = fo.rebuild_times(tl, serving_at=16.2)
    assert r == {"gone_s": 16.5, "started_s": 27.0, "ready_s": 55.2, "seconds": 39.0}
    assert fo.rebuild_times(tl[:4], 16.2)["ready_s"] is None
    assert fo.rebuild_times(tl[:2], 16.2)["gone_s"] is None
    assert fo.rebuild_times(tl, None)["seconds"] is None
    # sleep mode: the supervisor holds (rebuilding) while the serving engine sleeps, first
    tl = [(0.0, "ready", "ready", True), (1.0, "ready", "none", False),
          (12.0, "rebuilding", "waiting", False), (14.0, "rebuilding", "starting", False),
          (60.0, "ready", "ready", True)]
    assert fo.rebuild_times(tl, 0.9) == {"gone_s": 1.0, "started_s": 12.0, "ready_s": 60.0,
                                         "seconds": 59.1}


def test_kv_tokens_from_vllms_cache_config_info() -> None:
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            'num_gpu_blocks="2167",prefix_caching_hash_algo="sha256"} 1.0\n')
    assert fo.kv_from_metrics(text) == 2167 * 16
    assert fo.kv_from_metrics('vllm:cache_config_info{block_size="16",'
                              'num_gpu_blocks="None"} 1.0') is None
    assert fo.kv_from_metrics(None) is None
