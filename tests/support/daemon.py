"""The one runner of real processes for the test tiers and the benches: a process group we
started, its output read as it arrives (seconds since launch on every line, optionally copied to
a log file); for ``qwen4090 run`` a real NOTIFY_SOCKET (a datagram socket we read, as systemd
would) and its JSON log lines (``<N>{...}``) parsed.  Every wait has a deadline.

Standard library and psutil only (the GPU image has both, and qwen4090 needs psutil anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import psutil

from tests.support.runtime import REPO

# The supervisor the tests run (another checkout's daemon/ measures "before" numbers).
DAEMON_SRC = Path(os.environ.get("QWEN4090_DAEMON_SRC", REPO / "daemon"))


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment with DAEMON_SRC first on PYTHONPATH (what runs is this checkout's)."""
    path = os.pathsep.join(filter(None, [str(DAEMON_SRC), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def reading_stdin(pid: int) -> bool:
    """The process blocks in read(0, ...) (x86_64 and arm64 number read 0 and 63)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] in ("0", "63") and int(fields[1], 16) == 0


class Proc:
    """A process in a new session (its own process group) and its merged stdout/stderr."""

    unset: tuple[str, ...] = ()  # names taken out of its environment

    def __init__(self, argv: list[str], log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        """``env`` is added to ours; nothing runs before ``start()``."""
        self.argv, self.log_path, self.env, self.cwd = argv, log_path, env, cwd
        self.lines: list[tuple[float, str]] = []  # (seconds since launch, line)
        self.raw: list[str] = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._fh: TextIO | None = None
        self._threads: list[threading.Thread] = []
        self.t0 = time.monotonic()

    def start(self) -> Proc:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.log_path.open("w", encoding="utf-8")
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        for name in self.unset:
            env.pop(name, None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        # A full pipe blocks the daemon's log writes, and with them its loop.  On CI's 2 cores
        # with vLLM busy, this reader (one thread among the test's streams) can fall seconds
        # behind: 1 MiB instead of 64 KiB of slack (Linux's default pipe-max-size).
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
        self._threads.insert(0, threading.Thread(target=self._read_lines, daemon=True))
        for t in self._threads:
            t.start()
        return self

    # --- reading ---------------------------------------------------------------------------

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            t = time.monotonic()
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self.cond:
                self.raw.append(line)
                self.lines.append((t - self.t0, line))
                if self._fh is not None and not self._fh.closed:
                    self._fh.write(f"{t - self.t0:9.3f} {line}\n")
                    self._fh.flush()
                self.on_line(t, line)
                self.cond.notify_all()

    def on_line(self, t: float, line: str) -> None:
        """Called with the lock held for every line (``t``: time.monotonic())."""

    def finished(self) -> bool:
        """The process exited and everything it wrote has been read."""
        return self.proc.poll() is not None and not any(t.is_alive() for t in self._threads)

    # --- waiting ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def wait_for(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """The first true value of ``pred`` (called with the lock held), or AssertionError at
        the deadline, or as soon as the process is gone with all its output read."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = pred()
                if value:
                    return value
                left = deadline - time.monotonic()
                gone = self.finished()
                if left <= 0 or gone:
                    tail = "\n".join(self.raw[-40:])
                    why = "the process ended" if gone else f"timed out after {timeout:g}s"
                    raise AssertionError(f"{why} waiting for {what}; rc={self.proc.poll()}"
                                         f"{self.where()}; last lines:\n{tail}")
                self.cond.wait(min(left, 0.5))

    def where(self) -> str:
        return f"; log: {self.log_path}" if self.log_path else ""

    def find(self, pattern: str, after: float = -1.0) -> tuple[float, str] | None:
        """The first line after ``after`` (seconds since launch) that matches ``pattern``."""
        with self.lock:
            return self._find_locked(pattern, after)

    def wait_line(self, pattern: str, timeout: float, after: float = -1.0,
                  fail: str | None = None) -> tuple[float, str]:
        """Wait for a line matching ``pattern``; AssertionError at once on a ``fail`` line."""
        def seen() -> tuple[float, str] | None:
            if fail and self._find_locked(fail, after):
                raise AssertionError(f"{fail!r} seen while waiting for {pattern!r}"
                                     f"{self.where()}")
            return self._find_locked(pattern, after)
        return self.wait_for(seen, timeout, repr(pattern))

    def _find_locked(self, pattern: str, after: float) -> tuple[float, str] | None:
        rx = re.compile(pattern)
        return next(((t, ln) for t, ln in self.lines if t > after and rx.search(ln)), None)

    # --- ending ----------------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the whole group; its exit status, or None if it outlived ``timeout``
        (then, and in any case, the group is killed)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._close_output()

    def _close_output(self) -> None:
        self._threads[0].join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with self.lock:
            if self._fh is not None:
                self._fh.close()


class Daemon(Proc):
    """``python -m qwen4090 run --config CONFIG`` with a NOTIFY_SOCKET in ``tmp``.

    ``port``: vLLM's port, kept for the test's clients.  ``own_runtime_dir``: ``tmp`` is its
    RUNTIME_DIRECTORY= (the instance lock and child record, as systemd would give; daemons of
    one test share them); False leaves the environment's.
    """

    unset = ("WATCHDOG_USEC",)  # systemd's watchdog is not ours to feed

    def __init__(self, config_path: Path, tmp: Path, *, port: int = 0,
                 own_runtime_dir: bool = True, log_path: Path | None = None,
                 cwd: Path | None = None, nofile: tuple[int, int] | None = None) -> None:
        """``nofile``: the daemon starts with this (soft, hard) RLIMIT_NOFILE (prlimit)."""
        self.config_path, self.tmp = config_path, tmp
        self.port = port  # vLLM's, for the test's clients (0: not said)
        self.notify_path = str(tmp / f"notify-{os.getpid()}-{time.monotonic_ns()}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.notify_path)
        self.sock.settimeout(0.2)
        self.events: list[dict[str, Any]] = []  # parsed JSON log lines, with "_t" and "_prio"
        self.notes: list[tuple[float, list[str]]] = []  # (time, fields) per notify datagram
        self.pids_seen: set[int] = set()
        extra = {"NOTIFY_SOCKET": self.notify_path}
        if own_runtime_dir:
            extra["RUNTIME_DIRECTORY"] = str(tmp)
        limit = [] if nofile is None else ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--"]
        super().__init__([*limit, sys.executable, "-m", "qwen4090", "run", "--config",
                          str(config_path)], log_path, daemon_env(extra), cwd)
        self._threads.append(threading.Thread(target=self._read_notify, daemon=True))
        self.start()

    # --- readers -------------------------------------------------------------------------

    def on_line(self, t: float, line: str) -> None:
        if line.startswith("<") and ">" in line[:4]:
            prio, body = line[1:line.index(">")], line[line.index(">") + 1:]
            try:
                ev = json.loads(body)
                ev["_prio"] = int(prio)
            except ValueError:
                return
            ev["_t"] = t
            self.events.append(ev)

    def _read_notify(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                if self.proc.poll() is not None:
                    return
                continue
            except OSError:
                return
            with self.cond:
                self.notes.append((time.monotonic(), data.decode().split("\n")))
                self.cond.notify_all()

    # --- waiting ---------------------------------------------------------------------------

    def event(self, name: str, after: int = 0, **match: Any) -> dict[str, Any] | None:
        for ev in self.events[after:]:
            if ev.get("event") == name and all(ev.get(k) == v for k, v in match.items()):
                return ev
        return None

    def wait_event(self, name: str, timeout: float, after: int = 0, **match: Any
                   ) -> dict[str, Any]:
        return self.wait_for(lambda: self.event(name, after, **match), timeout,
                             f"log event {name} {match or ''}")

    def mark(self) -> int:
        with self.lock:
            return len(self.events)

    def notified(self, field: str, after_time: float = 0.0) -> float | None:
        for t, fields in self.notes:
            if t >= after_time and field in fields:
                return t
        return None

    def wait_notify(self, field: str, timeout: float, after_time: float = 0.0) -> float:
        return self.wait_for(lambda: self.notified(field, after_time), timeout,
                             f"sd_notify {field}")

    def statuses(self) -> list[str]:
        return [f[7:] for _, fields in self.notes for f in fields if f.startswith("STATUS=")]

    def state(self) -> str | None:
        with self.lock:
            for ev in reversed(self.events):
                if ev.get("event") == "state_changed":
                    return str(ev["to"])
        return None

    def wait_state(self, state: str, timeout: float, after: int = 0) -> dict[str, Any]:
        return self.wait_event("state_changed", timeout, after, to=state)

    def timed_events(self, name: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        """(seconds since launch, event) for the JSON log lines so far, of ``name`` or all."""
        with self.lock:
            return [(ev["_t"] - self.t0, ev) for ev in self.events
                    if name is None or ev.get("event") == name]

    # --- the vLLM tree ---------------------------------------------------------------------

    def descendants(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.pids_seen.update(p.pid for p in procs)
        return procs

    def engine_core(self) -> psutil.Process:
        def find() -> psutil.Process | None:
            for p in self.descendants():
                try:
                    if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                        return p
                except psutil.Error:
                    continue
            return None
        return self.wait_for(find, 30, "the EngineCore process")

    def wait_preimported(self, timeout: float, after: int = 0) -> int | None:
        """The pid of the pre-imported interpreter (restart.preimport) once it has imported
        everything and blocks reading its stdin; None when none was started after ``after``."""
        try:  # logged right after READY: the log reader may not have it yet
            started = self.wait_event("preimport_started", 10, after)
        except AssertionError:
            return None
        pid = int(started["pid"])
        self.wait_for(lambda: reading_stdin(pid), timeout, "the pre-imported interpreter")
        return pid

    def last_child_pid(self) -> int:
        with self.lock:
            for ev in reversed(self.events):
                if ev.get("event") == "child_spawned":
                    return int(ev["pid"])
        raise AssertionError("no child spawned")

    # --- ending ----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """To the supervisor alone (as systemd's KillMode=mixed does first)."""
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout:g}s; last lines:\n"
                                 + "\n".join(self.raw[-30:])) from None

    def survivors(self) -> list[int]:
        alive = []
        for pid in self.pids_seen:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def close(self) -> None:
        """Whatever happened, leave nothing running."""
        keep = os.environ.get("QWEN4090_KEEP_LOGS")  # a folder: the daemon's log is kept there
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            (Path(keep) / f"daemon-{self.proc.pid}.log").write_text("\n".join(self.raw))
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        for pid in [self.proc.pid, *self.pids_seen]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.sock.close()
        if self.proc.stdout:
            self.proc.stdout.close()
        with self.lock:
            if self._fh is not None:
                self._fh.close()

    def kill(self) -> None:
        super().kill()
        self.sock.close()
