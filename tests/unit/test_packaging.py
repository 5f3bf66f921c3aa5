"""The packaging files agree with the code: generated man page, unit directives."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest
from tests.support import unitfile
from tests.support.unitfile import Node

from qwen4090 import cli
from qwen4090.policy import EXIT_CODES

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
    assert unitfile.values((DEBIAN / name).read_text(), "Service", "ExecStartPre")[-1] == \
        f"-/usr/bin/qwen4090 check-config --config {config}"
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["Restart"] == "on-failure"
    assert s["KillMode"] == "mixed"  # SIGTERM to the supervisor only: it drains
    assert s["User"] == "qwen4090" and s["PrivateDevices"] == "no"
    assert s["LoadCredential"].startswith("api_key:")
    assert "VLLM_CACHE_ROOT=/var/cache/qwen4090" in s["Environment"]


# --- issue 9: the unit against the NVIDIA driver, restarts, OOM, upgrades, the template ----------

# /proc/devices of a driver before branch 545 (the major-195 group was "nvidia-frontend") and
# of the H200's driver 580 ("nvidia" and "nvidiactl"); char devices only matter here.
PROC_OLD = """Character devices:
  1 mem
  4 tty
195 nvidia-frontend
234 nvidia-caps
508 nvidia-uvm

Block devices:
  8 sd
"""
PROC_NEW = """Character devices:
  1 mem
  4 tty
195 nvidia
195 nvidiactl
237 nvidia-caps-imex-channels
238 nvidia-uvm
241 nvidia-caps

Block devices:
  8 sd
