"""Settings that config.py cannot judge alone: what this machine makes of them.

config.py refuses what can never work from the values alone; this module looks at the machine
too (issue 18.8, issue 19.4):

- ``host_problem``: an address vLLM or the status endpoint is to listen on that this machine
  does not have (not one of its interfaces' addresses, not loopback, not 0.0.0.0/::);
- ``config_warnings``: legal but risky settings, one line each, naming key, value and fix -- an
  endpoint without authentication beyond loopback, a secret in a world-readable file, timeouts
  that stretch the watch's intervals.  It only reads (file modes, local addresses, name
  resolution) and never raises: check-config prints the lines, the daemon's preflight logs them
  (``preflight_warning``), and a reload may call it on the new config;
- ``unreadable_by``: the files the daemon reads that a given user cannot read, judged from
  mode bits, owner and groups (``sudo qwen4090 check-config`` runs as root, and os.access
  cannot answer for another uid).  POSIX ACLs are not read: a file an ACL opens is reported.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import stat
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from qwen4090.engine.child import api_key_path
from qwen4090.launching.instance import try_bind
from qwen4090.settings.config import Config, read_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Ubuntu 22.04 only
    import tomli as tomllib

SERVICE_USER = "qwen4090"
# Where the units' LoadCredential=api_key:qwen4090[-INSTANCE].api_key finds the key.
CREDSTORES = ("/etc/credstore", "/etc/credstore.encrypted", "/run/credstore",
              "/run/credstore.encrypted")
CREDENTIAL_FILE = re.compile(r"qwen4090(-.+)?\.api_key")
# Variable names that hold secrets by convention (HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_...).
SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY)$|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
PROXY_FIX = ("listen on 127.0.0.1 and put a proxy with authentication in front (see "
             "/usr/share/doc/qwen4090/examples/nginx-qwen4090.conf)")


# --- addresses --------------------------------------------------------------------------------

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def local_addresses() -> list[Address]:
    """The addresses of this machine's interfaces (psutil), without IPv6 scope ids."""
    found: list[Address] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = _ip(a.address.split("%", 1)[0])
                if ip is not None and ip not in found:
                    found.append(ip)
    return found


def host_problem(host: str, *, resolve: bool = True) -> str | None:
    """Why vLLM or the status endpoint cannot listen on ``host`` here, or None.

    A literal address must be one of this machine's (or loopback, or 0.0.0.0/::); anything
    else is confirmed by a bind to port 0, as vLLM would bind it (that also accepts what
    net.ipv4.ip_nonlocal_bind or a local route allows).  A host name is resolved only with
    ``resolve``: at boot, DNS may not answer yet (the launch's bind then says so, and retries).
    """
    ip = _ip(host.split("%", 1)[0])
    if ip is not None:
        if ip.is_unspecified or ip.is_loopback or ip in local_addresses():
            return None
    elif not resolve:
        return None
    e = try_bind(host, 0)
    if e is None:
        return None
    if isinstance(e, socket.gaierror):
        return f"{host} does not resolve ({e.strerror})"
    if e.errno == errno.EADDRNOTAVAIL:
        mine = ", ".join(str(a) for a in local_addresses()[:8]) or "none"
        return f"{host} is not an address of this machine (its addresses: {mine})"
    return None  # EACCES, EADDRINUSE...: not about the address (the launch's bind says it)


def is_loopback(host: str) -> bool:
    """Only this machine can connect: 127.0.0.0/8, ::1, or a name that resolves only there."""
    ip = _ip(host.split("%", 1)[0])
    if ip is not None:
        return ip.is_loopback
    name = host.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # cannot tell: not known to be local
    ips = [_ip(str(i[4][0]).split("%", 1)[0]) for i in infos]
    return bool(ips) and all(ip is not None and ip.is_loopback for ip in ips)


# --- warnings ---------------------------------------------------------------------------------


def config_warnings(cfg: Config, env: Mapping[str, str] | None = None) -> list[str]:
    """The legal but risky settings of ``cfg``: one line each, naming key, value and fix."""
    env = os.environ if env is None else env
    out: list[str] = []
    v, s, w = cfg.vllm, cfg.status, cfg.watch
    if s.enabled and not is_loopback(s.host):
        ip = _ip(s.host)
        where = "on every interface" if ip is not None and ip.is_unspecified else \
            "beyond this machine"
        out.append(f"status.host = {s.host}: the status endpoint (/status, /metrics, the page; "
                   f"no authentication) is reachable {where}; {PROXY_FIX}, or firewall port "
                   f"{s.port}")
    if not is_loopback(v.host) and not has_api_key(cfg, env):
        out.append(f"vllm.host = {v.host}: vLLM answers anyone who reaches port {v.port} "
                   "without an API key (no vllm.api_key_file, no systemd credential api_key); "
                   "set vllm.api_key_file (chmod 600) or /etc/credstore/qwen4090.api_key, or "
                   + PROXY_FIX)
    if w.health_timeout > w.poll_interval:
        out.append(f"watch.health_timeout = {w.health_timeout:g} is above watch.poll_interval "
                   f"= {w.poll_interval:g}: a slow /health delays the next poll (no two run at "
                   "once), so a fault is seen later than the interval says; lower "
                   "health_timeout to at most poll_interval")
    if w.canary_interval > 0 and w.canary_timeout > w.canary_interval:
        out.append(f"watch.canary_timeout = {w.canary_timeout:g} is above "
                   f"watch.canary_interval = {w.canary_interval:g}: a slow canary delays the "
                   "next one (no two run at once); lower canary_timeout to at most "
                   "canary_interval")
    out += _secrets_in_readable_files(cfg)
    return out


