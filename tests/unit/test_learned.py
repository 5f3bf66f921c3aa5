"""Issue 8 item 15: a state directory that cannot be written never loses an OOM step-down or
crashes the supervisor; the log names the path and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_gpu_parts import CONTEXT, h200, make_cfg  # noqa: F401  (h200 is a fixture)
from tests.support.fakes import Log

from qwen4090.decide.policy import Cause, ExitVerdict
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import gpu, learned
from qwen4090.settings.config import from_dict

FP = {"model": "/m", "gpu": "test"}


def unwritable(tmp_path: Path) -> Path:
    """A state directory that can never be created (its parent is a regular file): what a
    read-only or missing /var/lib/qwen4090 is to a non-root service user."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return blocker / "state"


def test_record_into_an_unwritable_directory_says_where_and_the_fix(tmp_path: Path) -> None:
    store = learned.LearnedStore(unwritable(tmp_path))
    failed = store.record("max_num_seqs", 16, FP, "oom: test")  # raised NotADirectoryError
    assert failed is not None
    assert failed.path == str(store.path) and failed.error == "Not a directory"
    assert "gpu.state_directory" in failed.hint and "owned by the service user" in failed.hint
    line = failed.line()
    assert "\n" not in line and str(store.path) in line and "Not a directory" in line


def test_an_unsaved_step_down_still_applies_in_this_process(tmp_path: Path) -> None:
    state = unwritable(tmp_path)
    assert learned.LearnedStore(state).record("max_num_seqs", 16, FP, "oom") is not None
    cfg = from_dict({"vllm": {"model": "/m", "max_num_seqs": 32}})
    applied, notes = learned.LearnedStore(state).apply(cfg, FP)  # a new store, as gpu.py does
    assert applied.vllm.max_num_seqs == 16 and notes == ["max_num_seqs 32 -> 16"]
    assert learned.LearnedStore(state).reset() == ["max_num_seqs"]
    assert learned.LearnedStore(state).read() == {}


def test_a_later_successful_write_replaces_the_unsaved_copy(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o500)
    store = learned.LearnedStore(state)
    try:
        first = store.record("max_num_seqs", 16, FP, "oom")
    finally:
        state.chmod(0o700)
    if first is None:  # root writes anyway: the fallback is covered by the test above
        return
    assert store.record("max_num_seqs", 8, FP, "oom") is None
    on_disk = json.loads(store.path.read_text())
    assert on_disk["settings"] == {"max_num_seqs": 8}
    assert store.read()["settings"] == {"max_num_seqs": 8}


def test_garbage_in_learned_json_is_ignored_not_a_crash(tmp_path: Path) -> None:
    store = learned.LearnedStore(tmp_path)
    store.path.write_text(json.dumps({"fingerprint": FP, "settings": {
        "max_num_seqs": "lots", "max_model_len": 10 ** 30, "gpu_memory_utilization": 0.5}}))
    cfg = from_dict({"vllm": {"model": "/m", "gpu_memory_utilization": 0.9}})
    applied, notes = store.apply(cfg, FP)  # compared "lots" < 32 before: TypeError
    assert applied.vllm.gpu_memory_utilization == 0.5
    assert applied.vllm.max_num_seqs == cfg.vllm.max_num_seqs
    assert any("ignored learned max_num_seqs" in n for n in notes)
    assert any("ignored learned max_model_len" in n for n in notes)


def test_oom_step_down_with_an_unwritable_state_directory_is_kept_and_logged(
        tmp_path: Path, h200: dict[str, Any]) -> None:  # noqa: F811
    log = Log()
    parts = gpu.GpuParts(log, env={})
    cfg = make_cfg(tmp_path, plan_check="warn", max_model_len=40960)
    cfg = from_dict({"vllm": {"model": cfg.vllm.model, "quantization": "fp8",
                              "gpu_memory_utilization": 0.16, "max_model_len": 40960},
                     "gpu": {"state_directory": str(unwritable(tmp_path)),
                             "plan_check": "warn"}})
    launched = parts.launch(cfg)
    parts.check(launched, PreflightResult())
    changes = parts.step_down(
        launched, cfg, ExitVerdict(Cause.OOM, CONTEXT[:200], True), [CONTEXT])
    assert changes and changes[0].startswith("max_model_len 40960 -> 30976")
    (event,) = [kw for _lvl, e, kw in log.events if e == "learned_not_saved"]
    assert event["file"].endswith("not-a-dir/state/learned.json")
    assert "gpu.state_directory" in event["hint"] and event["error"] == "Not a directory"
    again = parts.launch(cfg)  # the next launch of this process uses the step-down
    parts.check(again, PreflightResult())
    assert again.config.vllm.max_model_len == 30976
