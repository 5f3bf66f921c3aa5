"""The packaging files agree with the code: generated man page, unit directives."""

from __future__ import annotations

import configparser
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.support import unitfile
from tests.support.unitfile import Node

from qwen4090.commandline import cli
from qwen4090.decide.policy import EXIT_CODES

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
    # exit 69 (GPU needs a reset), 78 (config error) and 75 (the supervisor's crash-loop budget
    # spent: it retried already; issue 19.3) are never restarted
    assert set(s["RestartPreventExitStatus"].split()) == {"69", "75", "78"}
    assert {int(c) for c in s["RestartPreventExitStatus"].split()} <= set(EXIT_CODES)
    # a crash loop ends failed: Burst+1 starts fit in the interval with RestartSec between
    burst, interval = int(u["StartLimitBurst"]), _sec(u["StartLimitIntervalSec"])
    assert "StartLimitBurst" not in s and "StartLimitIntervalSec" not in s  # [Unit] only
    assert burst * _sec(s["RestartSec"]) < interval and burst >= 2
    # issue 31.4: a clean stop (an administrator's stop or restart) flushes the start count,
    # as root outside the sandbox, never failing the stop; a death leaves it counted
    (post,) = unitfile.values(text, "Service", "ExecStopPost")
    assert post.startswith("-+/bin/sh -c ") and "reset-failed %n" in post
    assert '"$$SERVICE_RESULT" != success' in post
    # issue 31.1: the client port's socket is kept by systemd across restarts (fdstore.py)
    assert int(s["FileDescriptorStoreMax"]) >= 1 and s["NotifyAccess"] == "main"
    # issue 31.7: the runtime's and the models' mounts first; the models read-only
    assert set(u["RequiresMountsFor"].split()) == {"/opt/qwen4090", "/var/lib/qwen4090"}
    assert "-/var/lib/qwen4090/models" in unitfile.values(text, "Service", "ReadOnlyPaths")
    assert s["OOMPolicy"] == "continue" and int(s["OOMScoreAdjust"]) < 0
    assert int(s["LimitNOFILE"]) >= 65536
    for mod in ("modprobe@nvidia.service", "modprobe@nvidia-uvm.service"):
        assert mod in u["Wants"].split() and mod in u["After"].split()


NODES_UNIT = "qwen4090-nvidia-nodes.service"
HELPER = "/usr/libexec/qwen4090/nvidia-device-nodes"


def _all(text: str, section: str, key: str) -> list[str]:
    """Every value of a list-valued key (Wants=, After=...), over its repeated lines."""
    return [w for v in unitfile.values(text, section, key) for w in v.split()]


@pytest.mark.parametrize("name", unitfile.UNITS)
def test_device_nodes_are_made_by_a_unit_of_their_own_not_a_plus_execstartpre(name: str) -> None:
    """Issue 19.2: "+" does not lift the unit's device cgroup (systemd issue 26035), so mknod and
    nvidia-modprobe cannot run from an ExecStartPre=+ of a DevicePolicy=closed unit: the
    oneshot qwen4090-nvidia-nodes.service does it, wanted and ordered before both units."""
    text = unitfile.shipped_unit(name)
    for key in ("ExecStartPre", "ExecStartPost", "ExecStart", "ExecReload", "ExecStop"):
        for cmd in unitfile.values(text, "Service", key):
            assert not cmd.lstrip("-@:!").startswith("+"), (key, cmd)
            assert "nvidia-device-nodes" not in cmd, (key, cmd)
    assert NODES_UNIT in _all(text, "Unit", "Wants") and NODES_UNIT in _all(text, "Unit", "After")
    assert NODES_UNIT not in _all(text, "Unit", "Requires")  # no GPU, no driver: still starts
    assert dict(unitfile.parse_unit(text)["Service"])["DevicePolicy"] == "closed"


