"""The shipped units' DeviceAllow= against the real NVIDIA driver of the GPU machine: every
character device /dev/nvidia* (and /dev/nvidia-caps/*) must be allowed, as systemd resolves
char-NAME through /proc/devices at start (tests/support/unitfile.py). No vLLM, well under a
second."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tests.support import unitfile

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", unitfile.UNITS)
def test_every_nvidia_device_is_allowed_by_the_shipped_unit(name: str) -> None:
    nodes = unitfile.nvidia_nodes()
    if not nodes:
        pytest.skip("no /dev/nvidia* character devices on this machine")
    proc = Path("/proc/devices").read_text()
    groups = [g for g in unitfile.char_groups(proc) if g[1].startswith("nvidia")]
    allows = unitfile.device_allows(unitfile.shipped_unit(name))
    results = os.environ.get("QWEN4090_GPU_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"devices-{name}.json").write_text(json.dumps({
            "proc_devices_nvidia": groups, "nodes": [n.__dict__ for n in nodes],
            "allowed_majors": {str(k): "".join(sorted(v)) for k, v in
                               unitfile.allowed_majors(allows, proc).items()}}, indent=1))
    print(f"{name}: /proc/devices {groups}; nodes {[(n.path, n.major) for n in nodes]}")
    assert any(n.path.endswith("nvidiactl") for n in nodes), nodes
    assert unitfile.uncovered(nodes, allows, proc) == []
