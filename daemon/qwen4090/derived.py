"""Keys whose default depends on other keys, so that N instances of qwen4090@ side by side need
only their own vLLM port and GPU in their config.

- ``status.port``, when no file sets it, is ``vllm.port + 90`` (8090 for vLLM's 8000, 8091 for
  8001): instances, which must differ in vllm.port anyway, never collide on the status port.
- ``gpu.device`` is NVML's index, which ignores ``CUDA_VISIBLE_DEVICES``: when
  ``vllm.env.CUDA_VISIBLE_DEVICES`` names GPUs by index, vLLM uses the first of them, so
  gpu.device follows it when unset, and a different explicit gpu.device is a config error.
  Indices in CUDA_VISIBLE_DEVICES are NVML's (PCI bus) order only with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs; UUIDs (``GPU-...``) and MIG names are
  left to the NVML side to resolve (gpu.device is not changed for them).

Pure: a Config in, a Config (or the contradiction found) out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwen4090.config import Config

STATUS_PORT_OFFSET = 90
MAX_PORT = 65535


def default_status_port(vllm_port: int) -> int:
    port = vllm_port + STATUS_PORT_OFFSET
    return port if port <= MAX_PORT else vllm_port - STATUS_PORT_OFFSET


def cuda_visible_indices(value: str) -> list[int] | None:
    """The GPU indices of a CUDA_VISIBLE_DEVICES value; None when it names GPUs another way
    (UUIDs, MIG instances) or is empty."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def device_for(configured: int | None, cuda_visible: str | None) -> tuple[int | None, str | None]:
    """(NVML index to watch or None for "keep the default", error text or None)."""
    if cuda_visible is None:
        return configured, None
    indices = cuda_visible_indices(cuda_visible)
    if indices is None:
        return configured, None
    physical = indices[0]
    if configured is None or configured == physical:
        return physical, None
    return None, (f"found {configured}, but vllm.env.CUDA_VISIBLE_DEVICES = {cuda_visible!r} "
                  f"makes vLLM use the GPU with NVML index {physical}; set gpu.device = "
                  f"{physical} or remove it (it follows CUDA_VISIBLE_DEVICES)")


def apply(cfg: Config, given: Container[str]) -> tuple[Config, tuple[str, str] | None]:
    """cfg with the derived defaults filled in (for the "section.key"s not in `given`, the keys
    some file set), and the contradiction found as (key, why), or None; config.py turns it
    into the ConfigError that names the file (so this module needs nothing of config's)."""
    status, gpu = cfg.status, cfg.gpu
    if "status.port" not in given:
        status = dataclasses.replace(status, port=default_status_port(cfg.vllm.port))
    configured = gpu.device if "gpu.device" in given else None
    device, error = device_for(configured, cfg.vllm.env.get("CUDA_VISIBLE_DEVICES"))
    if error is not None:
        return cfg, ("gpu.device", error)
    if device is not None and device != gpu.device:
        gpu = dataclasses.replace(gpu, device=device)
    if status is cfg.status and gpu is cfg.gpu:
        return cfg, None
    return dataclasses.replace(cfg, status=status, gpu=gpu), None
