"""Where the NVML binding (`pynvml`) comes from on a packaged install.

Debian main has no NVML binding (python3-pynvml is in contrib and pulls NVIDIA's non-free
driver libraries by package name, which conflicts with drivers installed from NVIDIA's own
repositories), so the .deb depends on none. Instead:

1. `import pynvml` when it is importable (python3-pynvml from contrib, nvidia-ml-py in a venv);
2. else the copy inside vLLM's runtime venv: vLLM ships nvidia-ml-py's pure-Python, ctypes-only
   `pynvml.py` as `vllm/third_party/pynvml.py` (and its CUDA build may also install
   nvidia-ml-py), so every `qwen4090 install-runtime` venv has one that matches vLLM's own.

The module only wraps libnvidia-ml.so.1 with ctypes (stdlib imports only), so loading that file
into Debian's python3 is safe; the driver's library is found at nvmlInit() time, as always.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

DEFAULT_VENV = Path("/opt/qwen4090/venv")
CANDIDATES = ("pynvml.py", "vllm/third_party/pynvml.py")
_FROM_VENV = "_qwen4090_loaded_from_venv"  # marks a module load_pynvml read from a venv's file


def venv_of(command0: str) -> Path:
    """The venv of vLLM's interpreter (`/opt/qwen4090/venv/bin/python` -> `/opt/qwen4090/venv`)."""
    return Path(command0).parent.parent


def runtime_venv(command: Sequence[str]) -> Path:
    """The venv that ``vllm.command`` runs in: its interpreter's (or console script's) venv.

    A bare name (``vllm``) is looked up on PATH; no symlink is resolved, because a venv's
    ``bin/python`` links to the system interpreter outside the venv.  Without a command, or
    when the name is not found, the venv that ``qwen4090 install-runtime`` makes.
    """
    if not command:
        return DEFAULT_VENV
    exe = command[0]
    if "/" not in exe:
        found = shutil.which(exe)
        if found is None:
            return DEFAULT_VENV
        exe = found
    return venv_of(exe)


def runtime_candidates(venv: Path) -> list[Path]:
    """pynvml.py files of the venv, preferred first (site-packages of every Python version)."""
    found: list[Path] = []
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        found += [site / c for c in CANDIDATES if (site / c).is_file()]
    return found


def load_pynvml(venv: Path = DEFAULT_VENV) -> ModuleType | None:
    """pynvml, from the import path or from vLLM's runtime venv; None when neither has one."""
    # A copy this function loaded from a venv before sits in sys.modules, where `import pynvml`
    # would find it again: for another venv, that is the wrong one.
    if not getattr(sys.modules.get("pynvml"), _FROM_VENV, False):
        try:
            return importlib.import_module("pynvml")
        except ImportError:
            pass
    for path in runtime_candidates(venv):
        spec = importlib.util.spec_from_file_location("pynvml", path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        previous = sys.modules.get("pynvml")
        sys.modules["pynvml"] = module  # pynvml looks itself up there while it loads
        setattr(module, _FROM_VENV, True)
        try:
            spec.loader.exec_module(module)
        except Exception:  # a broken copy: try the next one
            if previous is None:
                sys.modules.pop("pynvml", None)
            else:
                sys.modules["pynvml"] = previous
            continue
        return module
    return None
