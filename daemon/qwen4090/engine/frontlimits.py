"""What clients may cost the supervisor (issue 28.2, 28.3, 28.6): the front's limits, the
client connections it counts and times, and the lines it writes about them.

The front lives in the supervisor's process, so a client's file descriptors and bytes are the
supervisor's.  Measured before these bounds (CPU vLLM, soft file limit 1,024): 1,100 idle
half-sent requests made the supervisor judge its engine dead (psutil could not open /proc) and
exit 70; 24 bodies of 64 MiB held through an outage took it from 50 MB to 1,557 MB.  Here, as
HAProxy's ``maxconn`` and ``timeout http-request`` and nginx's ``client_header_timeout`` and
``client_max_body_size`` do, and in Envoy's spirit (refuse new work before a resource runs out):

- :class:`Door` wraps each client connection before aiohttp sees it: past
  ``max_connections`` the connection gets a 503 written by hand and is closed, without ever
  reaching aiohttp (no parser, no task); the cap itself is kept below the process's file
  limit with room for the supervisor's own work (:func:`limits_of`);
- :class:`Doors` times each connection: one that has not sent a whole request head within
  ``header_timeout`` of its opening or of its last answer gets a 408 (idle: just closed);
  once the head is whole, the wait for its handler is the front's, never timed;
- the request bodies held in memory, all clients together, are counted against
  ``body_budget`` by the front (503 past it), and each against ``max_body`` (413);
- every refusal is counted by its reason for /metrics and said in the journal once per burst
  (:class:`Shedding`), and aiohttp's own errors go through the structured log, rate-limited
  (:class:`HttpLog`), never as raw tracebacks on stderr.

Threading: everything here runs on the front's event loop, except :class:`Shedding.sample`
(any thread, under its lock).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import http_exceptions

from qwen4090.base.fdlimit import FD_RESERVE  # the files kept for the supervisor's own work
from qwen4090.settings.config import FrontConfig

MIB = 1 << 20
# Each client connection may hold two files: its own socket and one to vLLM.
FDS_PER_CONNECTION = 2
# Refused connections are kept open a moment to read what the client sent (a close with
# unread data is a reset, and the client would never read its 503): one file each, as many at
# once as the files left beside the cap's allow, at least LINGER_MIN, at most LINGER_MAX; past
# that they are closed at once (a client may then see a reset).  Measured: 350 clients kept
# reconnecting past a cap of 100 on this 2-core machine (tests/integration/test_edge.py) met
# 798 resets in 5,469 refusals with 64 at most.
LINGER_MIN = 64
LINGER_MAX = 4096
LINGER_SECONDS = 1.0
# The bytes a request head may take before its handler runs (nginx: 4 x 8 KiB, HAProxy: 16
# KiB).  aiohttp 3.9+ also refuses more than front.MAX_HEADERS fields; Debian 12's 3.8 has no
# bound of its own on a head's size (20,000 fields, 1.2 MB, were parsed and forwarded).
MAX_HEAD = 64 * 1024
SWEEP_EVERY = 0.5  # seconds between looks at the connections' timers
QUIET_AFTER = 10.0  # seconds without a refusal that end a burst of them (one journal line)
RETRY_AFTER = 5  # seconds a 503 asks the client to wait


@dataclass(frozen=True)
class Limits:
    """The front's bounds ([front]); ``max_connections`` already within the file limit."""

    hold_timeout: float = 120.0
    max_connections: int = 1024
    max_held: int = 256
    header_timeout: float = 10.0
    max_body: int = 32 * MIB
    body_budget: int = 256 * MIB
    configured_connections: int = 1024  # front.max_connections as set
    fd_limit: int = 0  # the soft file limit the cap was kept below (0: not looked at)
    linger_max: int = LINGER_MIN  # refused connections read and closed at once, at most


