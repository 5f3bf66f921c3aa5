"""The NVIDIA driver against the CUDA build of vLLM's runtime (issue 31.5): pure decisions.

A torch built for a newer CUDA than the driver supports dies at CUDA init; vLLM then fails
every start the same way and the supervisor used to give up with exit 75 and nothing naming
the cause (Debian 12's own driver, 535.x, supports CUDA 12.2; recent vLLM wheels need more).
The preflight compares the two before a launch and refuses with one line (exit 78).

The facts come from elsewhere: the driver's version and its CUDA version from NVML
(probes/nvml.py ``driver_cuda``), the runtime's torch from its ``torch/version.py`` read as
text (launching/runtime.py ``torch_build``; the supervisor never imports torch).  Here only
the parsing of that text, the comparison and the sentences, so each is tested with plain values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

Cuda = tuple[int, int]  # (major, minor)

# The oldest Linux driver of each CUDA toolkit release: NVIDIA's CUDA Toolkit release notes,
# Table 3 ("CUDA Toolkit and Corresponding Driver Versions", the GA driver of each toolkit).
# Only the source of the refusal's "install a driver >= N" hint: the decision itself compares
# the CUDA version NVML reports for the driver, which needs no table.
MIN_DRIVER: dict[Cuda, str] = {
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}


@dataclass(frozen=True)
class DriverCuda:
    """What NVML says of the driver: its version and the newest CUDA it supports."""

    version: str  # "535.183.01"
    cuda: int  # nvmlSystemGetCudaDriverVersion: 1000 x major + 10 x minor (12020 = 12.2)

    @property
    def supports(self) -> Cuda:
        return self.cuda // 1000, (self.cuda % 1000) // 10


@dataclass(frozen=True)
class TorchBuild:
    """The runtime's torch as its version.py says: ``cuda`` None for a CPU (or ROCm) build."""

    version: str | None  # "2.8.0+cu128"; None when version.py does not say
    cuda: str | None  # "12.8"

    @property
    def needs(self) -> Cuda | None:
        return parse_cuda(self.cuda) if self.cuda else None

    def describe(self) -> str:
        return f"torch {self.version}" if self.version else "torch"


def parse_cuda(text: str) -> Cuda | None:
    """"12.8" (or "12.8.1") -> (12, 8); None for anything else."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


# torch/version.py, as torch's build writes it (2.x):
#   __version__ = '2.8.0+cu128'
#   cuda: Optional[str] = '12.8'        (older builds: cuda = '11.8'; CPU builds: ... = None)
_ASSIGN = r"^{name}\s*(?::[^=\n]*)?=\s*(?:None|'([^'\n]*)'|\"([^\"\n]*)\")\s*(?:#.*)?$"
_CUDA = re.compile(_ASSIGN.format(name="cuda"), re.MULTILINE)
_VERSION = re.compile(_ASSIGN.format(name="__version__"), re.MULTILINE)


def torch_build_of(text: str) -> TorchBuild | str:
    """The build that torch/version.py's text names; a str says why it cannot tell."""
    cuda = _CUDA.search(text)
    if cuda is None:
        return "no `cuda = ...` line in torch/version.py"
    version = _VERSION.search(text)
    cuda_text = cuda.group(1) if cuda.group(1) is not None else cuda.group(2)
    if cuda_text is not None and parse_cuda(cuda_text) is None:
        return f"torch/version.py names CUDA {cuda_text!r}, not a version"
    version_text = None if version is None else (version.group(1) or version.group(2))
    return TorchBuild(version_text, cuda_text)


def cuda_text(cuda: Cuda) -> str:
    return f"{cuda[0]}.{cuda[1]}"


def min_driver_hint(cuda: Cuda) -> str:
    """" (>= 570.26)" when MIN_DRIVER knows the toolkit, else ""."""
    found = MIN_DRIVER.get(cuda)
    return "" if found is None else f" (>= {found})"


def refusal(driver: DriverCuda, build: TorchBuild, venv: Path) -> str | None:
    """One line when the driver supports an older CUDA (major.minor) than the runtime's torch
    was built for: both named, and both fixes; None when the driver is new enough or the
    build needs no CUDA (a CPU build)."""
    needs = build.needs
    if needs is None or driver.supports >= needs:
        return None
    has, wants = cuda_text(driver.supports), cuda_text(needs)
    return (f"driver {driver.version} supports CUDA {has}, but the runtime {venv} "
            f"({build.describe()}) needs CUDA {wants}: install an NVIDIA driver that supports "
            f"CUDA {wants}{min_driver_hint(needs)}, or a runtime built for CUDA {has} or older "
            f"(qwen4090 install-runtime --vllm-version V --pip-arg=..., see README.Debian)")


def describe(driver: DriverCuda, build: TorchBuild, venv: Path) -> str:
    """Both sides in one line (``qwen4090 plan``); the refusal itself when it would refuse."""
    why = refusal(driver, build, venv)
    if why is not None:
        return f"refused: {why}"
    wants = build.needs
    runtime = f"{venv} ({build.describe()}) " + \
        (f"built for CUDA {cuda_text(wants)}" if wants else "built without CUDA")
    return f"driver {driver.version} supports CUDA {cuda_text(driver.supports)}; runtime {runtime}"
