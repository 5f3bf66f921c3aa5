"""Checks before a launch: things that would make vLLM fail after a minute of loading.

Configuration problems (missing model directory, unusable command, loose API-key file) are
:class:`ConfigError` and are never retried.  Conditions that may pass by themselves (the port
still held by a dying process) are transient: the start is retried with backoff.  A port held
by another process is named (pid, command line) and waited on without counting a failure.
A check that could not look because no file descriptor was left (EMFILE, ENFILE: clients
holding the front's connections; fdlimit.py) judges nothing: the result is ``unseen`` and the
supervisor runs the preflight again soon, not counted (issue 28.3).
GPU checks (driver, free VRAM, the KV-cache plan) plug in as extra checks; what is launched
(and why) is launch.py's, never a check's.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from qwen4090.base import fdlimit
from qwen4090.decide.policy import hang_timeout_risk
from qwen4090.decide.results import PreflightResult
from qwen4090.engine.child import api_key_path
from qwen4090.launching import configrisk, steptime
from qwen4090.launching.instance import port_holders, try_bind
from qwen4090.launching.launchvalue import Endpoint
from qwen4090.launching.runtime import version_warning
from qwen4090.settings.config import Config, ConfigError, read_secret

Check = Callable[[Config, PreflightResult], None]


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.exists(model)


def check_model(cfg: Config, res: PreflightResult) -> None:
    model = cfg.vllm.model
    src = cfg.sources[0] if cfg.sources else None
    if not looks_like_path(model):
        res.warnings.append(f"vllm.model {model!r} is not a directory: vLLM will look it up on "
                            "the model hub (set HF_HUB_OFFLINE=1 to forbid downloads)")
        return
    p = Path(model).expanduser()
    try:  # cfg: stat may fail with EACCES/ENAMETOOLONG: a fatal line, never a traceback
        _check_model_dir(p, src, res)
    except (OSError, ValueError) as e:
        res.fatal = ConfigError(src, "vllm.model", f"cannot look at {p}: "
                                f"{getattr(e, 'strerror', None) or type(e).__name__}; fix the "
                                "path or its permissions for the service user")


def _check_model_dir(p: Path, src: str | None, res: PreflightResult) -> None:
    if not p.exists():
        res.fatal = ConfigError(src, "vllm.model", f"directory {p} does not exist; download "
                                "the model there (qwen4090 fetch-model) or fix the path")
    elif not p.is_dir():
        res.fatal = ConfigError(src, "vllm.model", f"{p} is not a directory")
    elif not os.access(p, os.R_OK | os.X_OK):
        res.fatal = ConfigError(src, "vllm.model", f"directory {p} is not readable by this "
                                "user; chmod/chgrp it for the service user")
    elif not (p / "config.json").is_file():
        res.fatal = ConfigError(src, "vllm.model", f"{p} has no config.json; point it at the "
                                "model's top directory")
    elif not os.access(p / "config.json", os.R_OK):
        res.fatal = ConfigError(src, "vllm.model", f"{p / 'config.json'} is not readable by "
                                "this user; chmod/chgrp it for the service user")


def check_command(cfg: Config, res: PreflightResult) -> None:
    exe = cfg.vllm.command[0]
    src = cfg.sources[0] if cfg.sources else None
    found = shutil.which(exe)
    if found is not None and not os.path.isfile(found):  # cfg: a FIFO or device with +x
        res.fatal = ConfigError(src, "vllm.command", f"{found} is not a regular file; fix "
                                                     "vllm.command")
    elif found is None:
        fix = ("run `qwen4090 install-runtime` or set vllm.command"
               if exe.startswith("/opt/qwen4090") else "fix vllm.command")
        res.fatal = ConfigError(src, "vllm.command", f"{exe} is not an executable; {fix}")


def check_api_key(cfg: Config, res: PreflightResult, env: Mapping[str, str] | None = None
                  ) -> None:
    path = api_key_path(cfg.vllm, os.environ if env is None else env)
    if path:
        try:
            read_secret(path)
        except ConfigError as e:
            if fdlimit.exhausted(e):
                raise  # could not open it: says nothing about the file (run_checks)
            res.fatal = e


def check_port(cfg: Config, res: PreflightResult, at: Endpoint) -> None:
    """The engine's own port (``at``: behind the front, a loopback port, not vllm.port)."""
    host, port = at.host, at.port
    e = try_bind(host, port)
    if e is None:
        return
    if fdlimit.exhausted(e):
        raise e  # no socket to look with: says nothing about the port (run_checks)
    if e.errno == errno.EADDRINUSE:
        # Waited on by the supervisor (restart.port_wait), not counted as a vLLM failure.
        res.port_holder = port_holders(host, port)
        res.transient = f"port {host}:{port} is in use by {res.port_holder}"
    elif e.errno == errno.EADDRNOTAVAIL:
        res.fatal = ConfigError(cfg.sources[0] if cfg.sources else None, "vllm.host",
                                f"{host} is not an address of this machine")
    else:
        res.transient = f"cannot bind {host}:{port}: {e.strerror}"


