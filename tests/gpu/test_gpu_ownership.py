"""Issue 8.5 on the GPU: a supervisor SIGKILLed outside systemd leaves vLLM serving with its GPU
memory; the next `qwen4090 run` stops that orphaned group (verified by its record), waits for
the memory to be released, and starts its own.  Run by `bash scripts/gpu/ownership.sh` on the
H200 (results in $OUT/results-ownership.tgz: orphan.json and both supervisor logs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import lab
import pytest

READY = r'"event":"ready_notified"'
GIVING_UP = r'"event":"giving_up"'


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.gpu
def test_gpu_orphan_is_stopped_and_its_memory_released(tmp_path: Path) -> None:
    conf = lab.write_config(tmp_path / "q.toml")
    first = lab.supervisor(conf, lab.RESULTS / "orphan-first.log")
    second = None
    engines: list[int] = []
    res: dict[str, Any] = {}
    try:
        t_ready, _ = first.wait_line(READY, 540, fail=GIVING_UP)
        res["first_ready_s"] = round(t_ready, 2)
        engines = lab.engine_pids() + [int(ev["pid"]) for _, ev in lab.events(
            first, "child_spawned")]
        assert len(engines) >= 2, "no EngineCore process found"
        res["vllm_pids"] = engines
        res["nvml_used_mib_serving"] = lab.nvml_used_mib()
        os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor only: vLLM is in its own session
        first.proc.wait(30)
        status, _ = lab.get("/health")
        res["orphan_health"] = status
        assert status == 200, "the orphaned vLLM should still serve"
        res["nvml_used_mib_orphan"] = lab.nvml_used_mib()
        t0 = time.monotonic()
        second = lab.supervisor(conf, lab.RESULTS / "orphan-second.log")
        t_found, found = second.wait_line(r'"event":"orphan_found"', 60)
        t_stopped, stopped = second.wait_line(r'"event":"orphan_stopped"', 120)
        released = second.find(r'"event":"gpu_released"') or second.find(
            r'"event":"gpu_not_released"')
        t_ready2, _ = second.wait_line(READY, 540, fail=GIVING_UP)
        res.update({
            "orphan_found_s": round(t_found, 2), "orphan_stopped_s": round(t_stopped, 2),
            "orphan_found": found[-400:], "orphan_stopped": stopped[-300:],
            "gpu_release": released[1][-300:] if released else None,
            "second_ready_s": round(t_ready2, 2),
            "second_ready_wall_s": round(time.monotonic() - t0, 2),
            "nvml_used_mib_second_serving": lab.nvml_used_mib()})
        assert all(str(pid) in found for pid in engines)
        assert not [pid for pid in engines if _alive(pid)]
    finally:
        lab.save("orphan", res)
        if second is not None:
            second.stop()
        first.kill()
        for pid in engines:  # whatever happened, no orphan survives the test
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
