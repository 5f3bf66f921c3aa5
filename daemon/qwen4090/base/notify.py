"""systemd's notify protocol (sd_notify), in the shape of systemd's own self-contained example.

Our own ~30 lines rather than the sdnotify package: we need abstract sockets, MONOTONIC_USEC
for reloads, the watchdog interval from WATCHDOG_USEC/WATCHDOG_PID, and a send error that is
reported once instead of swallowed; sdnotify (0.3) does only the first.  Without NOTIFY_SOCKET
every call is a no-op, so the daemon runs the same in a terminal.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping

# Variables a child must never inherit: vLLM would otherwise be able to speak for us.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# Messages kept while the receiver does not read (a datagram socket holds only
# net.unix.max_dgram_qlen unread ones: the kernel's 10, 512 where systemd's sysctl.d sets it;
# then a blocking send blocks the loop).
MAX_PENDING = 64


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = _watchdog_interval(env)
        self._on_error = on_error
        self._error_reported = False
        self._sock: socket.socket | None = None
        self._pending: deque[str] = deque()  # accepted, not yet taken by the receiver
        self.sent: list[str] = []  # the last messages accepted, for status and tests

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def pending(self) -> int:
        """Messages still waiting for the receiver (the loop calls :meth:`flush` soon)."""
        return len(self._pending)

    def notify(self, *fields: str) -> bool:
        """Send, never blocking the caller (the supervisor's loop).

        A receiver that does not read (systemd busy; a test's reader starved of CPU) used to
        block ``sendto`` once max_dgram_qlen datagrams waited, and with it the loop.  Now what
        cannot go out waits here, in order, and
        :meth:`flush` sends it later; a newer STATUS= replaces an older one still waiting.
        False when the message could not be sent (now or later: no receiver at all).
        """
        if not self.address:
            return False
        payload = "\n".join(fields)
        if self._pending and _status_only(payload):
            self._pending = deque(p for p in self._pending if not _status_only(p))
        self._pending.append(payload)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
        self.sent = [*self.sent[-20:], payload]
        self.flush()
        return self._sock is not None  # sent or waiting; flush drops the socket when none listens

    def flush(self) -> bool:
        """Send what waits, in order, without blocking; True when nothing is left."""
        addr = self.address
        if not addr:
            return True
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        while self._pending:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(self._pending[0].encode(), socket.MSG_DONTWAIT, addr)
            except BlockingIOError:
                return False  # the receiver's queue is full: later
            except OSError as e:
                self._pending.clear()  # no receiver (gone, wrong path): nothing will take it
                self.close()
                if self._on_error and not self._error_reported:
                    self._error_reported = True
                    self._on_error(f"sd_notify to {self.address} failed: {e}")
                return False
            self._pending.popleft()
        return True

    # The messages we use, by name.
    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> bool:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 (Type=notify-reload).
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status_only(payload: str) -> bool:
    return payload.startswith("STATUS=") and "\n" not in payload


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when not asked."""
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 / 2 if value > 0 else None


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the variables that belong to our own unit."""
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV}
