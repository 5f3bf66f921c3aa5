"""atomicfile.write_text: the old content or the new, never half, and no temporary file left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qwen4090 import atomicfile, instance, kvbudget, learned


def test_writes_and_replaces_leaving_only_the_file(tmp_path: Path) -> None:
    f = tmp_path / "learned.json"
    atomicfile.write_text(f, "one\n")
    atomicfile.write_text(f, "two\n")
    assert f.read_text() == "two\n"
    assert sorted(os.listdir(tmp_path)) == ["learned.json"]


def test_a_failed_write_keeps_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    f = tmp_path / "child.json"
    atomicfile.write_text(f, "old")
    with pytest.raises(UnicodeEncodeError):
        atomicfile.write_text(f, "half \udc80")  # fails inside the write
    assert f.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["child.json"]


def test_a_failed_rename_keeps_the_old_content_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "kv_budget.json"
    atomicfile.write_text(f, "old")

    def refuse(src: str, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        atomicfile.write_text(f, "new")
    assert f.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["kv_budget.json"]


def test_a_missing_directory_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomicfile.write_text(tmp_path / "gone" / "x.json", "x")


def test_the_three_writers_use_it() -> None:
    import inspect

    for mod in (instance, learned, kvbudget):
        src = inspect.getsource(mod)
        assert "atomicfile.write_text(" in src and "mkstemp" not in src, mod.__name__