def check_runtime_version(cfg: Config, res: PreflightResult) -> None:
    """Warning only: the runtime's vLLM is not the pinned version (another may still work)."""
    warning = version_warning(cfg.vllm.command)
    if warning:
        res.warnings.append(warning)


def check_hosts(cfg: Config, res: PreflightResult, strict: bool = False) -> None:
    """vLLM's and the status endpoint's addresses are this machine's (issue 18.8).

    vLLM on an address it cannot bind never serves: fatal, as check_port's EADDRNOTAVAIL.  The
    status endpoint is refused by check-config (``strict``) but only warned about at a launch:
    serving the model matters more than showing it.  Host names are resolved only when
    ``strict``: at boot DNS may not answer yet, and check_port's bind then retries.
    """
    problem = configrisk.host_problem(cfg.vllm.host, resolve=strict)
    if problem:
        res.fatal = ConfigError(_setter(cfg, "vllm", "host"), "vllm.host",
                                f"{problem}; set one of its addresses, 127.0.0.1 (with a proxy "
                                "in front) or 0.0.0.0")
        return
    problem = configrisk.host_problem(cfg.status.host, resolve=strict) \
        if cfg.status.enabled else None
    if problem and strict:
        res.fatal = ConfigError(_setter(cfg, "status", "host"), "status.host",
                                f"{problem}; set one of its addresses or 127.0.0.1")
    elif problem:
        res.warnings.append(f"status.host: {problem}: the status endpoint will not start "
                            "(vLLM is served without it); fix status.host")


def check_hosts_strict(cfg: Config, res: PreflightResult) -> None:
    check_hosts(cfg, res, strict=True)


def check_config_warnings(cfg: Config, res: PreflightResult) -> None:
    """Legal but risky settings (configrisk.config_warnings): warnings, never fatal."""
    res.warnings += configrisk.config_warnings(cfg)


def check_hang_timeout(cfg: Config, res: PreflightResult) -> None:
    """watch.hang_timeout against the longest engine step the last warmup measured with these
    settings (steptime.py, in the state directory; none measured: nothing to say)."""
    risk = hang_timeout_risk(cfg.watch.hang_timeout, steptime.StepStore.of(cfg).measured(cfg))
    if risk is not None:
        res.warnings.append(risk)


def check_service_user(cfg: Config, res: PreflightResult, user: str | None = None) -> None:
    """Run as root (``sudo qwen4090 check-config``): what the service user cannot read is an
    error, though root can (issue 19.4).  Skipped for other users and without that user.

    The user is the units' User=qwen4090; $QWEN4090_SERVICE_USER names another (a unit of your
    own), or none when empty.
    """
    if user is None:
        user = os.environ.get("QWEN4090_SERVICE_USER", configrisk.SERVICE_USER)
    if not user or os.geteuid() != 0:
        return
    who = configrisk.Reader.named(user)
    if who is None:
        return
    for found in configrisk.unreadable_by(cfg, who):
        file = found.path if found.key is None else _setter(cfg, *found.key.split("."))
        res.fatal = ConfigError(file, found.key, configrisk.describe(found, user))
        return


def _setter(cfg: Config, section: str, key: str) -> str | None:
    """The config file that set ``section.key`` (else the main file), for a message."""
    return configrisk.file_setting(cfg.sources, section, key) or \
        (cfg.sources[0] if cfg.sources else None)


STATIC_CHECKS: list[Check] = [check_model, check_command, check_api_key, check_runtime_version,
                              check_config_warnings]


def run_checks(cfg: Config, checks: Sequence[Check]) -> PreflightResult:
    """The checks in order, up to the first fatal one, or the first that could not look for
    want of a file descriptor (``unseen``: whatever it raised, an OSError or a ConfigError
    made of one, when fdlimit.exhausted says so)."""
    res = PreflightResult()
    for check in checks:
        try:
            check(cfg, res)
        except Exception as e:
            res.unseen = fdlimit.no_file(e)
            if res.unseen is None:
                raise
            break
        if res.fatal is not None:
            break
    return res


def static(cfg: Config) -> PreflightResult:
    """What check-config verifies beyond syntax: files and commands, no port, no GPU."""
    return run_checks(cfg, [*STATIC_CHECKS, check_hosts_strict, check_hang_timeout,
                            check_service_user])


def full(cfg: Config, at: Endpoint, extra: Sequence[Check] = ()) -> PreflightResult:
    """Everything before a launch."""
    return run_checks(cfg, [*STATIC_CHECKS, check_hosts, *extra,
                            lambda c, r: check_port(c, r, at)])
