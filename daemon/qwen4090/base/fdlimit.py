"""The supervisor's file descriptors: the limit it runs under, and what it does when none is left.

The front serves clients in the supervisor's own process, so every client connection is one
of the supervisor's files.  Measured before issue 28 (CPU vLLM, soft RLIMIT_NOFILE 1,024):
1,100 idle half-sent requests made the supervisor judge its engine dead (the read of the
EngineCore's /proc/PID/stat failed with EMFILE and was taken for a gone process) and then exit
70 (psutil's walk of /proc raised EMFILE through the loop); 1,100 requests held during a
restart made the restart's preflight fail the same way.  Two answers, as Envoy's overload
manager gives them (refuse new work before a resource runs out, and never let the lack of one
decide anything else):

- :func:`raise_soft`: at start the soft limit goes up to the hard one (systemd's
  LimitNOFILE=65536 sets both; a shell's ``ulimit -n`` often leaves 1,024 soft under a high
  hard limit), and the front keeps its connection cap below it with :data:`FD_RESERVE` left
  for the supervisor's own work;
- :func:`exhausted` and :class:`Pressure`: a look that fails for want of a file descriptor
  (EMFILE: this process; ENFILE: the whole system) is "could not look", never a verdict on
  the engine nor a reason to exit: the caller keeps its last answer (or the harmless one) and
  looks again at its next step; the journal says so once per burst (``fd_pressure``).

Imports nothing of ours but logs and redact: any layer may use it.
"""

from __future__ import annotations

import errno
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

from qwen4090.base import logs
from qwen4090.base.redact import safe_error

# Files the supervisor keeps for its own work whatever clients do: vLLM's output pipes (and a
# standby's), the /proc reads of the engine watch and the port checks, the probes' sockets to
# vLLM, the status endpoint and its scrapers, NVML's device files, the journal, the instance
# lock, a preflight's bind and a spawn's pipes.  A serving supervisor with a standby holds about
# 60; four times that leaves room for scrapes and a restart at the worst moment.
FD_RESERVE = 256
NO_FILE = (errno.EMFILE, errno.ENFILE)
NR_OPEN = "/proc/sys/fs/nr_open"  # the kernel's ceiling for a soft limit of "unlimited"
QUIET_AFTER = 10.0  # seconds without a failed look that end a burst of them (one journal line)


def soft_limit() -> int:
    """The soft RLIMIT_NOFILE now in force (RLIM_INFINITY as the kernel's nr_open)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _ceiling() if soft == resource.RLIM_INFINITY else int(soft)


def raise_soft(log: Any = None) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (an unlimited hard limit: to the kernel's
    nr_open, the most setrlimit accepts); the soft limit now in force.  Said once in the
    journal (``fd_limit``; ``log`` None: not said).  A refusal (a seccomp filter, say) leaves
    the limit as it was and says why: the front's cap is then sized on the lower one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _ceiling() if hard == resource.RLIM_INFINITY else hard
    error = None
    if soft == resource.RLIM_INFINITY or soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as e:
            error = safe_error(e)
    now = soft_limit()
    if log is not None:
        fields = {"soft": now, "hard": "unlimited" if hard == resource.RLIM_INFINITY else hard,
                  "was": "unlimited" if soft == resource.RLIM_INFINITY else soft,
                  "reserve": FD_RESERVE}
        if error is None:
            log.info("fd_limit", **fields)
        else:
            log.warning("fd_limit", **fields, error=error,
                        detail="the soft limit could not be raised; the front's connection "
                               "cap is kept below it")
    return now


def _ceiling() -> int:
    try:
        with open(NR_OPEN) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default nr_open


def exhausted(e: BaseException | None) -> bool:
    """``e`` says no file descriptor was left (EMFILE, ENFILE): see :func:`no_file`."""
    return no_file(e) is not None


def no_file(e: BaseException | None) -> OSError | None:
    """The EMFILE/ENFILE error in ``e``: itself, or an exception it was raised from or while
    handling (config.read_secret turns the OSError into a ConfigError raised ``from None``: the
    OSError is still its ``__context__``); None when ``e`` is about something else."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_FILE:
            return e
        e = e.__cause__ or e.__context__
    return None


class Pressure:
    """The looks that failed for want of a file descriptor: one ``fd_pressure`` warning per
    burst (a burst ends after QUIET_AFTER seconds without one), with how many looks the last
    burst missed.  Any thread may call :meth:`note` (probe jobs, the pipe readers, the loop)."""

    def __init__(self, log: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logs.get_logger() if log is None else log
        self.clock = clock
        self._lock = threading.Lock()
        self.last: float | None = None  # the last failed look
        self.missed = 0  # looks missed in the current burst
        self.total = 0  # ... since the start

    def note(self, where: str, e: BaseException | str) -> None:
        """A look at ``where`` could not be made (``e``, or a probe's error text): said at the
        start of a burst."""
        with self._lock:
            now = self.clock()
            new = self.last is None or now - self.last >= QUIET_AFTER
            before = self.missed
            self.missed = 1 if new else self.missed + 1
            self.total += 1
            self.last = now
        if new:
            self.log.warning("fd_pressure", where=where,
                             error=e if isinstance(e, str) else safe_error(e),
                             fd_limit=soft_limit(), missed_last_burst=before or None,
                             detail="no file descriptor left: could not look, no verdict; "
                                    "looked at again at the next step")

    def active(self) -> bool:
        """A look failed within QUIET_AFTER."""
        with self._lock:
            return self.last is not None and self.clock() - self.last < QUIET_AFTER


PRESSURE = Pressure()  # the process's: its file descriptors are one pool
