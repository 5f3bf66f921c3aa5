from __future__ import annotations

from typing import Any

from qwen4090 import warmup
from qwen4090.config import from_dict
from qwen4090.probes.http import CompletionResult


def test_steps_are_capped_by_context_and_seqs() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 2048, "max_num_seqs": 8},
                     "warmup": {"lengths": [1, 16, 1024, 2048, 4096], "concurrency": [1, 4, 8, 32],
                                "max_tokens": 4}})
    steps, skipped = warmup.plan_steps(cfg)
    assert [(s.length, s.concurrency) for s in steps] == [
        (1, 1), (16, 1), (1024, 1), (256, 4), (256, 8)]
    assert any("2048" in s for s in skipped) and any("32" in s for s in skipped)


class FakeProbe:
    def __init__(self, fail_at: int | None = None):
        self.prompts: list[int] = []
        self.fail_at = fail_at

    def complete(self, prompt: Any, max_tokens: int, timeout: float) -> Any:
        self.prompts.append(len(prompt))
        if self.fail_at is not None and len(prompt) == self.fail_at:
            return CompletionResult(False, None, 0.1, 0, "HTTP 500: boom")
        return CompletionResult(True, len(prompt) / 1000, 0.2, max_tokens)


def test_run_sends_exact_lengths_and_tabulates() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 4096, "max_num_seqs": 8},
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
