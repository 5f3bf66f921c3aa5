"""The packaging files agree with the code: generated man page, unit directives."""

from __future__ import annotations

import configparser
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# packaging/debian in the repository; debian/ in the source package (autopkgtest)
DEBIAN = next((d for d in (ROOT / "packaging" / "debian", ROOT / "debian") if d.is_dir()),
              ROOT / "packaging" / "debian")


def test_toml5_man_page_matches_the_code() -> None:
    spec = importlib.util.spec_from_file_location("render_toml5",
                                                  ROOT / "packaging/man/render_toml5.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = (ROOT / "packaging/man/qwen4090.toml.5").read_text()
    assert page == mod.render(), ("packaging/man/qwen4090.toml.5 is stale; run: PYTHONPATH=daemon "
                                  "python3 packaging/man/render_toml5.py > "
                                  "packaging/man/qwen4090.toml.5")


def unit(name: str) -> configparser.RawConfigParser:
    p = configparser.RawConfigParser(strict=False, interpolation=None)
    p.optionxform = str  # type: ignore[assignment,method-assign]
    # repeated keys (DeviceAllow=, SystemCallFilter=) are fine for what is checked here
    p.read_string((DEBIAN / name).read_text())
    return p


@pytest.mark.parametrize("name,config", [
    ("qwen4090.service", "/etc/qwen4090/qwen4090.toml"),
    ("qwen4090@.service", "/etc/qwen4090/instances/%i.toml"),
])
def test_unit_runs_the_supervisor_as_the_issue_asks(name: str, config: str) -> None:
    s = unit(name)["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert s["ExecStart"] == f"/usr/bin/qwen4090 run --config {config}"
    assert s["ExecStartPre"] == f"-/usr/bin/qwen4090 check-config --config {config}"
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["Restart"] == "on-failure" and s["RestartPreventExitStatus"] == "78"
    assert s["KillMode"] == "mixed"  # SIGTERM to the supervisor only: it drains
    assert s["User"] == "qwen4090" and s["PrivateDevices"] == "no"
    assert s["LoadCredential"].startswith("api_key:")
    assert "VLLM_CACHE_ROOT=/var/cache/qwen4090" in s["Environment"]