def limits_of(f: FrontConfig, fd_limit: int | None) -> Limits:
    """The limits of ``[front]`` with the connection cap kept below ``fd_limit`` (the soft
    RLIMIT_NOFILE in force; None: no limit known)."""
    cap, linger = f.max_connections, LINGER_MIN
    if fd_limit is not None and fd_limit > 0:
        cap = max(1, min(cap, (fd_limit - FD_RESERVE - LINGER_MIN) // FDS_PER_CONNECTION))
        spare = fd_limit - FD_RESERVE - cap * FDS_PER_CONNECTION
        linger = max(LINGER_MIN, min(LINGER_MAX, spare))
    return Limits(hold_timeout=f.hold_timeout, max_connections=cap, max_held=f.max_held,
                  header_timeout=f.header_timeout, max_body=int(f.max_body_mib * MIB),
                  body_budget=int(f.body_budget_mib * MIB),
                  configured_connections=f.max_connections, fd_limit=fd_limit or 0,
                  linger_max=linger)


def raw_answer(status: int, reason: str, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection: for a connection that never reaches
    aiohttp (past the cap) or that aiohttp is still reading (a head too slow)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if status == 503:
        head += f"Retry-After: {RETRY_AFTER}\r\n"
    return head.encode() + b"\r\n" + body


class Door(asyncio.Protocol):
    """One client connection: counted, timed, and handed to aiohttp's protocol, or refused."""

    def __init__(self, doors: Doors, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self.doors = doors
        self.make_inner = make_inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests of this connection being handled
        self.since: float | None = None  # waiting for a request head since (None: busy)
        self.received = 0  # bytes the client sent, in all
        self.mark = 0  # ... when it began waiting
        self.lingering = False
        self.cut = False  # its head grew past MAX_HEAD: 431, closing
        # the request head's end (a blank line) seen since ``mark``: what follows is its body,
        # which MAX_HEAD does not bound (front.max_body_mib does); ``tail``: the last bytes
        # before this chunk, for a blank line split between two chunks
        self.head_done = False
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.doors.admit(self):
            return
        self.inner = self.make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        before = self.received
        self.received += len(data)
        if self.inner is None or self.cut:
            return  # refused: what it sends is read and dropped
        if self.busy == 0 and not self.head_done and self.head_too_large(before, data):
            self.cut = True  # aiohttp's parser gets no more of it (it is told of the close)
            self.doors.head_too_large(self)
            return
        self.inner.data_received(data)

    def head_too_large(self, before: int, data: bytes) -> bool:
        """Whether the head being received is past MAX_HEAD.  Only the head counts: a body
        sent right behind it (a long prompt, before the handler has started) is the body's
        business (a 300 KB prompt got 431 in the soak, issue 30.3)."""
        kept = len(self.tail)
        seen = self.tail + data
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            self.tail = seen[-3:]
            return self.received - self.mark > MAX_HEAD
        self.head_done, self.tail = True, b""
        # the head: what came since ``mark`` before this chunk, and this chunk up to the end
        # of the blank line (``end`` counts from the start of the kept tail)
        return (before - self.mark) + (end - kept) + 4 > MAX_HEAD

    def eof_received(self) -> bool | None:
        if self.inner is not None and not self.cut:
            return self.inner.eof_received()
        return None  # a refused connection: the client is done, close it

    def connection_lost(self, exc: Exception | None) -> None:
        self.doors.left(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class Doors:
    """The open client connections: the cap, the head timer, the lingering refusals."""

    def __init__(self, limits: Callable[[], Limits], shed: Callable[[str], None],
                 reject: Callable[[str], None], clock: Callable[[], float]) -> None:
        self.limits, self.shed, self.reject, self.clock = limits, shed, reject, clock
        self.open: dict[asyncio.BaseTransport, Door] = {}  # admitted, by transport
        self.lingering: dict[Door, float] = {}  # refused, kept open until

    def protocol(self, make_inner: Callable[[], asyncio.Protocol]) -> Callable[[], Door]:
        return lambda: Door(self, make_inner)

    def admit(self, door: Door) -> bool:
        assert door.transport is not None
        lim = self.limits()
        if len(self.open) < lim.max_connections:
            self.open[door.transport] = door
            door.since, door.mark = self.clock(), 0
            return True
        self.shed("max_connections")
        door.transport.write(raw_answer(
            503, "Service Unavailable", f"too many connections: qwen4090 holds "
            f"{lim.max_connections} open (front.max_connections); try again later",
            "overloaded"))
        if len(self.lingering) < lim.linger_max and door.transport.can_write_eof():
            door.transport.write_eof()  # what it sent is read and dropped, then closed
            door.lingering = True
            self.lingering[door] = self.clock() + LINGER_SECONDS
        else:
            door.transport.close()
        return False

    def head_too_large(self, door: Door) -> None:
        """A request head past MAX_HEAD: 431, then what the client still sends is read and
        dropped for a moment (a reset would hide the answer), then closed."""
        assert door.transport is not None
        self.reject("head_too_large")
        door.transport.write(raw_answer(
            431, "Request Header Fields Too Large", f"the request's head is larger than "
            f"{MAX_HEAD // 1024} KiB", "request_too_large"))
        if door.transport.can_write_eof():
            door.transport.write_eof()
            self.lingering[door] = self.clock() + LINGER_SECONDS
        else:
            door.transport.close()

    def left(self, door: Door) -> None:
        if door.transport is not None:
            self.open.pop(door.transport, None)
        self.lingering.pop(door, None)

    def busy(self, transport: asyncio.BaseTransport | None) -> Door | None:
        """A request of this connection is being handled (its head is in)."""
        door = self.open.get(transport) if transport is not None else None
        if door is not None:
            door.busy += 1
            door.since = None
        return door

    def done(self, door: Door | None) -> None:
        """... and it has been answered: the next request's head is timed from now."""
        if door is None:
            return
        door.busy -= 1
        if door.busy == 0:
            door.since, door.mark = self.clock(), door.received
            door.head_done, door.tail = False, b""

    def sweep(self) -> None:
        """Close what waited too long: a request head past header_timeout (408), an idle
        connection past it (closed), a refusal's linger past its second."""
        now = self.clock()
        timeout = self.limits().header_timeout
        # a head that has come whole is not the client's delay: its handler is ours to start
        # (the CPU soak, issue 30.3: 4 requests of a 64-client burst on a starved 2-core box
        # got 408 with their heads sent in one write)
        for door in [d for d in self.open.values() if d.busy == 0 and not d.head_done
                     and d.since is not None and now - d.since > timeout]:
            assert door.transport is not None
            if door.received > door.mark:  # a head began and never ended: slowloris
                self.reject("header_timeout")
                door.transport.write(raw_answer(
                    408, "Request Timeout", f"the request's head did not come within "
                    f"{timeout:g}s (front.header_timeout)", "timeout"))
            door.since = None
            door.transport.close()
        for door, until in list(self.lingering.items()):
            if now >= until and door.transport is not None:
                del self.lingering[door]
                door.transport.close()

    def close_all(self) -> None:
        for door in list(self.lingering):
            if door.transport is not None:
                door.transport.close()
        self.lingering.clear()


@dataclass
class Shedding:
    """Requests refused by a limit (503s of overload) and rejected as bad (4xx), by reason:
    counted for /metrics, said in the journal once when a burst of them begins and once when
    it ends (QUIET_AFTER without one), and in STATUS while it lasts."""

    log: Any
    clock: Callable[[], float] = time.monotonic
    shed: dict[str, int] = field(default_factory=dict)  # limit -> 503s
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> 4xx
    _burst: dict[str, int] = field(default_factory=dict)
    _since: float = 0.0
    _last: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count_shed(self, limit: str, key: str, value: Any) -> None:
        now = self.clock()
        with self._lock:
            self.shed[limit] = self.shed.get(limit, 0) + 1
            first = not self._burst
            self._burst[limit] = self._burst.get(limit, 0) + 1
            if first:
                self._since = now
            self._last = now
        if first:
            self.log.warning("front_shedding", limit=key, value=value,
                             hint=f"clients get 503 with Retry-After while {key} is reached; "
                                  f"raise it in [front] if the box has room")

    def count_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def tick(self) -> None:
        """The end of a burst: QUIET_AFTER without a 503 of a limit."""
        now = self.clock()
        with self._lock:
            if not self._burst or now - self._last < QUIET_AFTER:
                return
            burst, since, self._burst = self._burst, self._since, {}
        self.log.info("front_shed", seconds=round(self._last - since, 1),
                      **{k: v for k, v in sorted(burst.items())})

    def sample(self) -> str:
        """STATUS's words while a burst lasts ('' when none)."""
        with self._lock:
            if not self._burst:
                return ""
            n = sum(self._burst.values())
            which = ", ".join(f"front.{k}" for k in sorted(self._burst))
        return f"refusing clients: {n} over {which}"

    def copy(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.shed), dict(self.rejected)


class LineQuota:
    """At most ``lines`` journal lines per ``window`` seconds (one line per bad request at
    most, and a flood of them costs the journal a few lines and a count)."""

    def __init__(self, lines: int = 10, window: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lines, self.window, self.clock = lines, window, clock
        self._start = -window
        self._used = 0
        self._dropped = 0

    def take(self) -> int | None:
        """None: say nothing; else say it, with this many dropped since the last line."""
        now = self.clock()
        if now - self._start >= self.window:
            self._start, self._used = now, 0
        if self._used >= self.lines:
            self._dropped += 1
            return None
        self._used += 1
        dropped, self._dropped = self._dropped, 0
        return dropped


class HttpLog(logging.Logger):
    """The logger aiohttp's server writes to (its ``logger=``): each record becomes one
    structured line, rate-limited, without a traceback.  A client's malformed request is
    ``front_bad_request`` at info; anything else (a fault of ours) ``front_error`` at error."""

    def __init__(self, log: Any, quota: LineQuota | None = None) -> None:
        super().__init__("qwen4090.engine.front.http", logging.DEBUG)
        self.propagate = False
        self.sink = log  # the structured log (Logger.log is a method of the base)
        self.quota = quota or LineQuota()
        self.addHandler(_Bridge(self))

    def loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The front loop's exception handler (asyncio's default prints a traceback)."""
        exc = context.get("exception")
        self._say("front_loop_error", "warning", str(context.get("message", "")), exc)

    def _say(self, event: str, level: str, message: str, exc: BaseException | None) -> None:
        dropped = self.quota.take()
        if dropped is None:
            return
        fields: dict[str, Any] = {"message": _one_line(message)}
        if exc is not None:
            fields["error"] = _one_line(f"{type(exc).__name__}: {exc}")
        if dropped:
            fields["dropped"] = dropped
        getattr(self.sink, level)(event, **fields)


class _Bridge(logging.Handler):
    def __init__(self, owner: HttpLog) -> None:
        super().__init__(logging.DEBUG)
        self.owner = owner

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and not record.exc_info:
            return  # aiohttp's debug chatter
        exc = record.exc_info[1] if record.exc_info else None
        bad = exc is not None and _client_fault(exc)
        self.owner._say("front_bad_request" if bad else "front_error",
                        "info" if bad else "error", record.getMessage(), exc)


def _client_fault(exc: BaseException) -> bool:
    return isinstance(exc, (http_exceptions.HttpProcessingError, ConnectionError,
                            asyncio.CancelledError, asyncio.TimeoutError))


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]
