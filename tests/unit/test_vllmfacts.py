"""vllmfacts: the one home of vLLM's texts; policy, ladder and timeline read them from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen4090.base import vllmfacts
from qwen4090.base.vllmfacts import OOM_TEXTS, OomKind
from qwen4090.decide import policy
from qwen4090.decide.policy import Cause, classify_exit
from qwen4090.engine import timeline
from qwen4090.launching import ladder

DATA = Path(__file__).parent / "data"
PFX = "(EngineCore pid=4242) ERROR 11-30 17:16:14 [core.py:1010] "

# Lines that say "out of memory" in some way, and lines near them that do not.
OOM_LINES = [
    "ValueError: To serve at least one request with the model's max seq len (40960), (6.25 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (4.75 GiB).",
    "ValueError: The model's max seq len (4096) is larger than the maximum number of tokens "
    "that can be stored in KV cache (2048).",
    "ValueError: Free memory on device cuda:0 (78.77/139.8 GiB) on startup is less than "
    "desired GPU memory utilization (0.92, 128.62 GiB).",
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "torch.cuda.OutOfMemoryError: out of memory",
    "RuntimeError: CUDA error: out of memory",
    "ValueError: Free memory on node 0 is less than desired CPU memory utilization",
    "RuntimeError: Insufficient memory to allocate the KV cache",
]
NOT_OOM_LINES = [
    "RuntimeError: Engine core initialization failed. See root cause above.",
    "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).",
    "(APIServer pid=1) INFO 11-30 17:16:14 [gpu_worker.py:1] Available KV cache memory: 9 GiB",
    "OSError: [Errno 98] error while attempting to bind on address: address already in use",
    "RuntimeError: cancelled",
]


def _data_lines() -> list[str]:
    out = []
    for f in sorted(DATA.glob("vllm_startup_*.log")):
        for raw in f.read_text(encoding="utf-8").splitlines():
            if not raw.startswith("#"):
                out.append(raw.split("\t", 2)[-1])
    return out


def _policy_says_oom(line: str) -> bool:
    return classify_exit(1, [line]).cause is Cause.OOM


def _ladder_says_oom(line: str) -> bool:
    return ladder.read_oom([line]) is not None


@pytest.mark.parametrize("line", [*OOM_LINES, *(PFX + x for x in OOM_LINES)])
def test_policy_and_ladder_both_call_it_oom(line: str) -> None:
    # Before the one table, "CUDA error: out of memory" was an OOM for the ladder and a crash
    # for policy, and the CPU backend's texts the other way round.
    assert _policy_says_oom(line) and _ladder_says_oom(line)
    assert policy.engine_dead_verdict([line], "EngineDeadError").cause is Cause.OOM


@pytest.mark.parametrize("line", [*NOT_OOM_LINES, *_data_lines()])
def test_policy_and_ladder_agree_on_every_line(line: str) -> None:
    assert _policy_says_oom(line) == _ladder_says_oom(line)
    # ... and so does the verdict on vLLM's engine-death line (the third reader of the table)
    dead = policy.engine_dead_verdict([line], "EngineDeadError").cause is Cause.OOM
    assert dead == _policy_says_oom(line)


@pytest.mark.parametrize("line", NOT_OOM_LINES)
def test_near_misses_are_not_oom(line: str) -> None:
    assert not _policy_says_oom(line)


@pytest.mark.parametrize("text", OOM_TEXTS, ids=lambda t: t.pattern.pattern[:40])
def test_every_entry_of_the_table_reads_the_same_everywhere(text: vllmfacts.OomText) -> None:
    line = PFX + text.example
    assert text.pattern.search(line), "the example is one the pattern matches"
    assert vllmfacts.oom_kind(line) is text.kind
    assert classify_exit(1, [line]).cause is Cause.OOM
    facts = ladder.read_oom(["noise", line, "RuntimeError: see root cause above"])
    assert facts is not None and facts.kind is text.kind


def test_policy_and_ladder_keep_no_texts_of_their_own() -> None:
    for mod in (policy, ladder):
        assert not [name for name, v in vars(mod).items()
                    if hasattr(v, "pattern") and hasattr(v, "search")], mod.__name__


def test_the_most_specific_kind_wins_in_a_tail() -> None:
    tail = [PFX + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
            PFX + OOM_TEXTS[0].example]
    assert ladder.read_oom(tail).kind is OomKind.CONTEXT_TOO_LONG  # type: ignore[union-attr]
    # ... while the verdict names the last OOM line vLLM printed
    assert "max seq len" in classify_exit(1, tail).detail
    assert vllmfacts.estimated_max_len(OOM_TEXTS[0].example) == 31104
    assert vllmfacts.free_memory_gib(OOM_TEXTS[2].example) == (78.77, 139.8)


def test_host_memory_takes_the_general_ladder() -> None:
    lim = ladder.Limits(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048,
                        gpu_memory_utilization=0.9)
    facts = ladder.read_oom(["RuntimeError: Insufficient memory to allocate the KV cache"])
    assert facts is not None and facts.kind is OomKind.HOST_MEMORY
    assert ladder.next_rung(facts, lim) == ladder.next_rung(None, lim)


# --- the host mapping, metrics, start-up marks ---------------------------------------------------


@pytest.mark.parametrize(("host", "local", "url"), [
    ("0.0.0.0", "127.0.0.1", "http://127.0.0.1:8000"),
    ("", "127.0.0.1", "http://127.0.0.1:8000"),
    ("::", "::1", "http://[::1]:8000"),
    ("::1", "::1", "http://[::1]:8000"),
    ("10.1.2.3", "10.1.2.3", "http://10.1.2.3:8000"),
    ("localhost", "localhost", "http://localhost:8000"),
])
def test_a_wildcard_is_reached_on_loopback(host: str, local: str, url: str) -> None:
    assert vllmfacts.local_host(host) == local
    assert vllmfacts.local_url(host, 8000) == url
    assert (host in vllmfacts.WILDCARDS) == (local != host)


def test_the_progress_counter_moves_with_any_engine_step() -> None:
    base = {vllmfacts.GENERATION_TOKENS: 10.0, vllmfacts.PROMPT_TOKENS: 5.0,
            vllmfacts.ITERATIONS: 2.0, vllmfacts.RUNNING: 1.0}
    assert vllmfacts.progress_counter(base) == 17.0
    assert vllmfacts.progress_counter({}) == 0.0
    prefill_step = {**base, vllmfacts.ITERATIONS: 3.0}  # a long prefill: no token counted yet
    assert vllmfacts.progress_counter(prefill_step) > vllmfacts.progress_counter(base)


def test_kv_cache_usage_under_either_name() -> None:
    assert vllmfacts.kv_cache_usage({vllmfacts.KV_CACHE_USAGE: 0.5}) == 0.5
    assert vllmfacts.kv_cache_usage({vllmfacts.GPU_CACHE_USAGE: 0.25}) == 0.25
    assert vllmfacts.kv_cache_usage({}) is None


def test_every_start_up_line_mark_is_a_timeline_mark() -> None:
    names = [name for name, _rx, _keep in vllmfacts.STARTUP_LINES]
    assert names and set(names) <= set(timeline.MARKS)
    # in the order a start passes them
    assert names == sorted(names, key=timeline.MARKS.index)
