"""Settings check-config accepted though they expose the service or name what this machine does
not have (issue 18.8), and `sudo qwen4090 check-config` reading as the qwen4090 user (issue
19.4): refused with one line and 78, or one warning line (check-config, and the daemon's
preflight_warning through preflight's checks)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen4090.commandline.cli import main
from qwen4090.launching import configrisk, preflight
from qwen4090.launching.launchvalue import engine_endpoint
from qwen4090.settings import config


def resolving(*names: str) -> list[str]:
    """The names that resolve on this machine."""
    out = []
    for name in names:
        try:
            socket.getaddrinfo(name, None)
        except OSError:
            continue
        out.append(name)
    return out


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No systemd credential of this machine, and no qwen4090 user unless a test makes one."""
    monkeypatch.setattr(configrisk, "CREDSTORES", (str(tmp_path / "credstore"),))
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path sits in a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="qwen4090-risk-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def model_dir(root: Path, mode: int = 0o755) -> Path:
    m = root / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "config.json").chmod(0o644)
    m.chmod(mode)
    return m


def conf(root: Path, text: str, mode: int = 0o640) -> Path:
    """A config with a model directory and a command that exist, plus ``text`` in [vllm]."""
    m = root / "model" if (root / "model").is_dir() else model_dir(root)
    command = root / "vllm"  # where every user may run it (sys.executable may be in /root)
    if not command.exists():
        command.write_text("#!/bin/sh\n")
        command.chmod(0o755)
    path = root / "q.toml"
    path.write_text(f'[vllm]\nmodel = "{m}"\ncommand = ["{command}"]\n{text}\n')
    path.chmod(mode)
    return path


def check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["check-config", "--config", str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


def warnings(out: str) -> list[str]:
    return [line.split("warning  ", 1)[1] for line in out.splitlines()
            if line.startswith("  warning  ")]


def foreign_address() -> str:
    """An IPv4 address this machine does not have and cannot bind."""
    if Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() != "0":
        pytest.skip("net.ipv4.ip_nonlocal_bind lets this machine bind any address")
    mine = configrisk.local_addresses()
    for ip in ipaddress.ip_network("198.51.100.0/24").hosts():
        if ip not in mine:
            return str(ip)
    raise AssertionError("every TEST-NET-2 address is local")  # pragma: no cover


# --- warnings ---------------------------------------------------------------------------------


def test_a_status_endpoint_on_every_interface_is_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = check_config(conf(tmp_path, '[status]\nhost = "0.0.0.0"'), capsys)
    assert rc == 0
    (w,) = [w for w in warnings(out) if w.startswith("status.host")]
    assert w.startswith("status.host = 0.0.0.0: the status endpoint") and "every interface" in w
    assert "no authentication" in w and "127.0.0.1" in w and "port 8090" in w
    rc, out, _ = check_config(conf(tmp_path, '[status]\nhost = "::"'), capsys)
    assert any(w.startswith("status.host = ::") for w in warnings(out))
    for local in ("127.0.0.1", "::1", "127.0.0.2", *resolving("localhost")):
        rc, out, _ = check_config(conf(tmp_path, f'[status]\nhost = "{local}"'), capsys)
        assert rc == 0 and not any("status.host" in w for w in warnings(out)), (local, out)


def test_vllm_beyond_loopback_without_an_api_key_is_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = check_config(conf(tmp_path, 'host = "0.0.0.0"'), capsys)
    assert rc == 0
    (w,) = [w for w in warnings(out) if w.startswith("vllm.host")]
    assert "without an API key" in w and "vllm.api_key_file" in w and "port 8000" in w
    # with a key file, a credential handed over by systemd, or one in the credstore: no warning
    key = tmp_path / "key"
    key.write_text("k3y\n")
    key.chmod(0o600)
    rc, out, _ = check_config(conf(tmp_path, f'host = "0.0.0.0"\napi_key_file = "{key}"'), capsys)
    assert rc == 0 and not any(w.startswith("vllm.host") for w in warnings(out)), out
    store = tmp_path / "credstore"
    store.mkdir()
    (store / "qwen4090-gpu0.api_key").write_text("k3y\n")
    rc, out, _ = check_config(conf(tmp_path, 'host = "0.0.0.0"'), capsys)
    assert not any(w.startswith("vllm.host") for w in warnings(out)), out
    # on loopback, no key is needed
    (store / "qwen4090-gpu0.api_key").unlink()
    rc, out, _ = check_config(conf(tmp_path, 'host = "127.0.0.1"'), capsys)
    assert not any(w.startswith("vllm.host") for w in warnings(out)), out


@pytest.mark.parametrize(("text", "start", "fragment"), [
    ("[watch]\npoll_interval = 1\nhealth_timeout = 3\nunhealthy_timeout = 10",
     "watch.health_timeout = 3 is above watch.poll_interval = 1", "at most poll_interval"),
    ("[watch]\ncanary_interval = 5\ncanary_timeout = 10",
     "watch.canary_timeout = 10 is above watch.canary_interval = 5", "at most canary_interval"),
])
def test_timeouts_above_their_intervals_are_warnings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, start: str,
        fragment: str) -> None:
    rc, out, _ = check_config(conf(tmp_path, text), capsys)
    assert rc == 0
    assert any(w.startswith(start) and fragment in w for w in warnings(out)), out


