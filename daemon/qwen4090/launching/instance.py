"""One supervisor per vLLM port, and what a previous one left behind.

Owns four things, each the answer to "is this vLLM ours?":

- **The instance lock** (issue 8.3): ``flock`` on ``instance-<host>-<port>.lock`` in the runtime
  directory, held for the life of ``qwen4090 run`` (the kernel drops it if we are SIGKILLed).
  A second ``run`` for the same port exits at once with 78 (EX_CONFIG), not 75: two
  supervisors for one port is a configuration conflict that no retry can fix, and 78 is what
  the units' ``RestartPreventExitStatus=78`` keeps systemd from retrying.  The lock fd is
  close-on-exec, so an orphaned vLLM never holds it.  The pid written into the file only
  names the holder (a newcomer also finds it in /proc/locks): a disk that refuses it (full,
  read-only, not ours: issue 18.1) is a ``state_not_saved`` warning, never a failed start.
- **The child record** (issue 8.5): pid, pgid, start time and command line of our vLLM group,
  written atomically next to the lock after each spawn and refreshed when the group grows.
  Outside systemd (no KillMode), a supervisor killed by SIGKILL leaves its vLLM serving; the
  next ``run`` reads the record, verifies each process by start time and command line (a
  reused pid must never make us kill a stranger), and stops the group before it starts.
- **Who holds a port** (issue 8.4): the pid and command line of the listener, or "an unknown
  process (not visible to user X)" when /proc hides it.
- **Whose socket answered** (issue 8.2): a /health 200 counts only when a process of our
  child's group listens on the port.

Where: ``$RUNTIME_DIRECTORY`` (systemd's ``RuntimeDirectory=qwen4090``), else /run/qwen4090
when it exists and is writable (so a manual run beside the service finds the service's lock),
else the state directory (learned.state_dir).  The decisions (which processes are ours, which
socket matches, how to say who holds a port) are pure functions tested with plain values; the
I/O is in :class:`Instance` and :func:`port_holders`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from qwen4090.base import atomicfile, fdlimit
from qwen4090.base.vllmfacts import WILDCARDS
from qwen4090.decide.results import PortOwner
from qwen4090.engine.child import tcp_connections
from qwen4090.launching import learned
from qwen4090.launching.launchvalue import Launch, engine_endpoints
from qwen4090.settings.config import Config, ConfigError

DEFAULT_RUNTIME_DIR = "/run/qwen4090"
# psutil's create_time is boot time + start ticks (10 ms); the same process reads the same
# value, a reused pid is born later.
CTIME_TOLERANCE = 0.05
ORPHAN_KILL_WAIT = 10.0  # after SIGKILL, how long we wait for an orphaned group to vanish
CMDLINE_CLIP = 200


# --- pure decisions --------------------------------------------------------------------------


def runtime_dir(cfg: Config, env: Mapping[str, str],
                usable: Callable[[str], bool] | None = None) -> Path:
    """Where the lock and the child record live (see the module docstring for the order)."""
    rd = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if rd:
        return Path(rd)
    usable = usable or (lambda p: os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK))
    if usable(DEFAULT_RUNTIME_DIR):
        return Path(DEFAULT_RUNTIME_DIR)
    return learned.state_dir(cfg, dict(env))


def instance_name(host: str, port: int) -> str:
    """``instance-127.0.0.1-8000``: the lock's and the record's name for one vLLM endpoint."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host or "any")
    return f"instance-{safe}-{port}"