def test_the_node_unit_runs_the_helper_from_libexec_outside_any_device_policy() -> None:
    text = (DEBIAN / NODES_UNIT).read_text()
    u, s = dict(unitfile.parse_unit(text)["Unit"]), dict(unitfile.parse_unit(text)["Service"])
    assert s["Type"] == "oneshot" and s["ExecStart"] == HELPER
    # no sandbox that keeps it from mknod and modprobe, and root
    for key in ("DevicePolicy", "DeviceAllow", "PrivateDevices", "User", "DynamicUser",
                "ProtectKernelModules", "ReadOnlyPaths", "InaccessiblePaths"):
        assert key not in s, key
    # ... and nothing else (issue 31.7: it scored 9.6 UNSAFE; scripts/system-test.sh holds
    # its exposure under QWEN4090_SECURITY_MAX as the main units')
    caps = set(s["CapabilityBoundingSet"].split())
    assert {"CAP_MKNOD", "CAP_SYS_MODULE"} <= caps and "CAP_SYS_ADMIN" not in caps
    assert s["NoNewPrivileges"] == s["PrivateNetwork"] == s["ProtectKernelTunables"] == "yes"
    assert s["ProtectSystem"] == "strict"  # /dev stays writable: an API file system
    assert "@module" in s["SystemCallFilter"] and "mknod" in s["SystemCallFilter"].split()
    # skipped (not failed) where no NVIDIA driver is loaded, after modprobe@ had its chance
    assert u["ConditionPathExists"] == "/proc/driver/nvidia/version"
    for mod in ("modprobe@nvidia.service", "modprobe@nvidia-uvm.service"):
        assert mod in _all(text, "Unit", "Wants") and mod in _all(text, "Unit", "After")
    # pulled in by the units, never enabled on its own
    assert "Install" not in unitfile.parse_unit(text)
    inst = (DEBIAN / "qwen4090.install").read_text()
    assert "packaging/lib/nvidia-device-nodes usr/libexec/qwen4090/" in inst
    assert "usr/lib/qwen4090" not in inst
    assert os.access(ROOT / "packaging/lib/nvidia-device-nodes", os.X_OK)
    rules = (DEBIAN / "rules").read_text()
    assert re.search(r"dh_installsystemd [^\n]*\\\n\s*--name=qwen4090-nvidia-nodes "
                     + re.escape(NODES_UNIT), rules)


def test_template_instances_do_not_share_state_home_or_cache() -> None:
    s = dict(unitfile.parse_unit(unitfile.shipped_unit("qwen4090@.service"))["Service"])
    env = dict(kv.split("=", 1) for kv in s["Environment"].split())
    assert s["StateDirectory"] == "qwen4090/%i" and env["HOME"] == "/var/lib/qwen4090/%i"
    assert s["CacheDirectory"] == "qwen4090/%i"
    assert env["VLLM_CACHE_ROOT"] == "/var/cache/qwen4090/%i"
    assert s["LoadCredential"] == "api_key:qwen4090-%i.api_key"
    # each instance under its own journal identifier (issue 19.6), as postgresql@
    assert s["SyslogIdentifier"] == "qwen4090-%i"


def test_upgrades_never_restart_and_needrestart_leaves_units_alone() -> None:
    rules = (DEBIAN / "rules").read_text()
    calls = [line for line in rules.splitlines() if line.strip().startswith("dh_installsystemd")]
    assert len(calls) == 3  # qwen4090, qwen4090@, qwen4090-nvidia-nodes
    for c in calls:
        assert "--no-restart-after-upgrade" in c and "--no-stop-on-upgrade" in c
        assert "-R" not in c.split() and "--no-start" in c
        # not enabled by the install: it would fail (no model, 78) at every boot (issue 19.6)
        assert "--no-enable" in c
    assert "qwen4090@" in rules
    postinst = (DEBIAN / "qwen4090.postinst").read_text()
    assert "try-restart" not in postinst and "restart to use the new version" in postinst
    assert "qwen4090@*.service" in postinst
    # --no-start drops debhelper's daemon-reload: the postinst reloads on configure, before
    # it says what to restart (issue 19.1)
    m = re.search(r'if \[ "\$1" = configure \][^\n]*\n\s*systemctl --system daemon-reload',
                  postinst)
    assert m and m.start() < postinst.index("restart to use the new version")
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


