"""A stand-in for nvidia-ml-py's ``pynvml`` module: the calls probes/nvml.py makes, answering
like one H200 (numbers from /work/shared/gpu: 143771 MiB total, 615 MiB reserved).

Standard library only, like the real module, so a test can copy this file into a fake venv's
site-packages and let the package find it there the way it finds vLLM's copy.  ``STATE`` holds
what the "GPU" reports; a test changes it to make the next sample differ.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

MIB = 1024 ** 2
NAME = "NVIDIA H200 (fake pynvml)"
STATE: dict[str, Any] = {
    "total": 143771 * MIB, "reserved": 615 * MIB, "used": 20480 * MIB,
    "temperature": 41, "power_mw": 123_000, "limit_mw": 700_000, "util": 37, "util_mem": 12,
    "reasons": 0, "ecc": (0, 0), "inits": 0,
    "count": 1,  # GPUs: handles (and NVML indices) 0 .. count-1
    "migs": {},  # MIG instance UUID -> the NVML index of the GPU that holds it
    # the lent H200's driver (/work/shared/gpu/RESULTS.md): 580.159.04, CUDA 13.0
    "driver": "580.159.04", "cuda_driver": 13000,
}
# Each GPU's UUID, by NVML index; a MIG instance's handle is MIG_HANDLE + its GPU's index.
UUIDS = [f"GPU-{i}e6b2b1c-7d1a-4c3e-9f00-a1b2c3d4e5f{i}" for i in range(8)]
MIG_HANDLE = 1000

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_FOUND = 6
nvmlMemory_v2 = 0x02000028
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def nvmlInit() -> None:
    STATE["inits"] += 1


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return str(STATE["driver"])


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(STATE["cuda_driver"])


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return int(STATE["cuda_driver"])


def nvmlDeviceGetCount() -> int:
    return int(STATE["count"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < STATE["count"]:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # one GPU here, unless a test adds some
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return UUIDS[handle]


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> int:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    if text in STATE["migs"]:
        return MIG_HANDLE + int(STATE["migs"][text])
    for index in range(STATE["count"]):
        if UUIDS[index] == text:  # whole UUIDs only, as NVML
            return index
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: int) -> int:
    if handle >= MIG_HANDLE:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # a MIG instance: ask for its GPU first
    return handle


def nvmlDeviceIsMigDeviceHandle(handle: int) -> int:
    return int(handle >= MIG_HANDLE)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: int) -> int:
    return handle - MIG_HANDLE


def nvmlDeviceGetName(handle: int) -> str:
    return NAME


def nvmlDeviceGetMemoryInfo(handle: int, version: int | None = None) -> Any:
    s = STATE
    info = SimpleNamespace(total=s["total"], used=s["used"], free=s["total"] - s["used"])
    if version is not None:
        info.reserved = s["reserved"]
    return info


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[Any]:
    return []


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[Any]:
    return []


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return int(STATE["temperature"])


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return int(STATE["power_mw"])


def nvmlDeviceGetEnforcedPowerLimit(handle: int) -> int:
    return int(STATE["limit_mw"])


def nvmlDeviceGetUtilizationRates(handle: int) -> Any:
    return SimpleNamespace(gpu=STATE["util"], memory=STATE["util_mem"])


def nvmlDeviceGetCurrentClocksEventReasons(handle: int) -> int:
    return int(STATE["reasons"])


def nvmlDeviceGetTotalEccErrors(handle: int, kind: int, counter: int) -> int:
    return int(STATE["ecc"][kind])


def nvmlEventSetCreate() -> Any:
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # as in a container without event support