@dataclass(frozen=True)
class ProcInfo:
    """One process as the record keeps it, and as we find it again."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]
    pgid: int = 0  # 0 when not known (a recorded entry)

    def same_process(self, other: ProcInfo) -> bool:
        """Same pid, same start time, same command: not a reused pid."""
        return (self.pid == other.pid and abs(self.create_time - other.create_time)
                <= CTIME_TOLERANCE and self.cmdline == other.cmdline)

    def describe(self) -> str:
        return f"pid {self.pid} ({_clip(' '.join(self.cmdline))})"


@dataclass(frozen=True)
class ChildRecord:
    """What the supervisor leaves next to its lock about the vLLM group it runs."""

    pid: int
    pgid: int
    create_time: float
    cmdline: tuple[str, ...]
    supervisor_pid: int
    members: tuple[ProcInfo, ...] = ()  # the group's other processes, as last seen

    @property
    def leader(self) -> ProcInfo:
        return ProcInfo(self.pid, self.create_time, self.cmdline, self.pgid)

    def processes(self) -> list[ProcInfo]:
        return [self.leader, *(m for m in self.members if m.pid != self.pid)]

    def to_json(self) -> str:
        d = asdict(self)
        d["members"] = [{"pid": m.pid, "create_time": m.create_time, "cmdline": list(m.cmdline)}
                        for m in self.members]
        d["cmdline"] = list(self.cmdline)
        return json.dumps(d, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ChildRecord | None:
        """The record, or None when it is torn or not ours to read."""
        try:
            d = json.loads(text)
            members = tuple(ProcInfo(int(m["pid"]), float(m["create_time"]),
                                     tuple(str(a) for a in m["cmdline"]))
                            for m in d.get("members", []))
            return cls(int(d["pid"]), int(d["pgid"]), float(d["create_time"]),
                       tuple(str(a) for a in d["cmdline"]), int(d["supervisor_pid"]), members)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True)
class OrphanVerdict:
    ours: list[ProcInfo] = field(default_factory=list)  # stop these
    group: bool = False  # True: the whole process group is proven ours (signal the group)
    unverified: list[ProcInfo] = field(default_factory=list)  # in the group, not provably ours
    reused: list[ProcInfo] = field(default_factory=list)  # recorded pids now run something else


def judge_orphans(record: ChildRecord, recorded_now: Iterable[ProcInfo],
                  group_now: Iterable[ProcInfo]) -> OrphanVerdict:
    """Which of the live processes are the vLLM group a previous supervisor left.

    ``recorded_now``: the live processes that carry a recorded pid; ``group_now``: the live
    processes whose process group is the recorded pgid.  A recorded process is ours only with
    the same start time and command line.  Once one of ours is still in the recorded group,
    every member of that group is ours: vLLM was started in a new session, and Linux never
    hands out a pid (or a group id) while a process of that group lives, so nothing but our
    vLLM's descendants can be in it.  Without such a proof the group's members are only
    reported, never signalled.
    """
    by_pid = {p.pid: p for p in record.processes()}
    ours: list[ProcInfo] = []
    reused: list[ProcInfo] = []
    for live in recorded_now:
        want = by_pid.get(live.pid)
        if want is None:
            continue
        (ours if want.same_process(live) else reused).append(live)
    proven = any(p.pgid == record.pgid for p in ours)
    seen = {p.pid for p in ours}
    unverified: list[ProcInfo] = []
    for live in group_now:
        if live.pid in seen or live.pgid != record.pgid:
            continue
        seen.add(live.pid)
        (ours if proven else unverified).append(live)
    return OrphanVerdict(ours, proven, unverified, reused)


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    pid: int | None  # None: the socket's owner is not visible to us


def matches_endpoint(ip: str, port: int, host: str, want_port: int) -> bool:
    """Does a socket bound to ip:port serve host:want_port? (wildcards and v4-mapped v6)."""
    if port != want_port:
        return False
    ip = ip.removeprefix("::ffff:")
    host = host.removeprefix("::ffff:")
    if ip in WILDCARDS or host in WILDCARDS:
        return True
    if not _is_ip(host):
        return True  # a name ("localhost"): the port decides
    return ip == host


def describe_holders(holders: Sequence[Listener], cmdlines: Mapping[int, Sequence[str]],
                     user: str) -> str:
    """"pid 123 (python3 -m http.server 8000)", or who we cannot see, in one phrase."""
    seen = []
    for h in holders:
        if h.pid is not None and h.pid not in seen:
            seen.append(h.pid)
    if not seen:
        return f"an unknown process (not visible to user {user})"
    parts = []
    for pid in seen:
        cmd = cmdlines.get(pid)
        parts.append(f"pid {pid} ({_clip(' '.join(cmd))})" if cmd else f"pid {pid}")
    return ", ".join(parts)


def flock_holders(proc_locks: str, major: int, minor: int, inode: int) -> list[int]:
    """Pids holding a FLOCK on one file, from /proc/locks (when the lock file names none)."""
    want = f"{major:02x}:{minor:02x}:{inode}"
    pids = []
    for line in proc_locks.splitlines():
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:123456 0 EOF" (blocked waiters carry "->")
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want and f[4].isdigit():
            pids.append(int(f[4]))
    return pids





class ChildGroup(Protocol):
    pid: int

    def group_members(self) -> list[int]: ...


def _is_ip(s: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(s)
        return True
    except ValueError:
        return False


def _clip(s: str, n: int = CMDLINE_CLIP) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


# --- I/O: ports ------------------------------------------------------------------------------


def listeners(conns: Iterable[Any], host: str, port: int, pid: int | None = None
              ) -> list[Listener]:
    """The LISTEN sockets for host:port among psutil's connections (a process's own carry no
    pid: ``pid`` names it)."""
    out = []
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr:
            continue
        ip, p = c.laddr[0], c.laddr[1]
        if matches_endpoint(ip, p, host, port):
            out.append(Listener(ip, p, getattr(c, "pid", pid)))
    return out


def _cmdline(pid: int) -> list[str] | None:
    try:
        return psutil.Process(pid).cmdline() or [psutil.Process(pid).name()]
    except (psutil.Error, OSError):  # OSError: EMFILE, no file left to read /proc with
        return None


def port_holders(host: str, port: int, strict: bool = False) -> str:
    """Who listens on host:port, in one phrase (pid and command line).  ``strict``: no file
    descriptor left to look with raises the OSError (else: "an unknown process")."""
    try:
        holders = listeners(psutil.net_connections("tcp"), host, port)
    except (psutil.Error, OSError) as e:
        if strict and fdlimit.exhausted(e):
            raise
        holders = []
    cmds = {h.pid: c for h in holders if h.pid is not None
            and (c := _cmdline(h.pid)) is not None}
    return describe_holders(holders, cmds, _user())


def try_bind(host: str, port: int) -> OSError | None:
    """Bind host:port as vLLM will (SO_REUSEADDR: a socket in TIME_WAIT does not count).  The
    error is returned, also one from making the socket (EMFILE: no file descriptor left to
    look with; fdlimit.exhausted tells it from an answer about the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        return e
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def _proc_connections(pid: int) -> list[Any]:
    return tcp_connections(psutil.Process(pid))  # one psutil-version shim, in child.py


# --- I/O: the lock, the record, orphans ---------------------------------------------------------


class InstanceError(Exception):
    """Why this ``run`` cannot go on (exit 78): another instance, or an unusable directory."""


@dataclass
class _Lock:
    """``flock`` on an open lock file is the lock; the pid written into it only names the holder
    for a newcomer (which finds it in /proc/locks as well).  ``fd`` None: no lock file could be
    opened at all (a disk that cannot create it): this run is unlocked, and said so."""

    path: Path
    fd: int | None
    unwritten: OSError | None = None  # why the pid (or the file) could not be written


def _take_lock(path: Path) -> _Lock:
    fd, unwritten = _open_lock(path)
    if fd is None:
        return _Lock(path, None, unwritten)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise InstanceError(f"cannot lock {path}: {e.strerror}") from None
        holder = _lock_holder(fd)
        os.close(fd)
        raise InstanceError(
            f"another qwen4090 already runs vLLM on this port: {holder} holds {path}; stop it "
            "first (systemctl stop qwen4090, or kill that pid) or give this config another "
            "vllm.port") from None
    if unwritten is None:
        unwritten = _write_pid(fd)
    return _Lock(path, fd, unwritten)


def _open_lock(path: Path) -> tuple[int | None, OSError | None]:
    """The lock file's fd (read-write; read-only when only that is allowed: flock needs no
    write access), and why it is not writable.  A directory that is not ours to use is an
    InstanceError (exit 78, the sysadmin's to fix); a disk that cannot create the file (full,
    read-only) gives (None, why): the run goes on unlocked rather than not serving."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), None
    except OSError as e:
        first = e
    if first.errno in atomicfile.DISK_ERRNOS:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC), first
        except OSError:
            pass
        if first.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return None, first
    raise InstanceError(
        f"cannot create the instance lock {path}: {first.strerror or first}; run under the "
        f"unit (RuntimeDirectory=qwen4090), make {path.parent} writable for user {_user()}, "
        "or set gpu.state_directory to a writable directory") from None


def _write_pid(fd: int) -> OSError | None:
    """Our pid into the locked file, whole or not at all; why not, or None."""
    data = f"{os.getpid()}\n".encode()
    try:
        os.ftruncate(fd, 0)
        if os.write(fd, data) != len(data):  # a short write: the disk filled up meanwhile
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # never half a pid: a newcomer asks /proc/locks instead
        return e
    return None


def _lock_holder(fd: int) -> str:
    pid: int | None = None
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
    # The kernel's word wins over the file's: the holder may not have written its pid yet, or
    # could not (a full disk), and the file may still name an earlier holder.
    st = os.fstat(fd)
    with contextlib.suppress(OSError):
        found = flock_holders(Path("/proc/locks").read_text(), os.major(st.st_dev),
                              os.minor(st.st_dev), st.st_ino)
        if found and pid not in found:
            pid = found[0]
    if pid is None:
        return "a process we cannot name"
    cmd = _cmdline(pid)
    return f"pid {pid} ({_clip(' '.join(cmd))})" if cmd else f"pid {pid}"


def _proc_info(pid: int, strict: bool = False) -> ProcInfo | None:
    """A live (non-zombie) process, or None; ``strict``: no file descriptor left to look with
    raises the OSError instead (a caller that must not take "cannot look" for "gone")."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return ProcInfo(pid, p.create_time(), tuple(p.cmdline()), os.getpgid(pid))
    except (psutil.Error, OSError) as e:
        if strict and fdlimit.exhausted(e):
            raise
        return None


def _group_now(pgid: int) -> list[ProcInfo]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.info["pid"]) != pgid:
                continue
        except OSError:
            continue
        info = _proc_info(p.info["pid"])
        if info is not None:
            out.append(info)
    return out