def test_timeouts_within_their_intervals_and_no_canary_are_quiet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "[watch]\npoll_interval = 5\nhealth_timeout = 5\ncanary_interval = 0\n" \
           "canary_timeout = 60"
    rc, out, _ = check_config(conf(tmp_path, text), capsys)
    assert rc == 0 and not any(w.startswith("watch.") for w in warnings(out)), out


@pytest.mark.parametrize("name", ["HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
                                  "DB_PASSWORD"])
def test_a_secret_in_vllm_env_of_a_world_readable_file_is_a_warning(
        open_dir: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    path = conf(open_dir, f'env = {{{name} = "hf_abc", CUDA_VISIBLE_DEVICES = "0"}}', 0o644)
    rc, out, _ = check_config(path, capsys)
    assert rc == 0
    (w,) = [w for w in warnings(out) if "secret" in w]
    assert w.startswith(f"{path}: vllm.env.{name} looks like a secret") and "mode 644" in w
    assert "mode 600" in w and "EnvironmentFile=" in w and "hf_abc" not in out
    path.chmod(0o640)  # only the service's group: no warning
    rc, out, _ = check_config(path, capsys)
    assert rc == 0 and not any("secret" in w for w in warnings(out)), out


def test_the_secret_warning_names_the_drop_in_that_sets_the_env(
        open_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main_file = conf(open_dir, 'env = {HF_HOME = "/x"}', 0o644)
    (open_dir / "conf.d").mkdir()
    drop = open_dir / "conf.d" / "50-token.toml"
    drop.write_text('[vllm]\nenv = {HF_TOKEN = "hf_abc"}\n')
    drop.chmod(0o644)
    rc, out, _ = check_config(main_file, capsys)
    assert rc == 0
    assert any(w.startswith(f"{drop}: vllm.env.HF_TOKEN") for w in warnings(out)), out


def test_the_daemons_preflight_logs_the_same_warnings(tmp_path: Path) -> None:
    cfg = config.load(conf(tmp_path, 'host = "0.0.0.0"\nport = 1\n[status]\nhost = "0.0.0.0"'))
    assert preflight.check_config_warnings in preflight.STATIC_CHECKS
    # what the supervisor logs as preflight_warning, each launch
    res = preflight.full(cfg, engine_endpoint(cfg))
    assert configrisk.config_warnings(cfg) == [w for w in res.warnings
                                               if w.startswith(("status.host", "vllm.host"))]
    assert len(configrisk.config_warnings(cfg)) == 2


# --- addresses this machine does not have ------------------------------------------------------


def test_vllm_on_an_address_this_machine_does_not_have_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    addr = foreign_address()
    path = conf(tmp_path, f'host = "{addr}"')
    rc, _, err = check_config(path, capsys)
    assert rc == 78
    assert err.startswith(f"qwen4090: config error: {path}: vllm.host: {addr} is not an "
                          "address of this machine (its addresses: 127.0.0.1")
    assert err.count("\n") == 1 and "127.0.0.1 (with a proxy in front) or 0.0.0.0" in err
    # the daemon's preflight refuses it too, before the GPU checks (78, never retried)
    loaded = config.load(path)
    res = preflight.full(loaded, engine_endpoint(loaded),
                         extra=[lambda c, r: pytest.fail("GPU checked")])
    assert res.fatal is not None and res.fatal.key == "vllm.host"


def test_the_status_endpoint_on_a_foreign_address_is_refused_by_check_config_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    addr = foreign_address()
    path = conf(tmp_path, f'[status]\nhost = "{addr}"')
    rc, _, err = check_config(path, capsys)
    assert rc == 78
    assert err.startswith(f"qwen4090: config error: {path}: status.host: {addr} is not an "
                          "address of this machine")
    # at a launch it is a warning: vLLM is served without its status endpoint
    res = preflight.PreflightResult()
    preflight.check_hosts(config.load(path), res)
    assert res.fatal is None
    assert res.warnings == [f"status.host: {addr} is not an address of this machine (its "
                            f"addresses: {res.warnings[0].split('(its addresses: ')[1]}"]
    assert "the status endpoint will not start" in res.warnings[0]
    # status off: nothing to say
    path = conf(tmp_path, f'[status]\nenabled = false\nhost = "{addr}"')
    assert check_config(path, capsys)[0] == 0


def test_a_host_name_that_does_not_resolve_is_refused_by_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = conf(tmp_path, 'host = "no-such-host.invalid"')
    rc, _, err = check_config(path, capsys)
    assert rc == 78
    assert err.startswith(f"qwen4090: config error: {path}: vllm.host: no-such-host.invalid "
                          "does not resolve")
    # at boot DNS may not answer yet: the launch's bind retries it (check_port), no 78
    res = preflight.PreflightResult()
    preflight.check_hosts(config.load(path), res)
    assert res.fatal is None and res.warnings == []


def test_local_wildcard_and_loopback_addresses_pass(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    mine = [str(a) for a in configrisk.local_addresses() if a.version == 4]
    # names only where they resolve: a minimal tree (the Debian guest of the system test)
    # has no /etc/hosts, and there check-config rightly refuses a name that resolves nowhere
    for host in ["0.0.0.0", "127.0.0.1", "127.0.0.5",
                 *resolving("localhost", socket.gethostname()), *mine[:2]]:
        rc, _, err = check_config(conf(tmp_path, f'host = "{host}"\n[status]\nhost = '
                                                 f'"{host}"'), capsys)
        assert rc == 0, (host, err)


# --- sudo check-config: readable as the qwen4090 user ---------------------------------------------


SERVICE_UID = 54321  # owns nothing here


@pytest.fixture
def as_root_with_service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "qwen4090")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(configrisk.Reader, "named", classmethod(
        lambda cls, user: cls(SERVICE_UID, frozenset({SERVICE_UID})) if user == "qwen4090"
        else None))


@pytest.mark.usefixtures("as_root_with_service_user")
def test_sudo_check_config_names_what_the_service_user_cannot_read(
        open_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = open_dir / "key"
    key.write_text("k3y\n")
    key.chmod(0o600)  # root's: the service user cannot read it
    path = conf(open_dir, f'api_key_file = "{key}"', 0o644)
    rc, _, err = check_config(path, capsys)
    assert rc == 78
    assert err == (f"qwen4090: config error: {path}: vllm.api_key_file: readable by root but not "
                   f"by the qwen4090 user: {key}; chown qwen4090 it (mode 600 stays)\n")
    key.chmod(0o644)  # (read_secret refuses that; the model comes first anyway)
    (open_dir / "model").chmod(0o700)
    rc, _, err = check_config(conf(open_dir, "", 0o644), capsys)
    assert rc == 78
    assert err.startswith(f"qwen4090: config error: {path}: vllm.model: readable by root but not "
                          f"by the qwen4090 user: {open_dir / 'model'}; ")
    (open_dir / "model").chmod(0o755)
    (open_dir / "model" / "model.safetensors").write_bytes(b"")
    (open_dir / "model" / "model.safetensors").chmod(0o600)
    rc, _, err = check_config(path, capsys)
    assert rc == 78 and f"qwen4090 user: {open_dir / 'model' / 'model.safetensors'}; " in err
    (open_dir / "model" / "model.safetensors").chmod(0o644)
    path.chmod(0o600)  # the config file itself
    rc, _, err = check_config(path, capsys)
    assert rc == 78
    assert err.startswith(f"qwen4090: config error: {path}: readable by root but not by the "
                          f"qwen4090 user: {path}; ")
    path.chmod(0o644)
    assert check_config(path, capsys)[0] == 0
    (open_dir / "vllm").chmod(0o744)
    rc, _, err = check_config(path, capsys)
    assert rc == 78 and err.startswith(f"qwen4090: config error: {path}: vllm.command: "
                                       "executable by root but not by the qwen4090 user: ")


@pytest.mark.usefixtures("as_root_with_service_user")
def test_sudo_check_config_without_that_user_or_not_as_root_checks_nothing_more(
        open_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    path = conf(open_dir, "", 0o600)
    assert check_config(path, capsys)[0] == 78
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "no-such-user")
    assert check_config(path, capsys)[0] == 0
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "qwen4090")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert check_config(path, capsys)[0] == 0


def test_can_access_reads_owner_group_and_other_bits_and_every_directory_above(
        open_dir: Path) -> None:
    f = open_dir / "f"
    f.write_text("x")
    st = f.stat()
    owner = configrisk.Reader(st.st_uid, frozenset())
    group = configrisk.Reader(SERVICE_UID, frozenset({st.st_gid}))
    other = configrisk.Reader.anyone()
    f.chmod(0o640)
    assert configrisk.can_access(f, owner, os.R_OK) and configrisk.can_access(f, group, os.R_OK)
    assert not configrisk.can_access(f, other, os.R_OK)
    assert not configrisk.can_access(f, group, os.W_OK)
    f.chmod(0o604)
    assert configrisk.can_access(f, other, os.R_OK) and not configrisk.can_access(f, group,
                                                                                  os.R_OK)
    open_dir.chmod(0o750)  # the directory above shuts others out
    assert not configrisk.can_access(f, other, os.R_OK)
    open_dir.chmod(0o755)
    assert not configrisk.can_access(open_dir / "missing", owner, os.R_OK)
