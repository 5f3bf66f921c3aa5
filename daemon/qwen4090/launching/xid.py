"""Xid errors: which ones a restart of vLLM survives and which need a GPU reset or a reboot.

Pure data, from NVIDIA's Xid catalog for Ampere and newer GPUs ("Resolution Bucket (Immediate
Action)": IGNORE, RESTART_APP, RESET_GPU, RESTART_BM;
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).  An application Xid
(a bad kernel, a page fault) ends the process that caused it and vLLM's restart heals it; a
reset/reboot Xid means every new vLLM would fail too, so the restart loop stops with a clear
message (exit code EX_GPU) instead of flapping through its budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    IGNORE = "ignore"  # informational; keep serving
    RESTART_APP = "restart_app"  # the application's fault: our normal restart heals it
    RESET_GPU = "reset_gpu"  # the GPU needs a reset (nvidia-smi -r, or reboot)
    REBOOT = "reboot"  # the machine needs a reboot (GPU off the bus, ...)

    @property
    def fatal(self) -> bool:
        return self in (Action.RESET_GPU, Action.REBOOT)


@dataclass(frozen=True)
class XidInfo:
    code: int
    name: str
    action: Action

    def describe(self) -> str:
        hint = {Action.IGNORE: "informational",
                Action.RESTART_APP: "an application error: restarting vLLM heals it",
                Action.RESET_GPU: "the GPU needs a reset (nvidia-smi -r with nothing running "
                                  "on it) or a reboot",
                Action.REBOOT: "the machine needs a reboot"}[self.action]
        return f"Xid {self.code} ({self.name}): {hint}"


_A = Action
CATALOG: dict[int, tuple[str, Action]] = {
    8: ("GPU stopped processing (channel idle timeout)", _A.RESTART_APP),
    13: ("graphics engine exception", _A.RESTART_APP),
    31: ("GPU memory page fault", _A.RESTART_APP),
    32: ("invalid or corrupted push buffer stream", _A.RESTART_APP),
    38: ("driver firmware error", _A.RESET_GPU),
    43: ("GPU stopped processing (reset channel)", _A.RESTART_APP),
    45: ("preemptive cleanup after an earlier error", _A.IGNORE),
    46: ("GPU stopped processing", _A.RESET_GPU),
    48: ("double-bit ECC error", _A.RESET_GPU),
    56: ("display engine error", _A.IGNORE),
    57: ("error programming video memory interface", _A.RESET_GPU),
    61: ("internal micro-controller breakpoint", _A.RESET_GPU),
    62: ("internal micro-controller halt", _A.RESET_GPU),
    63: ("ECC page retirement / row remapping recorded: reset to activate", _A.RESET_GPU),
    64: ("ECC page retirement / row remapping failure", _A.RESET_GPU),
    68: ("video decoder (NVDEC) exception", _A.RESTART_APP),
    69: ("graphics engine class error", _A.RESTART_APP),
    74: ("NVLink error", _A.RESET_GPU),
    79: ("GPU has fallen off the bus", _A.REBOOT),
    92: ("high single-bit ECC error rate", _A.RESET_GPU),
    94: ("contained ECC error", _A.RESTART_APP),
    95: ("uncontained ECC error", _A.RESET_GPU),
    109: ("context switch timeout", _A.RESTART_APP),
    119: ("GSP RPC timeout", _A.RESET_GPU),
    120: ("GSP error", _A.RESET_GPU),
    121: ("C2C link corrected error", _A.IGNORE),
    122: ("SPI PMU RPC read failure", _A.RESET_GPU),
    123: ("SPI PMU RPC write failure", _A.RESET_GPU),
    124: ("SPI PMU RPC erase failure", _A.RESET_GPU),
    136: ("link training failure", _A.REBOOT),
    140: ("unrecovered ECC error", _A.RESET_GPU),
    143: ("GPU initialization failure", _A.RESET_GPU),
    154: ("GPU recovery action changed", _A.RESET_GPU),
}


def classify(code: int) -> XidInfo:
    """Unknown codes are RESTART_APP: logged loudly, never a reason to stop serving."""
    name, action = CATALOG.get(code, ("not in qwen4090's table", Action.RESTART_APP))
    return XidInfo(code, name, action)