class Instance:
    """The lock and the child record of one ``qwen4090 run``; also the supervisor's port part."""

    def __init__(self, directory: Path, host: str, port: int, log: Any,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.dir = Path(directory)
        self.log = log
        self.clock = clock
        self.sleep = sleep
        self.host, self.port = host, port
        self.lock: _Lock | None = None
        self.record: ChildRecord | None = None  # the last group spawned
        self.records: dict[Path, ChildRecord] = {}  # each engine port's group (issue 21)

    @classmethod
    def take(cls, cfg: Config, log: Any, env: Mapping[str, str] | None = None) -> Instance:
        """Lock this config's vLLM port, or raise InstanceError (exit 78)."""
        env = os.environ if env is None else env
        inst = cls(runtime_dir(cfg, env), cfg.vllm.host, cfg.vllm.port, log)
        inst.lock = _take_lock(inst.lock_path)
        inst._say_locked()
        return inst

    def _say_locked(self) -> None:
        lock = self.lock
        assert lock is not None
        port = f"{self.host}:{self.port}"
        if lock.fd is None and lock.unwritten is not None:
            self.log.error("instance_unlocked", path=str(lock.path), port=port,
                           cause=atomicfile.cause(lock.unwritten),
                           detail="the lock file cannot be created: vLLM starts anyway, but a "
                                  "second qwen4090 for this port would not be refused; free "
                                  f"space in {lock.path.parent} or make it writable")
            return
        self.log.info("instance_locked", lock=str(lock.path), port=port)
        if lock.unwritten is not None and atomicfile.FAILURES.failed(lock.path):
            self.log.warning("state_not_saved", path=str(lock.path),
                             what="the instance lock's pid", cause=atomicfile.cause(lock.unwritten),
                             detail="the lock holds all the same (flock); a second qwen4090 "
                                    "for this port finds this pid in /proc/locks")

    @property
    def lock_path(self) -> Path:
        return self.dir / f"{instance_name(self.host, self.port)}.lock"

    @property
    def record_path(self) -> Path:
        return self.dir / f"{instance_name(self.host, self.port)}.child.json"

    def record_path_for(self, chosen: Launch) -> Path:
        """The record of the group on this launch's engine endpoint: behind the front the
        serving engine and a standby take turns on two loopback ports, each with its own
        record (the first endpoint's is the instance's plain one)."""
        at = chosen.engine
        if at == engine_endpoints(chosen.config)[0]:
            return self.record_path
        return self.dir / f"{instance_name(self.host, self.port)}.child-{at.port}.json"

    def record_paths(self) -> list[Path]:
        return [self.record_path,
                *sorted(self.dir.glob(f"{instance_name(self.host, self.port)}.child-*.json"))]

    def close(self, group_gone: bool) -> None:
        """At exit: forget the records once our groups are gone; drop the lock."""
        if group_gone:
            for path in self.record_paths():
                with contextlib.suppress(OSError):
                    path.unlink()
        if self.lock is not None:
            if self.lock.fd is not None:  # the lock file stays: unlinking it would race one
                os.close(self.lock.fd)
            self.lock = None

    # --- following the config (a reload may move vLLM to another port) --------------------

    def follow(self, cfg: Config) -> None:
        """Hold the lock of this config's client address; ConfigError when another has it.

        An instance is named by its client address (vllm.host:vllm.port): a reload may move
        it only with the front off (with the front on, the supervisor refuses the move)."""
        v = cfg.vllm
        if (v.host, v.port) == (self.host, self.port) and self.lock is not None:
            return
        old_lock, old_record = self.lock, self.record_path
        new = Instance(self.dir, v.host, v.port, self.log, self.clock, self.sleep)
        try:
            lock = _take_lock(new.lock_path)
        except InstanceError as e:
            raise ConfigError(cfg.sources[0] if cfg.sources else None, "vllm.port",
                              str(e)) from None
        with contextlib.suppress(OSError):
            old_record.unlink()
        if old_lock is not None and old_lock.fd is not None:
            os.close(old_lock.fd)
        self.host, self.port, self.lock = v.host, v.port, lock
        self._say_locked()

    def spawn(self, chosen: Launch, start: Callable[[Config], Any]) -> Any:
        """Start vLLM for ``chosen`` under our lock, then record it (the supervisor's spawn)."""
        cfg = chosen.config
        self.follow(cfg)
        child = start(cfg)
        leader = _proc_info(child.pid)
        if leader is not None:
            self._write(ChildRecord(child.pid, leader.pgid, leader.create_time, leader.cmdline,
                                    os.getpid()), new_leader=True,
                        path=self.record_path_for(chosen))
        return child

    def _write(self, rec: ChildRecord, new_leader: bool = False, path: Path | None = None
               ) -> None:
        """The record on disk, or (said once per file) why not: the supervisor serves on
        without it, and never leaves a record of an earlier group in its place."""
        if path is None:  # a refresh: the file that holds this leader
            path = next((p for p, r in self.records.items() if r.pid == rec.pid),
                        self.record_path)
        self.record = rec
        self.records[path] = rec
        try:
            atomicfile.write_text(path, rec.to_json())
        except OSError as e:
            if new_leader:
                with contextlib.suppress(OSError):  # it names a group that is gone
                    path.unlink()
            if atomicfile.FAILURES.failed(path):
                self.log.warning("state_not_saved", path=str(path), what="the child record",
                                 cause=atomicfile.cause(e),
                                 hint=f"free space in {self.dir} or make it writable for user "
                                      f"{_user()}: without the record a vLLM orphaned by a "
                                      "killed supervisor is not stopped by the next start")
            return
        if atomicfile.FAILURES.saved(path):
            self.log.info("state_saved", path=str(path), what="the child record")

    def _refresh(self, infos: list[ProcInfo]) -> None:
        """Keep the group as it is now in the record: its members start after the leader, and
        a wrapper that exec()s vLLM changes the leader's command line."""
        pids = {i.pid for i in infos}
        rec = next((r for r in self.records.values() if r.pid in pids), self.record)
        if rec is None:
            return
        leader = next((i for i in infos if i.pid == rec.pid
                       and abs(i.create_time - rec.create_time) <= CTIME_TOLERANCE), None)
        cmdline = leader.cmdline if leader is not None else rec.cmdline
        members = {m.pid: m for m in rec.members}
        members.update({i.pid: ProcInfo(i.pid, i.create_time, i.cmdline)
                        for i in infos if i.pid != rec.pid})
        new = ChildRecord(rec.pid, rec.pgid, rec.create_time, cmdline, rec.supervisor_pid,
                          tuple(members.values()))
        if new != rec:
            self._write(new)

    # --- the supervisor's port part ---------------------------------------------------------

    def holder(self, host: str, port: int) -> str | None:
        """Who holds host:port (None: vLLM can bind it, or preflight will say why not).
        Raises the OSError when no file descriptor was left to look with: "cannot look" is
        neither a free port nor a holder (the supervisor's preflight looks again later)."""
        err = try_bind(host, port)
        if err is not None and fdlimit.exhausted(err):
            raise err
        if err is None or err.errno != errno.EADDRINUSE:
            return None
        return port_holders(host, port)

    def owner(self, child: ChildGroup, host: str, port: int) -> PortOwner:
        """Does a process of our child's group listen on host:port?  "Cannot tell" (``ours``
        None) when no file descriptor was left to look with: never a stranger for that."""
        try:
            return self._owner(child, host, port)
        except OSError as e:
            if not fdlimit.exhausted(e):
                raise
            fdlimit.PRESSURE.note("who listens on vLLM's port", e)
            return PortOwner(None, "cannot look: no file descriptor left")

    def _owner(self, child: ChildGroup, host: str, port: int) -> PortOwner:
        pids = list(dict.fromkeys([child.pid, *child.group_members()]))
        infos = [i for pid in pids if (i := _proc_info(pid, strict=True)) is not None]
        unseen = 0
        for info in infos:
            try:
                conns = _proc_connections(info.pid)
            except psutil.AccessDenied:
                unseen += 1
                continue
            except psutil.Error:
                continue
            if listeners(conns, host, port, info.pid):
                self._refresh(infos)
                return PortOwner(True)
        if infos and unseen == len(infos):
            return PortOwner(None, f"the sockets of our vLLM are not visible to user {_user()}")
        return PortOwner(False, port_holders(host, port, strict=True))

    # --- what a previous instance left ------------------------------------------------------

    def stop_orphans(self, term_timeout: float) -> list[int]:
        """Stop the vLLM groups a killed supervisor left (verified: the serving engine's and a
        standby's); the pids stopped (the GPU part then waits for their memory:
        gpu.GpuParts.wait_released)."""
        return [pid for path in self.record_paths()
                for pid in self._stop_orphans_of(path, term_timeout)]

    def _stop_orphans_of(self, path: Path, term_timeout: float) -> list[int]:
        try:
            rec = ChildRecord.from_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except OSError as e:
            self.log.warning("child_record_unreadable", path=str(path),
                             error=e.strerror or str(e))
            return []
        if rec is None:
            self.log.warning("child_record_unreadable", path=str(path),
                             error="not a child record")
            return []
        live = [i for p in rec.processes() if (i := _proc_info(p.pid)) is not None]
        verdict = judge_orphans(rec, live, _group_now(rec.pgid))
        if verdict.reused:
            self.log.info("orphan_pid_reused", pids=[p.pid for p in verdict.reused],
                          detail="recorded pids now run other programs: left alone")
        if verdict.unverified:
            self.log.warning("orphan_unverified", pgid=rec.pgid,
                             processes="; ".join(p.describe() for p in verdict.unverified),
                             detail="in the recorded process group but not provably ours: "
                                    "left alone (the port check names them if they hold it)")
        if not verdict.ours:
            with contextlib.suppress(OSError):
                path.unlink()
            return []
        pids = [p.pid for p in verdict.ours]
        start = self.clock()
        self.log.warning("orphan_found", pids=pids, pgid=rec.pgid,
                         supervisor_pid=rec.supervisor_pid, record=str(path),
                         processes="; ".join(p.describe() for p in verdict.ours))
        how = self._stop(rec.pgid if verdict.group else None, verdict.ours, term_timeout)
        left = self._alive(verdict.ours)
        if left:
            self.log.error("orphan_survives", pids=[p.pid for p in left],
                           detail=f"still alive {ORPHAN_KILL_WAIT:g}s after SIGKILL")
            return pids
        self.log.warning("orphan_stopped", pids=pids, signal=how,
                         seconds=round(self.clock() - start, 2))
        with contextlib.suppress(OSError):
            path.unlink()
        return pids

    def _alive(self, procs: Iterable[ProcInfo]) -> list[ProcInfo]:
        out = []
        for p in procs:
            now = _proc_info(p.pid)
            if now is not None and abs(now.create_time - p.create_time) <= CTIME_TOLERANCE:
                out.append(p)
        return out

    def _signal(self, pgid: int | None, procs: list[ProcInfo], sig: int) -> None:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            return
        for p in self._alive(procs):  # verified again right before each signal
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)

    def _wait_gone(self, procs: list[ProcInfo], deadline: float) -> bool:
        while self._alive(procs):
            if self.clock() >= deadline:
                return False
            self.sleep(0.1)
        return True

    def _stop(self, pgid: int | None, procs: list[ProcInfo], term_timeout: float) -> str:
        self._signal(pgid, procs, signal.SIGTERM)
        if self._wait_gone(procs, self.clock() + term_timeout):
            return "SIGTERM"
        self._signal(pgid, procs, signal.SIGKILL)
        self._wait_gone(procs, self.clock() + ORPHAN_KILL_WAIT)
        return "SIGKILL"
