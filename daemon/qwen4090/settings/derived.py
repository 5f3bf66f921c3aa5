"""Keys whose default depends on other keys, so that N instances of qwen4090@ side by side need
only their own vLLM port and GPU in their config.

- ``status.port``, when no file sets it, is ``vllm.port + 90`` (8090 for vLLM's 8000, 8091 for
  8001): instances, which must differ in vllm.port anyway, never collide on the status port.
- ``front.engine_port``, when no file sets it, is ``vllm.port + 10000`` (18000 for 8000): where
  vLLM listens behind the front (front.py).
- ``gpu.device`` is NVML's index, which ignores ``CUDA_VISIBLE_DEVICES``: when
  ``vllm.env.CUDA_VISIBLE_DEVICES`` names GPUs by index, vLLM uses the first of them, so
  gpu.device follows it when unset, and a different explicit gpu.device is a config error.
  Indices in CUDA_VISIBLE_DEVICES are NVML's (PCI bus) order only with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs.  UUIDs (``GPU-...``) and MIG names need
  NVML, which a config load does not ask: gpu.GpuParts.device resolves them when the daemon
  picks the GPU to watch (gpu.device is not changed here).

Pure: plain values in, the derived values (or the contradiction found) out.  It imports nothing
of ours: config.py calls it while it builds a Config, so it sits below config.py.
"""

from __future__ import annotations

from collections.abc import Container

STATUS_PORT_OFFSET = 90
ENGINE_PORT_OFFSET = 10000
MAX_PORT = 65535


def default_status_port(vllm_port: int) -> int:
    port = vllm_port + STATUS_PORT_OFFSET
    return port if port <= MAX_PORT else vllm_port - STATUS_PORT_OFFSET


def default_engine_port(vllm_port: int) -> int:
    """Where vLLM listens behind the front: 18000 for 8000 (instances differ in vllm.port, so
    they differ here too)."""
    port = vllm_port + ENGINE_PORT_OFFSET
    return port if port <= MAX_PORT else vllm_port - ENGINE_PORT_OFFSET


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


def values(given: Container[str], vllm_port: int, cuda_visible: str | None, gpu_device: int
           ) -> tuple[dict[str, int], tuple[str, str] | None]:
    """The derived defaults as {"section.key": value} for the keys no file set (`given`: the
    "section.key"s some file set), and the contradiction found as (key, why), or None;
    config.py sets them in the Config and turns the contradiction into the ConfigError that
    names the file."""
    out: dict[str, int] = {}
    if "status.port" not in given:
        out["status.port"] = default_status_port(vllm_port)
    if "front.engine_port" not in given:
        out["front.engine_port"] = default_engine_port(vllm_port)
    device, error = device_for(gpu_device if "gpu.device" in given else None, cuda_visible)
    if error is not None:
        return {}, ("gpu.device", error)
    if device is not None and device != gpu_device:
        out["gpu.device"] = device
    return out, None
