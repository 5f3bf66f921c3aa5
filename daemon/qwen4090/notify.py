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
from collections.abc import Callable, Mapping

# Variables a child must never inherit: vLLM would otherwise be able to speak for us.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = _watchdog_interval(env)
        self._on_error = on_error
        self._error_reported = False
        self._sock: socket.socket | None = None
        self.sent: list[str] = []  # the last messages, for status and tests

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        if not self.address:
            return False
        payload = "\n".join(fields)
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload.encode(), addr)
        except OSError as e:
            if self._on_error and not self._error_reported:
                self._error_reported = True
                self._on_error(f"sd_notify to {self.address} failed: {e}")
            return False
        self.sent = [*self.sent[-20:], payload]
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
