"""qwen4090@ instances side by side: derived status port and GPU index, the learned state
directory from the config path, vLLM's oom_score_adj, the runtime version warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen4090.base import oomscore
from qwen4090.commandline import provision
from qwen4090.launching import learned, preflight, runtime
from qwen4090.settings import derived
from qwen4090.settings.config import ConfigError, from_dict, load


def write(p: Path, text: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_status_port_follows_the_vllm_port_unless_set() -> None:
    assert from_dict({}).status.port == 8090
    assert from_dict({"vllm": {"port": 8001}}).status.port == 8091
    assert from_dict({"vllm": {"port": 8001}, "status": {"port": 9999}}).status.port == 9999
    assert derived.default_status_port(65500) == 65410


def test_two_instance_configs_never_collide(tmp_path: Path) -> None:
    a = load(write(tmp_path / "instances/gpu0.toml", '[vllm]\nport = 8000\n'
                   'env = { CUDA_VISIBLE_DEVICES = "0" }\n'))
    b = load(write(tmp_path / "instances/gpu1.toml", '[vllm]\nport = 8001\n'
                   'env = { CUDA_VISIBLE_DEVICES = "1" }\n'))
    ports = {a.vllm.port, a.status.port, b.vllm.port, b.status.port}
    assert len(ports) == 4
    assert (a.gpu.device, b.gpu.device) == (0, 1)


@pytest.mark.parametrize("configured,visible,expected", [
    (None, None, None), (3, None, 3), (None, "2", 2), (None, "2,3", 2), (2, "2", 2),
    (None, "GPU-8f6c1c52-aaaa", None), (4, "MIG-1234", 4), (None, "", None),
])
def test_device_for(configured: int | None, visible: str | None, expected: int | None) -> None:
    assert derived.device_for(configured, visible) == (expected, None)


def test_explicit_device_against_cuda_visible_devices_is_a_config_error(tmp_path: Path) -> None:
    f = write(tmp_path / "q.toml", '[vllm]\nenv = { CUDA_VISIBLE_DEVICES = "1" }\n'
                                   '[gpu]\ndevice = 0\n')
    with pytest.raises(ConfigError) as e:
        load(f)
    msg = str(e.value)
    assert "gpu.device" in msg and str(f) in msg and "NVML index 1" in msg


def test_learned_state_dir_of_an_instance_config_needs_no_environment(tmp_path: Path) -> None:
    inst = load(write(tmp_path / "instances/gpu1.toml", "[vllm]\nport = 8001\n"))
    # the daemon (systemd's StateDirectory=qwen4090/%i) and a shell (no $STATE_DIRECTORY) agree
    assert learned.state_dir(inst, {}) == Path("/var/lib/qwen4090/gpu1")
    assert learned.state_dir(inst, {"STATE_DIRECTORY": "/var/lib/qwen4090/gpu1"}) == \
        Path("/var/lib/qwen4090/gpu1")
    main = load(write(tmp_path / "qwen4090.toml", ""))
    assert learned.state_dir(main, {}) == Path("/var/lib/qwen4090")
    assert learned.state_dir(main, {"STATE_DIRECTORY": str(tmp_path)}) == tmp_path
    pinned = load(write(tmp_path / "instances/gpu2.toml",
                        f'[gpu]\nstate_directory = "{tmp_path}/s"\n'))
    assert learned.state_dir(pinned, {}) == tmp_path / "s"


def test_oom_score_target_never_lowers() -> None:
    assert oomscore.target(-500) == oomscore.VLLM_OOM_SCORE_ADJ
    assert oomscore.target(0) == oomscore.VLLM_OOM_SCORE_ADJ
    assert oomscore.target(900) == 900
    assert oomscore.target(0, 5000) == 1000


def test_oom_score_is_raised_for_a_real_child() -> None:
    import subprocess

    p = subprocess.Popen(["sleep", "30"])
    try:
        assert oomscore.raise_for(p.pid) is None
        value = int(Path(f"/proc/{p.pid}/oom_score_adj").read_text())
        assert value == oomscore.target(int(Path("/proc/self/oom_score_adj").read_text()))
        assert value >= oomscore.VLLM_OOM_SCORE_ADJ
    finally:
        p.kill()
        p.wait()
    assert "cannot set" in str(oomscore.raise_for(p.pid))


def _venv(tmp_path: Path, version: str | None, record: bool) -> Path:
    venv = tmp_path / "venv"
    write(venv / "pyvenv.cfg", "home = /usr/bin\n")
    (venv / "bin").mkdir(exist_ok=True)
    if version and record:
        runtime.record_runtime(venv, "vllm", version)
    elif version:
        write(venv / "lib/python3.11/site-packages/vllm-0.dist-info/METADATA",
              f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return venv


@pytest.mark.parametrize("record", [True, False], ids=["record", "dist-info"])
def test_runtime_version_warning(tmp_path: Path, record: bool) -> None:
    venv = _venv(tmp_path, "0.26.0", record)
    cmd = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    w = runtime.version_warning(cmd, pinned="0.32.0")
    assert w and "0.26.0" in w and "0.32.0" in w and "install-runtime --force" in w
    assert runtime.version_warning(cmd, pinned="0.26.0") is None
    assert runtime.version_warning(["vllm", "serve"]) is None  # not a venv: nothing to say
    cfg = from_dict({"vllm": {"command": cmd}})
    res = preflight.PreflightResult()
    preflight.check_runtime_version(cfg, res)
    assert res.fatal is None and len(res.warnings) == 1


def test_install_runtime_records_what_it_installed(tmp_path: Path) -> None:
    venv = tmp_path / "v"

    def runner(argv: list[str]) -> int:
        if argv[1:3] == ["-m", "venv"]:
            write(Path(argv[3]) / "pyvenv.cfg", "")
            write(Path(argv[3]) / "bin/python", "")
        return 0

    provision.install_runtime(venv, "vllm", "0.26.0", None, "/usr/bin/python3",
                              runner=runner)  # type: ignore[arg-type]
    rec = json.loads((venv / runtime.RECORD_NAME).read_text())
    assert rec["package"] == "vllm" and rec["version"] == "0.26.0"
    assert runtime.runtime_version(venv) == ("vllm", "0.26.0")


def test_status_command_warns_on_a_version_mismatch(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from qwen4090.commandline import cli

    venv = _venv(tmp_path, "0.26.0", True)
    f = write(tmp_path / "q.toml", f'[vllm]\ncommand = ["{venv}/bin/python"]\n'
                                   '[status]\nport = 1\n')
    assert cli.main(["status", "-c", str(f), "--timeout", "0.5"]) == 3
    err = capsys.readouterr().err
    assert "warning:" in err and "pinned to" in err


def test_install_runtime_can_see_the_system_site_packages(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(argv: list[str]) -> int:
        calls.append(list(argv))
        if argv[1:3] == ["-m", "venv"]:
            write(Path(argv[-1]) / "bin/python", "")
        return 0

    provision.install_runtime(tmp_path / "v", "vllm", "0.26.0", tmp_path, "/usr/bin/python3",
                              ["--no-deps"], runner=runner,  # type: ignore[arg-type]
                              system_site_packages=True)
    assert calls[0][:4] == ["/usr/bin/python3", "-m", "venv", "--system-site-packages"]
    # a new runtime beside the old one, switched to once checked (issue 19.5)
    assert calls[0][-1].startswith(str(tmp_path / "venvs" / "vllm-0.26.0-"))
    assert calls[1][-4:] == ["--find-links", str(tmp_path), "--no-deps", "vllm==0.26.0"]