259 blkext
"""
NODES_OLD = [Node("/dev/nvidia0", 195, 0), Node("/dev/nvidiactl", 195, 255),
             Node("/dev/nvidia-modeset", 195, 254), Node("/dev/nvidia-uvm", 508, 0),
             Node("/dev/nvidia-uvm-tools", 508, 1)]
NODES_NEW = [Node("/dev/nvidia0", 195, 0), Node("/dev/nvidia7", 195, 7),
             Node("/dev/nvidiactl", 195, 255), Node("/dev/nvidia-uvm", 238, 0),
             Node("/dev/nvidia-uvm-tools", 238, 1), Node("/dev/nvidia-caps/nvidia-cap1", 241, 1),
             Node("/dev/nvidia-caps/nvidia-cap2", 241, 2)]
# What the units allowed before issue 9 (only the pre-545 group name for major 195).
ALLOWS_BEFORE = [("char-nvidia-frontend", "rw"), ("char-nvidia-uvm", "rw"),
                 ("char-nvidia-caps", "r")]


@pytest.mark.parametrize("name", unitfile.UNITS)
@pytest.mark.parametrize("proc,nodes", [(PROC_OLD, NODES_OLD), (PROC_NEW, NODES_NEW)],
                         ids=["driver-535", "driver-580"])
def test_device_allow_covers_every_nvidia_node(name: str, proc: str, nodes: list[Node]) -> None:
    allows = unitfile.device_allows(unitfile.shipped_unit(name))
    assert unitfile.uncovered(nodes, allows, proc) == []


def test_the_old_device_allow_lines_miss_driver_580() -> None:
    """The checker tells the two apart: the pre-issue-9 lines deny /dev/nvidia0 and nvidiactl."""
    bad = unitfile.uncovered(NODES_NEW, ALLOWS_BEFORE, PROC_NEW)
    assert [b.split()[0] for b in bad] == ["/dev/nvidia0", "/dev/nvidia7", "/dev/nvidiactl"]
    assert unitfile.uncovered(NODES_OLD, ALLOWS_BEFORE, PROC_OLD) == []


def test_device_allow_parser_follows_systemd_globbing_and_access() -> None:
    allows = [("char-nvidia*", "r"), ("/dev/null", "rw")]
    assert unitfile.allowed_majors(allows, PROC_NEW) == {195: {"r"}, 237: {"r"}, 238: {"r"},
                                                         241: {"r"}}
    assert "needs rw" in unitfile.uncovered([Node("/dev/nvidia0", 195, 0)], allows, PROC_NEW)[0]
    assert unitfile.char_groups("Block devices:\n  8 sd\n") == []


def _sec(v: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(min|s)?", v)
    assert m, v
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.parametrize("name", unitfile.UNITS)
def test_restart_oom_and_limits(name: str) -> None:
    text = unitfile.shipped_unit(name)
    u = {k: v for k, v in unitfile.parse_unit(text)["Unit"]}
    s = {k: v for k, v in unitfile.parse_unit(text)["Service"]}
    # exit 69 (GPU needs a reset) and 78 (config error) are never restarted
    assert set(s["RestartPreventExitStatus"].split()) == {"69", "78"}
    assert {int(c) for c in s["RestartPreventExitStatus"].split()} <= set(EXIT_CODES)
    # a crash loop ends failed: Burst+1 starts fit in the interval with RestartSec between
    burst, interval = int(u["StartLimitBurst"]), _sec(u["StartLimitIntervalSec"])
    assert "StartLimitBurst" not in s and "StartLimitIntervalSec" not in s  # [Unit] only
    assert burst * _sec(s["RestartSec"]) < interval and burst >= 2
    assert s["OOMPolicy"] == "continue" and int(s["OOMScoreAdjust"]) < 0
    assert int(s["LimitNOFILE"]) >= 65536
    for mod in ("modprobe@nvidia.service", "modprobe@nvidia-uvm.service"):
        assert mod in u["Wants"].split() and mod in u["After"].split()
    pre = unitfile.values(text, "Service", "ExecStartPre")
    assert pre[0] == "+/usr/lib/qwen4090/nvidia-device-nodes"
    inst = (DEBIAN / "qwen4090.install").read_text()
    assert "packaging/lib/nvidia-device-nodes usr/lib/qwen4090/" in inst


def test_template_instances_do_not_share_state_home_or_cache() -> None:
    s = dict(unitfile.parse_unit(unitfile.shipped_unit("qwen4090@.service"))["Service"])
    env = dict(kv.split("=", 1) for kv in s["Environment"].split())
    assert s["StateDirectory"] == "qwen4090/%i" and env["HOME"] == "/var/lib/qwen4090/%i"
    assert s["CacheDirectory"] == "qwen4090/%i"
    assert env["VLLM_CACHE_ROOT"] == "/var/cache/qwen4090/%i"
    assert s["LoadCredential"] == "api_key:qwen4090-%i.api_key"


def test_upgrades_never_restart_and_needrestart_leaves_units_alone() -> None:
    rules = (DEBIAN / "rules").read_text()
    calls = [line for line in rules.splitlines() if line.strip().startswith("dh_installsystemd")]
    assert len(calls) == 2
    for c in calls:
        assert "--no-restart-after-upgrade" in c and "--no-stop-on-upgrade" in c
        assert "-R" not in c.split() and "--no-start" in c
    assert "qwen4090@" in rules
    postinst = (DEBIAN / "qwen4090.postinst").read_text()
    assert "try-restart" not in postinst and "restart to use the new version" in postinst
    assert "qwen4090@*.service" in postinst
    conf = (ROOT / "packaging/needrestart/qwen4090.conf").read_text()
    m = re.search(r"override_rc\}->\{qr\((.*)\)\} = 0;", conf)
    assert m, conf
    pat = re.compile(m.group(1))
    assert pat.search("qwen4090.service") and pat.search("qwen4090@gpu1.service")
    assert not pat.search("qwen4090-other.service")
    assert "packaging/needrestart/qwen4090.conf etc/needrestart/conf.d/" in \
        (DEBIAN / "qwen4090.install").read_text()


def test_sysusers_without_dh_sequence_installsysusers() -> None:
    """Ubuntu 22.04's debhelper 13.6 has no dh-sequence-installsysusers: the file is installed
    by debian/rules and the user created by the postinst, before the tmpfiles snippet."""
    control = (DEBIAN / "control").read_text()
    assert "dh-sequence-installsysusers" not in control
    assert "systemd | systemd-standalone-sysusers | systemd-sysusers" in control
    assert "usr/lib/sysusers.d/qwen4090.conf" in (DEBIAN / "rules").read_text()
    postinst = (DEBIAN / "qwen4090.postinst").read_text()
    assert postinst.index("systemd-sysusers") < postinst.index("#DEBHELPER#")


def test_purge_keeps_the_models_and_says_so() -> None:
    postrm = (DEBIAN / "qwen4090.postrm").read_text()
    assert "! -name models" in postrm and "kept the models" in postrm
    assert "rm -rf /var/lib/qwen4090 " not in postrm.split("then", 1)[1].split("find")[0]
    assert "/var/lib/qwen4090/models" in (DEBIAN / "README.Debian").read_text()


def test_package_ships_examples_and_recommends_venv() -> None:
    assert (DEBIAN / "qwen4090.examples").read_text().split() == ["packaging/examples/*"]
    assert list((ROOT / "packaging/examples").glob("*.json"))
    control = (DEBIAN / "control").read_text()
    assert re.search(r"^(Depends|Recommends):[^:]*python3-venv", control, re.M | re.S)
    readme = (DEBIAN / "README.Debian").read_text()
    for step in ("install-runtime", "fetch-model", "check-config", "systemctl start qwen4090",
                 "qwen4090@"):
        assert step in readme


def _man_sections(page: str) -> dict[str, list[str]]:
    """.SH NAME -> the .B words of its .TP entries, roff escapes undone."""
    out: dict[str, list[str]] = {}
    sec = ""
    lines = page.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(".SH "):
            sec = line[4:].strip().strip('"')
            out[sec] = []
        elif line == ".TP" and i + 1 < len(lines) and lines[i + 1].startswith(".B "):
            out[sec].append(lines[i + 1][3:].strip().replace("\\-", "-"))
    return out


def test_man_page_covers_every_command_and_exit_code() -> None:
    page = (ROOT / "packaging/man/qwen4090.8").read_text()
    sections = _man_sections(page)
    assert sorted(sections["COMMANDS"]) == sorted(cli.COMMANDS)
    # 2 is argparse's usage error (and `qwen4090` without a command), not in policy.EXIT_CODES
    with pytest.raises(SystemExit) as e:
        cli.main(["--no-such-option"])
    assert e.value.code == 2 and cli.main([]) == 2
    assert sorted(int(c) for c in sections["EXIT STATUS"]) == sorted({*EXIT_CODES, 2})


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_nvidia_device_nodes_script_creates_missing_uvm_nodes(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    (proc / "driver/nvidia").mkdir(parents=True)
    dev.mkdir()
    script = ROOT / "packaging/lib/nvidia-device-nodes"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "QWEN4090_PROC": str(proc),
           "QWEN4090_DEV": str(dev)}
    # no driver loaded: nothing happens
    r = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and list(dev.iterdir()) == []
    (proc / "driver/nvidia/version").write_text("NVRM version: 580\n")
    (proc / "devices").write_text(PROC_NEW)
    r = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    st = os.stat(dev / "nvidia-uvm-tools")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (238, 1)
    assert "created" in r.stdout
    (proc / "devices").write_text(PROC_NEW.replace("238 nvidia-uvm\n", ""))
    (dev / "nvidia-uvm").unlink()
    r = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "no nvidia-uvm" in r.stderr


def test_legacy_setup_cfg_matches_pyproject() -> None:
    """Ubuntu 22.04's setuptools 59 builds from packaging/legacy-setup.cfg (build-deb.sh)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read_string((ROOT / "packaging/legacy-setup.cfg").read_text())
    reqs = [r.strip() for r in cfg["options"]["install_requires"].strip().splitlines()]
    assert reqs == [r.replace('"', "'") for r in project["dependencies"]]
    assert cfg["metadata"]["name"] == project["name"]
    assert cfg["metadata"]["version"] == "@VERSION@"
    scripts = cfg["options.entry_points"]["console_scripts"].strip()
    assert scripts == " = ".join(next(iter(project["scripts"].items())))