def _purge(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The postrm's purge with its three directories moved under tmp_path."""
    script = (DEBIAN / "qwen4090.postrm").read_text()
    for d in ("/var/cache/qwen4090", "/var/lib/qwen4090", "/etc/qwen4090"):
        script = script.replace(d, str(tmp_path / d.strip("/")))
    (tmp_path / "postrm").write_text(script.replace("#DEBHELPER#", ""))
    return tmp_path, subprocess.run(["sh", str(tmp_path / "postrm"), "purge"],
                                    capture_output=True, text=True)


def _tree(root: Path) -> None:
    for f in ("var/lib/qwen4090/models/m/config.json", "var/lib/qwen4090/learned.json",
              "var/lib/qwen4090/gpu1/kv_budget.json", "var/lib/qwen4090/.hidden",
              "var/cache/qwen4090/torch/x", "etc/qwen4090/qwen4090.toml"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("x")


def test_purge_keeps_the_models_and_says_so(tmp_path: Path) -> None:
    _tree(tmp_path)
    root, r = _purge(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "kept the models in" in r.stdout
    assert sorted(p.name for p in (root / "var/lib/qwen4090").iterdir()) == ["models"]
    assert (root / "var/lib/qwen4090/models/m/config.json").is_file()
    assert not (root / "var/cache/qwen4090").exists() and not (root / "etc/qwen4090").exists()
    # without a model nothing is left
    shutil.rmtree(root / "var/lib/qwen4090/models/m")
    root, r = _purge(tmp_path)
    assert r.returncode == 0 and not (root / "var/lib/qwen4090").exists()
    assert "/var/lib/qwen4090/models" in (DEBIAN / "README.Debian").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="mount needs root")
def test_purge_empties_mount_points_and_keeps_them(tmp_path: Path) -> None:
    """/var/cache/qwen4090 or a directory in /var/lib/qwen4090 on its own file system: rm -rf
    of a mount point fails (EBUSY), and set -e made the whole purge fail (issue 19.6)."""
    _tree(tmp_path)
    mounts = [tmp_path / "var/cache/qwen4090", tmp_path / "var/lib/qwen4090/gpu1"]
    for m in mounts:
        if subprocess.run(["mount", "-t", "tmpfs", "qwen4090-test", str(m)]).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
    try:
        for m in mounts:
            (m / "sub").mkdir()
            (m / "sub/file").write_text("x")
        root, r = _purge(tmp_path)
        assert r.returncode == 0, r.stderr
        for m in mounts:
            assert os.path.ismount(m) and list(m.iterdir()) == []
            assert f"{m} is a mount point" in r.stdout
        assert sorted(p.name for p in (root / "var/lib/qwen4090").iterdir()) == ["gpu1", "models"]
    finally:
        for m in mounts:
            subprocess.run(["umount", str(m)])


def test_package_ships_examples_and_recommends_venv() -> None:
    assert (DEBIAN / "qwen4090.examples").read_text().split() == ["packaging/examples/*"]
    assert list((ROOT / "packaging/examples").glob("*.json"))
    control = (DEBIAN / "control").read_text()
    assert re.search(r"^(Depends|Recommends):[^:]*python3-venv", control, re.M | re.S)
    readme = (DEBIAN / "README.Debian").read_text()
    for step in ("install-runtime", "fetch-model", "check-config", "systemctl start qwen4090",
                 "qwen4090@"):
        assert step in readme


def test_examples_name_where_the_package_installs_them() -> None:
    """dh_installexamples puts them in /usr/share/doc/qwen4090/examples (issue 19.6)."""
    places = [*(ROOT / "packaging/examples").rglob("*"), DEBIAN / "README.Debian",
              ROOT / "packaging/man/qwen4090.8", ROOT / "docs/packaging.md"]
    # (/usr/share/qwen4090/ holds one file: the config's template, issue 31.3)
    stale = [str(p) for p in places if p.is_file()
             and re.search(r"/usr/share/qwen4090(?!/qwen4090\.toml)", p.read_text())]
    assert stale == []
    assert "etc/qwen4090/qwen4090.toml usr/share/qwen4090/" in \
        (DEBIAN / "qwen4090.install").read_text().splitlines()


def test_lintian_override_matches_debian_12_and_13_unit_paths() -> None:
    lines = [ln for ln in (DEBIAN / "qwen4090.lintian-overrides").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    covered: set[tuple[str, str]] = set()
    for line in lines:
        m = re.fullmatch(r"qwen4090: (\S+) \[(.*)\]", line)
        assert m, line
        # lintian's override context: * matches any characters
        pattern = re.compile(".*".join(re.escape(part) for part in m.group(2).split("*")))
        for unit in ("qwen4090.service", NODES_UNIT):  # lintian names both (not templates)
            for unitdir in ("lib/systemd/system", "usr/lib/systemd/system"):  # Debian 12, 13
                if pattern.fullmatch(f"{unitdir}/{unit}"):
                    covered.add((unit, unitdir))
    assert len(covered) == 4, covered


def test_news_debian_is_installed_and_says_what_changed_for_the_sysadmin() -> None:
    """debhelper installs debian/NEWS as NEWS.Debian (apt-listchanges shows it)."""
    news = (DEBIAN / "NEWS").read_text()
    head = news.splitlines()[0]
    assert re.fullmatch(r"qwen4090 \([0-9][^)]*\) unstable; urgency=\w+", head), head
    for fact in ("exit 75", "RestartPreventExitStatus=69 75 78", "systemctl enable --now qwen4090",
                 "daemon-reload", "qwen4090-NAME", "mount point"):
        assert fact in news, fact


SCRIPT = ROOT / "scripts/build-deb.sh"
_TOOLS = all(shutil.which(t) for t in ("git", "dpkg-parsechangelog", "dpkg"))


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()


def _entry(version: str, dist: str = "unstable") -> str:
    return (f"qwen4090 ({version}) {dist}; urgency=medium\n\n  * x\n\n"
            f" -- t <t@example.org>  Tue, 01 Dec 2026 12:00:00 +0000\n\n")


def _build_version(repo: Path) -> str:
    r = subprocess.run(["sh", str(repo / "scripts/build-deb.sh"), "--print-version"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _newer(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b]).returncode == 0


@pytest.mark.skipif(not (_TOOLS and SCRIPT.is_file()), reason="needs git, dpkg-dev, build-deb.sh")
def test_every_build_gets_a_version_that_orders(tmp_path: Path) -> None:
    """Releases from the changelog, snapshots between them, uncommitted trees after their
    commit: each later build sorts after the one before (issue 19.1)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "packaging/debian").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts/build-deb.sh")
    changelog = repo / "packaging/debian/changelog"

    def release(version: str, dist: str = "unstable") -> None:
        changelog.write_text(_entry(version, dist) + (changelog.read_text()
                                                        if changelog.exists() else ""))
        (repo / "pyproject.toml").write_text(f'[project]\nversion = "{version}"\n')
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"release {version}")

    _git(repo, "init", "-q")
    release("0.1.0")
    seen = [_build_version(repo)]
    assert seen == ["0.1.0"]  # the release commit, clean tree
    (repo / "code.py").write_text("1")
    seen.append(_build_version(repo))  # uncommitted: after its commit
    assert re.fullmatch(r"0\.1\.0\+git\d{10}\.0\.[0-9a-f]{7}\.d\d+", seen[-1]), seen[-1]
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "work")
    h = _git(repo, "rev-parse", "--short=7", "HEAD")
    seen.append(_build_version(repo))
    assert re.fullmatch(rf"0\.1\.0\+git\d{{10}}\.1\.{h}", seen[-1]), seen[-1]
    (repo / "code.py").write_text("2")
    _git(repo, "commit", "-q", "-am", "more work")
    seen.append(_build_version(repo))
    assert ".2." in seen[-1]
    release("0.2.0", "UNRELEASED")  # the next version opened: snapshots before it
    seen.append(_build_version(repo))
    assert seen[-1].startswith("0.2.0~git")
    (repo / "code.py").write_text("3")
    _git(repo, "commit", "-q", "-am", "work on 0.2.0")
    seen.append(_build_version(repo))
    # released: the entry's distribution set (dch -r), the version line unchanged
    changelog.write_text(changelog.read_text().replace("UNRELEASED", "unstable", 1))
    _git(repo, "commit", "-q", "-am", "release 0.2.0")
    seen.append(_build_version(repo))
    assert seen[-1] == "0.2.0"
    (repo / "code.py").write_text("4")
    _git(repo, "commit", "-q", "-am", "after 0.2.0")
    seen.append(_build_version(repo))
    assert seen[-1].startswith("0.2.0+git")
    release("0.2.1")
    seen.append(_build_version(repo))
    assert seen[-1] == "0.2.1"
    for older, newer in itertools.pairwise(seen):
        assert _newer(newer, older), (older, newer)
    # pyproject.toml and the changelog must agree
    (repo / "pyproject.toml").write_text('[project]\nversion = "9.9.9"\n')
    r = subprocess.run(["sh", str(repo / "scripts/build-deb.sh"), "--print-version"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "pyproject.toml says 9.9.9" in r.stderr


@pytest.mark.skipif(not (_TOOLS and SCRIPT.is_file()), reason="needs git, dpkg-dev, build-deb.sh")
def test_a_shallow_clone_builds_a_version_after_a_full_clones_build_of_the_parent(
        tmp_path: Path) -> None:
    """Issue 31.3: `git clone --depth 1` counts one commit, where the full clone counts them
    all: the commit's time orders the two, not the count."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "packaging/debian").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts/build-deb.sh")
    (repo / "packaging/debian/changelog").write_text(_entry("0.3.0", "UNRELEASED"))
    (repo / "pyproject.toml").write_text('[project]\nversion = "0.3.0"\n')
    _git(repo, "init", "-q")
    for n in range(1, 6):
        (repo / "code.py").write_text(str(n))
        _git(repo, "add", "-A")
        date = f"2026-12-06T10:0{n}:00+0000"  # a minute apart
        subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", f"work {n}"], check=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e.org",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e.org",
                            "GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date})
    head = _build_version(repo)
    _git(repo, "checkout", "-q", "HEAD~1")
    parent = _build_version(repo)
    _git(repo, "checkout", "-q", "-")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)],
                   check=True)
    assert _git(shallow, "rev-parse", "--is-shallow-repository") == "true"
    built = _build_version(shallow)
    assert built != head  # it counts one commit, not five
    assert _newer(built, parent), (built, parent)
    assert re.fullmatch(r"0\.3\.0~git2612061005\.\d+\.[0-9a-f]{7}", built), built


@pytest.mark.skipif(not (_TOOLS and SCRIPT.is_file()), reason="needs git, dpkg-dev, build-deb.sh")
def test_a_version_already_built_from_other_sources_is_refused(tmp_path: Path) -> None:
    """dist/ has the version with another source hash (or none): no second content under one
    version (issue 19.1). Refused before the build, so no build dependencies are needed."""
    repo = tmp_path / "repo"
    for d in ("scripts", "packaging/debian", "etc/qwen4090"):
        (repo / d).mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts/build-deb.sh")
    (repo / "packaging/debian/changelog").write_text(_entry("1.0.0"))
    (repo / "pyproject.toml").write_text('[project]\nversion = "1.0.0"\n')
    (repo / "etc/qwen4090/qwen4090.toml").write_text("# shipped\n")
    (repo / ".gitignore").write_text("/dist/\n/build/\n")  # as this repository's
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release 1.0.0")
    assert _build_version(repo) == "1.0.0"
    deb = repo / "dist/qwen4090_1.0.0_all.deb"
    deb.parent.mkdir()
    deb.write_text("an older build")
    for record in ("0" * 64, None):
        rec = deb.with_name(deb.name + ".src-sha256")
        if record:
            rec.write_text(record + "\n")
        elif rec.exists():
            rec.unlink()
        r = subprocess.run(["sh", str(repo / "scripts/build-deb.sh")], capture_output=True,
                           text=True)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "was already built from other sources" in r.stderr
        assert deb.read_text() == "an older build"


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


def _rdev(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


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
    for minor, bus in ((0, "0000:18:00.0"), (3, "0000:9a:00.0")):
        (proc / "driver/nvidia/gpus" / bus).mkdir(parents=True)
        (proc / "driver/nvidia/gpus" / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nDevice Minor: \t {minor}\n")
    # nvidia-modprobe (a stand-in that records its arguments) once per GPU, with -u
    calls = tmp_path / "calls"
    stub = tmp_path / "nvidia-modprobe"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    r = subprocess.run(["sh", str(script)], env={**env, "QWEN4090_NVIDIA_MODPROBE": str(stub)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert calls.read_text().splitlines() == ["-u -c=0", "-u -c=3"]
    assert _rdev(dev / "nvidia-uvm") == (238, 0) and _rdev(dev / "nvidia-uvm-tools") == (238, 1)
    assert _rdev(dev / "nvidiactl") == (195, 255)
    assert _rdev(dev / "nvidia0") == (195, 0) and _rdev(dev / "nvidia3") == (195, 3)
    assert "created" in r.stdout
    # a reloaded driver gave nvidia-uvm another (dynamic) major: the stale nodes are replaced
    (proc / "devices").write_text(PROC_NEW.replace("238 nvidia-uvm", "236 nvidia-uvm"))
    r = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _rdev(dev / "nvidia-uvm") == (236, 0) and _rdev(dev / "nvidia-uvm-tools") == (236, 1)
    assert "replacing" in r.stdout and "nvidiactl" not in r.stdout  # right ones are kept
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