def has_api_key(cfg: Config, env: Mapping[str, str]) -> bool:
    """A key file is configured, handed over by systemd, or waiting in a credstore for the
    unit (check-config runs outside the unit: $CREDENTIALS_DIRECTORY is not set there)."""
    if api_key_path(cfg.vllm, env):
        return True
    for d in CREDSTORES:
        try:
            if any(CREDENTIAL_FILE.fullmatch(n) for n in os.listdir(d)):
                return True
        except OSError:
            continue
    return False


def _secrets_in_readable_files(cfg: Config) -> list[str]:
    names = [n for n in cfg.vllm.env if SECRET_NAME.search(n)]
    if not names:
        return []
    owner = file_setting(cfg.sources, "vllm", "env")
    if owner is None or not can_access(owner, Reader.anyone(), os.R_OK):
        return []
    mode = f"{os.stat(owner).st_mode & 0o777:o}"
    return [f"{owner}: vllm.env.{n} looks like a secret, and this file (mode {mode}) is "
            "readable by every user; move it to a file of mode 600 (systemd "
            "EnvironmentFile= in a drop-in of the unit, or LoadCredential=) or chmod 640 this "
            "one, group qwen4090" for n in names]


def file_setting(sources: tuple[str, ...], section: str, key: str) -> str | None:
    """The last of the config files that sets ``section.key`` (later files win)."""
    for src in reversed(sources):
        try:
            data = tomllib.loads(read_regular_file(Path(src), 1 << 20).decode("utf-8"))
        except Exception:  # it loaded a moment ago: a race is no warning
            continue
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            return src
    return None


# --- access as another user -------------------------------------------------------------------


@dataclass(frozen=True)
class Reader:
    """A user as the kernel's permission check sees it: uid and every group."""

    uid: int
    gids: frozenset[int]

    @classmethod
    def anyone(cls) -> Reader:
        """Any other user: only the "other" permission bits apply."""
        return cls(-1, frozenset())

    @classmethod
    def named(cls, user: str) -> Reader | None:
        import grp
        import pwd

        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            return None
        gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
        return cls(pw.pw_uid, frozenset(gids))


def _allows(st: os.stat_result, who: Reader, want: int) -> bool:
    if who.uid == 0:
        return not (want & os.X_OK) or bool(st.st_mode & 0o111) or stat.S_ISDIR(st.st_mode)
    if st.st_uid == who.uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid in who.gids:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def can_access(path: str | os.PathLike[str], who: Reader, want: int) -> bool:
    """Whether ``who`` may ``want`` (os.R_OK | os.W_OK | os.X_OK) the path: search permission
    on every directory above it (after links), then ``want`` on the path itself."""
    real = Path(os.path.realpath(path))
    try:
        for parent in reversed(real.parents):
            if not _allows(os.stat(parent), who, os.X_OK):
                return False
        return _allows(os.stat(real), who, want)
    except OSError:
        return False


@dataclass(frozen=True)
class Unreadable:
    key: str | None  # the config key that names the path (None: a config file itself)
    path: str
    verb: str  # "readable" or "executable"


def unreadable_by(cfg: Config, who: Reader, model_files: int = 1000) -> Iterator[Unreadable]:
    """What the daemon (and the vLLM it starts) reads but ``who`` cannot: the config files and
    conf.d, vllm.command, the model directory and its top-level files, the API key file."""
    import shutil

    for src in cfg.sources:
        if not can_access(src, who, os.R_OK):
            yield Unreadable(None, src, "readable")
    if cfg.sources:
        ddir = Path(cfg.sources[0]).parent / "conf.d"
        if ddir.is_dir() and not can_access(ddir, who, os.R_OK | os.X_OK):
            yield Unreadable(None, str(ddir), "readable")
    exe = shutil.which(cfg.vllm.command[0])
    if exe and not can_access(exe, who, os.X_OK):
        yield Unreadable("vllm.command", exe, "executable")
    model = Path(cfg.vllm.model).expanduser()
    if cfg.vllm.model.startswith(("/", "./", "../", "~")) and model.is_dir():
        if not can_access(model, who, os.R_OK | os.X_OK):
            yield Unreadable("vllm.model", str(model), "readable")
        else:
            yield from _unreadable_files(model, who, model_files)
    if cfg.vllm.api_key_file and not can_access(cfg.vllm.api_key_file, who, os.R_OK):
        yield Unreadable("vllm.api_key_file", cfg.vllm.api_key_file, "readable")


def _unreadable_files(model: Path, who: Reader, limit: int) -> Iterator[Unreadable]:
    try:
        with os.scandir(model) as it:
            for i, entry in enumerate(it):
                if i >= limit:
                    return
                path = os.path.join(model, entry.name)
                want = os.R_OK | (os.X_OK if entry.is_dir() else 0)
                if not can_access(path, who, want):
                    yield Unreadable("vllm.model", path, "readable")
                    return  # one is enough to say what to fix
    except OSError:
        return


def describe(found: Unreadable, user: str = SERVICE_USER) -> str:
    """The one-line problem (the caller's ConfigError adds the file and the key)."""
    fix = (f"chown {user} it (mode 600 stays)" if found.key == "vllm.api_key_file" else
           f"let that user or its group reach it through the directories above (e.g. chgrp "
           f"{user} and chmod g+rX)")
    return f"{found.verb} by root but not by the {user} user: {found.path}; {fix}"
