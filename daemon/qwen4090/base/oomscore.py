"""vLLM more killable than its supervisor under memory pressure (as postgresql@ does for its
backends): the unit gives the supervisor OOMScoreAdjust=-500, so a kernel OOM kill takes vLLM
(which the supervisor restarts, OOMPolicy=continue keeps the unit up) rather than the supervisor.

Raising a process's oom_score_adj needs no privilege (only lowering it below the value systemd
set does), so the supervisor writes the value of each vLLM it starts, right after the spawn and
before vLLM forks its EngineCore and workers, which inherit it.
"""

from __future__ import annotations

from pathlib import Path

# Above an ordinary process's 0: on a host out of memory, vLLM (restartable, and by far the
# biggest) goes first.
VLLM_OOM_SCORE_ADJ = 200
MAX_OOM_SCORE_ADJ = 1000


def target(current: int, wanted: int = VLLM_OOM_SCORE_ADJ) -> int:
    """Never lower it (that would need CAP_SYS_RESOURCE), never beyond the kernel's maximum."""
    return min(max(current, wanted), MAX_OOM_SCORE_ADJ)


def raise_for(pid: int, wanted: int = VLLM_OOM_SCORE_ADJ, proc: Path = Path("/proc")) -> str | None:
    """Write the target into /proc/PID/oom_score_adj; None when done, else why not."""
    path = proc / str(pid) / "oom_score_adj"
    try:
        current = int(path.read_text().strip())
        value = target(current, wanted)
        if value != current:
            path.write_text(f"{value}\n")
    except (OSError, ValueError) as e:
        return f"cannot set {path}: {e}"
    return None
