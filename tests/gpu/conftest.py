"""GPU tests: real vLLM on a real NVIDIA GPU.  Skipped (cleanly, at collection) where there is
no GPU or no CUDA vLLM; scripts/gpu/validate.sh runs them on the lent H200."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _why_not() -> str | None:
    if os.environ.get("QWEN4090_GPU_DRYRUN_CPU") == "1":
        return None
    try:
        from qwen4090.probes import nvml
    except ImportError as e:  # pragma: no cover
        return f"qwen4090 not importable: {e}"
    nvml.bind([sys.executable])  # the wiring the package uses: vllm.command's venv
    m = nvml.memory(0)
    if isinstance(m, str):
        return f"no NVIDIA GPU: {m}"
    if importlib.util.find_spec("vllm") is None:
        return "no vLLM in this Python (the GPU kit installs it)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    why = _why_not()
    if why:
        skip = pytest.mark.skip(reason=why)
        for item in gpu_items:
            item.add_marker(skip)
