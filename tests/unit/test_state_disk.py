"""The learned limits and the KV budget on a state directory that refuses writes (issue 18.1):
full (ENOSPC), read-only (EROFS) or not ours (EACCES).  Nothing raises, nothing is left half
written, what was not kept still applies in this process, and it is said once per file."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import Log

from qwen4090.base import atomicfile
from qwen4090.launching import kvbudget, launch, launchvalue, learned
from qwen4090.launching.kvbudget import FLAG, KvBudget
from qwen4090.launching.plan import GpuMemory
from qwen4090.settings.config import from_dict

GIB = 1024 ** 3
FP = {"model": "/m", "gpu": "H200"}
CAUSES = [(errno.ENOSPC, "disk full (ENOSPC)"), (errno.EROFS, "read-only file system (EROFS)"),
          (errno.EACCES, "permission denied (EACCES)")]


def refuse(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def write_text(path: Path, text: str) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomicfile, "write_text", write_text)


def dev_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real write path onto a file that is always full (see test_atomicfile)."""
    import tempfile

    def mkstemp(prefix: str = "", dir: object = None, **_: object) -> tuple[int, str]:
        name = os.path.join(str(dir), f"{prefix}full")
        Path(name).touch()
        return os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC), name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def cfg() -> Any:
    return from_dict({"vllm": {"model": "/m"}, "restart": {"fixed_kv_budget": True}})


def resolve(kv: KvBudget) -> launchvalue.Launch:
    return launch.resolve(cfg(), launch.Facts(GpuMemory(80 * GIB, "H200"), kv_budget=kv.read(),
                                              runtime="vllm 0.26.0"))


READY = {"outcome": "ready", "kv_bytes": 4 * GIB, "kv_tokens": 30160}


@pytest.mark.parametrize(("code", "words"), CAUSES)
def test_a_kv_budget_not_saved_is_said_once_and_still_applies_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    log = Log()
    first = resolve(KvBudget(tmp_path, log=log))
    refuse(monkeypatch, code)
    # gpu.py builds a KvBudget at each use: the memory and the warning are per file
    assert not KvBudget(tmp_path, log=log).record(first.config, first.kv_base, READY)
    assert not KvBudget(tmp_path, log=log).record(first.config, first.kv_base, READY)
    (said,) = log.named("state_not_saved")  # raised OSError into the READY hook before
    assert said["path"] == str(tmp_path / kvbudget.FILE_NAME) and said["cause"] == words
    assert "this supervisor's next starts" in said["hint"] and str(tmp_path) in said["hint"]
    assert [lvl for lvl, e, _ in log.events] == ["warning"]
    assert os.listdir(tmp_path) == []
    nxt = resolve(KvBudget(tmp_path, log=log))  # this process's next launch gets the bytes
    assert nxt.config.vllm.extra_args[-2:] == [FLAG, str(4 * GIB)]


def test_a_kv_budget_saved_again_after_the_disk_is_freed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    first = resolve(KvBudget(tmp_path, log=log))
    dev_full(monkeypatch)  # the real write path, onto a device that is always full
    assert not KvBudget(tmp_path, log=log).record(first.config, first.kv_base, READY)
    assert os.listdir(tmp_path) == []  # no temporary left
    monkeypatch.undo()
    assert KvBudget(tmp_path, log=log).record(first.config, first.kv_base, READY)
    assert log.names() == ["state_not_saved", "state_saved"]
    assert atomicfile._unsaved.get(tmp_path / kvbudget.FILE_NAME) is None
    assert KvBudget(tmp_path).read()["kv_cache_memory_bytes"] == 4 * GIB


@pytest.mark.parametrize(("code", "words"), [(errno.EROFS, "read-only file system (EROFS)"),
                                             (errno.EACCES, "permission denied (EACCES)")])
def test_a_kv_budget_that_cannot_be_removed_is_forgotten_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    log = Log()
    first = resolve(KvBudget(tmp_path, log=log))
    assert KvBudget(tmp_path, log=log).record(first.config, first.kv_base, READY)
    given = resolve(KvBudget(tmp_path, log=log))
    assert given.kv_budget == 4 * GIB
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == kvbudget.FILE_NAME:
            raise OSError(code, os.strerror(code))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert KvBudget(tmp_path, log=log).forget(given.kv_budget)  # raised OSError before
    (said,) = log.named("state_not_saved")
    assert said["cause"] == words and said["path"] == str(tmp_path / kvbudget.FILE_NAME)
    again = resolve(KvBudget(tmp_path, log=log))  # this process profiles again
    assert again.kv_budget is None and FLAG not in again.config.vllm.extra_args


@pytest.mark.parametrize(("code", "words"), CAUSES)
def test_learned_limits_not_saved_say_the_cause_in_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    store = learned.LearnedStore(tmp_path)
    assert store.record("max_num_seqs", 32, FP, "oom") is None
    refuse(monkeypatch, code)
    failed = learned.LearnedStore(tmp_path).record("max_num_seqs", 16, FP, "oom")
    assert failed is not None and failed.error == words
    assert str(tmp_path) in failed.hint and "\n" not in failed.line()
    applied, _ = learned.LearnedStore(tmp_path).apply(
        from_dict({"vllm": {"model": "/m", "max_num_seqs": 64}}), FP)
    assert applied.vllm.max_num_seqs == 16  # still applies in this process
    learned.LearnedStore(tmp_path).reset()


def test_learned_limits_on_a_full_disk_keep_the_old_file_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = learned.LearnedStore(tmp_path)
    assert store.record("max_num_seqs", 32, FP, "oom") is None
    before = store.path.read_bytes()
    dev_full(monkeypatch)
    failed = store.record("max_num_seqs", 16, FP, "oom")
    assert failed is not None and failed.error == "disk full (ENOSPC)"
    assert store.path.read_bytes() == before and os.listdir(tmp_path) == [learned.FILE_NAME]
    monkeypatch.undo()
    store.reset()
