"""atomicfile.write_text: the old content or the new, never half, and no temporary file left."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from qwen4090.base import atomicfile
from qwen4090.launching import instance, kvbudget, learned


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
        # directly, or through atomicfile.JsonState (the KV budget, the longest step)
        assert ("atomicfile.write_text(" in src or "atomicfile.JsonState(" in src) \
            and "mkstemp" not in src, mod.__name__


# --- a disk that refuses (issue 18.1) ----------------------------------------------------------


@pytest.mark.parametrize(("code", "words"), [
    (errno.ENOSPC, "disk full (ENOSPC)"),
    (errno.EROFS, "read-only file system (EROFS)"),
    (errno.EACCES, "permission denied (EACCES)"),
    (errno.EPERM, "permission denied (EPERM)"),
    (errno.EDQUOT, "disk quota exceeded (EDQUOT)"),
    (errno.ENOTDIR, "Not a directory"),
])
def test_the_cause_in_words(code: int, words: str) -> None:
    assert atomicfile.cause(OSError(code, os.strerror(code))) == words


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def onto_dev_full(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """mkstemp hands out a real temporary file's name but an fd on /dev/full: every write
    that reaches the kernel fails with ENOSPC, as on a full file system."""
    made: list[str] = []

    def mkstemp(prefix: str = "", dir: object = None, **_: object) -> tuple[int, str]:
        name = os.path.join(str(dir), f"{prefix}full")
        Path(name).touch()
        made.append(name)
        return os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC), name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return made


def test_a_full_disk_keeps_the_old_content_no_temporary_and_no_fd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "learned.json"
    atomicfile.write_text(f, "old\n")
    before = open_fds()
    made = onto_dev_full(monkeypatch)
    with pytest.raises(OSError) as e:
        atomicfile.write_text(f, "new\n" * 10_000)  # larger than the buffer: write fails too
    assert e.value.errno == errno.ENOSPC and made
    with pytest.raises(OSError) as e:
        atomicfile.write_text(f, "new\n")  # fits the buffer: flush (or close) fails
    assert e.value.errno == errno.ENOSPC
    assert f.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["learned.json"]
    assert open_fds() == before  # the fd on the full disk was closed all the same


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_fsync_keeps_the_old_content_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    f = tmp_path / "kv_budget.json"
    atomicfile.write_text(f, "old")

    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError):
        atomicfile.write_text(f, "new")
    assert f.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["kv_budget.json"]


def test_a_read_only_file_system_refuses_the_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def mkstemp(**_: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(OSError) as e:
        atomicfile.write_text(tmp_path / "x.json", "x")
    assert atomicfile.cause(e.value) == "read-only file system (EROFS)"
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-500 directory")
def test_a_directory_without_write_permission(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(PermissionError) as e:
            atomicfile.write_text(d / "x.json", "x")
        assert atomicfile.cause(e.value) == "permission denied (EACCES)"
    finally:
        d.chmod(0o700)


def test_failures_are_said_once_per_file_and_again_after_a_success(tmp_path: Path) -> None:
    said = atomicfile.Failures()
    a, b = tmp_path / "a", tmp_path / "b"
    assert said.failed(a) and not said.failed(a) and said.failed(b)
    assert said.saved(a) and not said.saved(a)
    assert said.failed(a)  # failing again after a success is news again
