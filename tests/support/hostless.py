"""A pytest plugin (pyproject's addopts: ``-p tests.support.hostless``): no unit test reads
this machine's memory.

``restart.standby = "auto"`` (the default) chooses from the host's memory (plan.host_memory),
so a test that let it read the machine it runs on would choose "sleep" on a large box and
"off" on a small one.  Here it is "not known" (auto: off, as the standby was before "auto"
became the default); a test that means a host gives one (GpuParts(host_memory=...), Facts(host=
...), or its own monkeypatch), and one marked ``real_host`` reads the machine.  Only tests/unit:
the integration and GPU tests run on the machine they mean (and tests/unit cannot have a
conftest.py: mypy would see two top-level "conftest" modules, with tests/gpu's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen4090.launching import plan

NO_HOST = "not read by the unit tests (tests/support/hostless.py)"
UNIT = Path(__file__).resolve().parents[1] / "unit"


@pytest.fixture(autouse=True)
def no_host_memory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if UNIT in request.node.path.parents and request.node.get_closest_marker("real_host") is None:
        monkeypatch.setattr(plan, "host_memory", lambda: NO_HOST)
