"""The client port (issue 20): clients talk to qwen4090, which passes each request to vLLM.

vLLM listens where only the front reaches it (127.0.0.1:``front.engine_port``); the front
listens on ``vllm.host:vllm.port``, the address clients always used.  What it adds to a plain
proxy is what a restart of vLLM needs:

- **hold**: while vLLM is not serving (starting, restarting after a crash, a hang, an OOM step
  or a ``[vllm]`` reload), a new request waits for the engine, up to ``front.hold_timeout``;
  past it, a 503 with Retry-After;
- **replay**: a request whose engine failed before any byte of its answer reached the client
  (connection refused or cut, or vLLM's own 5xx while the supervisor declares the engine dead)
  is sent once more, to the next engine;
- **retry**: a request whose connection failed before vLLM answered anything, on an engine
  nobody declared dead, is sent again on a new connection to the same engine (at once, then
  each time after REPLAY_GRACE without a death verdict), up to ``front.hold_timeout``: the
  connection may be one vLLM's server closed for idling just as the request went out
  (uvicorn's keep-alive timeout), or a connect that timed out on a machine too busy; an engine
  that really died is declared so within the grace, and the request is replayed on the next;
- **a started stream never ends silently**: when the engine dies mid-stream, the client gets an
  OpenAI-style error event (``data: {"error": ...}``);
- **exact counts**: requests in flight (the drain waits for them), held, and sent to the engine
  without a byte back yet (the hang detector's witness: vLLM's own gauges can read 0 on a
  wedged engine).

The data path is aiohttp (a well-kept HTTP library; Debian: python3-aiohttp) on one event loop
in its own thread, so the supervisor's loop never delays a byte and a slow client never delays
the supervisor.  The supervisor steers it from its own thread with typed commands naming the
engine (:meth:`Front.command`: steering.Serve, Hold, Drain, Refuse); everything it reads
(:meth:`Front.sample`) is a copy taken under a lock.  Why aiohttp and not HAProxy:
docs/architecture.md ("The front").

``python -m qwen4090.engine.front --listen HOST:PORT --engine HOST:PORT`` runs the front alone, with
the engine always up (the cost benchmark, bench/front_cost.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from qwen4090.base.steering import Drain, FrontCommand, Hold, Refuse, Serve
from qwen4090.decide import clientpath
from qwen4090.decide.results import FrontSample
from qwen4090.engine.frontlimits import RETRY_AFTER, SWEEP_EVERY, Doors, HttpLog, Limits, Shedding

# Headers that belong to one connection, not to the request or answer (RFC 9110 7.6.1), and
# those aiohttp sets itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "date", "server",
})
# vLLM's own 5xx answers while its engine dies ("EngineCore encountered an issue"): replayed
# when the supervisor declares that engine dead within this long, else passed on as they are.
REPLAY_GRACE = 3.0
HELD_FULL = -2  # _wait_for_engine: front.max_held requests wait already
ROUTES_KEPT = 8  # generations whose engine a late request may still be routed to
# aiohttp's parser (3.9+; 3.8, Debian 12's, does not enforce it): a request head of at most
# this many fields; vLLM's clients send about ten.  The head's size: frontlimits.MAX_HEAD.
MAX_HEADERS = 100
QUEUE_BUCKETS = (0.001, 0.01, 0.1, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, math.inf)
STREAM_DONE = b"data: [DONE]"
STREAM_ERROR = b'data: {"error"'  # an OpenAI-style error event in a stream
# vLLM's own end of a request it aborted (its shutdown at a restart; a client that left never
# gets here): the stream then ends with [DONE], as a good one does
ABORTED = (b'"finish_reason":"abort"', b'"finish_reason": "abort"')
# vLLM is on loopback: a dead one refuses at once, a stopped one's kernel still takes the
# connection; a connect this slow means a machine too busy (seen on 2 cores), and is retried
CONNECT_TIMEOUT = 10.0
# How long an idle connection to vLLM is reused: below its server's keep-alive timeout
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so the front does not send a request on a
# connection the server is closing at that moment (a fresh-clone CI run had one such request
# held for a next engine that never came; the retry covers a server set lower still).
KEEPALIVE = 2.0


# How long a gap between two chunks of one streamed answer is remembered (FrontSample.
# longest_gap): long enough to span a burst's slowest steps, short enough that the hang bound
# comes down again once a heavy load has passed.
STEP_WINDOW = 300.0
# A request body up to this size is past vLLM's tokenizer within milliseconds of reaching it
# (~16k tokens of text): once sent, it is the engine's work.  A larger one may still be
# tokenized in the API server (a 400 KB prompt), where the engine cannot be blamed for its
# silence (the fast hang verdict, issue 30.3).
SMALL_BODY = 64 * 1024


class Gaps:
    """The longest gap added in the last ``window`` seconds (a sliding-window maximum: a deque
    of (when, gap) with the gaps falling, so ``add`` and ``longest`` are amortized O(1))."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._q: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, now: float, gap: float) -> None:
        while self._q and self._q[-1][1] <= gap:
            self._q.pop()
        self._q.append((now, gap))

    def longest(self, now: float) -> float | None:
        while self._q and self._q[0][0] < now - self.window:
            self._q.popleft()
        return self._q[0][1] if self._q else None


@dataclass
class Totals:
    requests: int = 0
    held: int = 0  # requests that waited for an engine
    replayed: int = 0  # requests sent a second time after their engine failed
    retried: int = 0  # sends again to the same engine: the connection failed unanswered
    hold_timeouts: int = 0  # 503: no engine within hold_timeout
    refused: int = 0  # 503: draining, or the daemon gave up
    stream_errors: int = 0  # started streams that ended with an error event (vLLM's or ours)
    failed: int = 0  # answered with an error by the front (the replay failed too, or the
    #                  engine could not be reached while the request could wait)
    queue_seconds: float = 0.0  # time requests spent held, in all
    queue_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_BUCKETS))

    def copy(self) -> Totals:
        """A copy to read outside the front's lock."""
        return dataclasses.replace(self, queue_buckets=list(self.queue_buckets))


@dataclass
class Burst:
    """What one period without an engine did to clients (one journal line when it ends)."""

    since: float
    reason: str
    held: int = 0
    replayed: int = 0
    hold_timeouts: int = 0
    stream_errors: int = 0
    failed: int = 0
    longest_wait: float = 0.0


class ClientGone(Exception):
    """The client closed its connection while its answer was being written."""


class EngineFailed(Exception):
    """The engine failed before any byte of the answer reached the client: replayable."""


class NoAnswer(EngineFailed):
    """... and the connection failed before any answer came: refused, reset, timed out, or
    closed by the server (a dead engine; or an idle connection its server closed as the request
    went out, or a starved machine, on a live one)."""


class Front:
    """The proxy on the client port; start() binds it (OSError when the port is taken)."""

    def __init__(self, listen: tuple[str, int], engine: tuple[str, int], limits: Limits,
                 log: Any, key: str | None = None, clock: Callable[[], float] = time.monotonic,
                 engine_up: bool = False, sock: socket.socket | None = None) -> None:
        self.listen, self.engine = listen, engine
        # the client port's listening socket as systemd kept it (fdstore.py): accepted on as
        # it is, never bound again (None: bind ``listen``)
        self._given = sock
        # changed on the front's loop only (configure()); read anywhere: replaced whole
        self.limits = limits
        self._key = key  # the API key every path but clientpath.PUBLIC needs (None: no key)
        self.log = log
        self.clock = clock
        self.shedding = Shedding(log, clock)
        self._doors = Doors(lambda: self.limits, self._shed_connection,
                            self.shedding.count_rejected, clock)
        self._http_log = HttpLog(log)
        self._body_bytes = 0  # request bodies held in memory now, all clients together
        self._sweeper: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight = 0
        self._holding = 0
        self._unanswered: dict[int, float] = {}
        # the requests the engine surely has (FrontSample.at_engine): answers under way, and
        # unanswered ones whose body is small enough to be past vLLM's tokenizer at once
        self._large: set[int] = set()  # unanswered, body above SMALL_BODY
        self._answering: set[int] = set()  # a byte of the answer back, not done
        self._held: dict[int, float] = {}  # waiting for an engine: since the client sent it
        self._bytes = 0
        self._last_byte: float | None = None
        self._gaps = Gaps(STEP_WINDOW)
        self.totals = Totals()
        # the engine gate, changed on the front's loop only
        self._open = engine_up
        self._gen = 1 if engine_up else 0  # counts the engines that served (0: none yet)
        self._engine_id: object = None  # the supervisor's name for the serving engine
        # each generation's engine, by which requests are routed and replayed (a request that
        # got an engine is sent to that one even if the next was named meanwhile)
        self._routes: dict[int, tuple[tuple[str, int], object]] = \
            {1: (engine, None)} if engine_up else {}
        self._on_engine: dict[object, int] = {}  # engine -> requests sent to it, not done
        self._dead_gen = 0  # the last engine declared dead
        self._refusing: str | None = None  # why requests get 503 at once (given up)
        self._draining = False
        self._changed: asyncio.Condition | None = None
        self._burst: Burst | None = None if engine_up else Burst(clock(), "starting")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection for each request

    # --- life --------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Bind the client port and serve on a thread of its own; OSError when it cannot."""
        started: list[BaseException | None] = []
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)  # this thread's (aiohttp asks get_event_loop())
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
                started.append(None)
            except BaseException as e:
                started.append(e)
                loop.run_until_complete(self._cleanup())
                loop.close()
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._cleanup())
                left = asyncio.all_tasks(loop)  # as asyncio.run ends: the rest cancelled
                for task in left:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=main, name="qwen4090-front", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise OSError(f"the front did not start within {timeout:g}s")
        if started and started[0] is not None:
            raise started[0]
        lim = self.limits
        self.log.info("front_listening", url=f"http://{_host_port(*self.listen)}",
                      engine=_host_port(*self.engine), hold_timeout=lim.hold_timeout,
                      max_connections=lim.max_connections, max_held=lim.max_held,
                      header_timeout=lim.header_timeout, api_key=self._key is not None)
        if lim.max_connections < lim.configured_connections:
            self.log.warning("front_connections_capped", max_connections=lim.max_connections,
                             configured=lim.configured_connections, fd_limit=lim.fd_limit,
                             hint="the process's file limit (LimitNOFILE=) leaves room for "
                                  "fewer client connections: raise it to have them")

    def listening_fds(self) -> list[int]:
        """The file descriptors of the client port's listening sockets (one per address)."""
        server = self._listener
        return [s.fileno() for s in server.sockets] if server is not None else []

    def stop(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        def session(**connector: Any) -> aiohttp.ClientSession:
            return aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, **connector),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self._session = session(keepalive_timeout=KEEPALIVE)
        self._fresh = session(force_close=True)  # for the retry: never a pooled connection
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._http_log.loop_error)  # never a raw traceback
        app = web.Application(client_max_size=self.limits.max_body)  # bodies: _read_body
        app.router.add_route("*", "/{tail:.*}", self._handle)
        kwargs: dict[str, Any] = {"access_log": None, "logger": self._http_log,
                                  "max_headers": MAX_HEADERS,
                                  # a body passes as sent: a gzip bomb is not inflated here
                                  # (and not forwarded inflated under its Content-Encoding)
                                  "auto_decompress": False,
                                  # idle connections: Doors.sweep closes them sooner
                                  "keepalive_timeout": 75.0}
        if _version(aiohttp.__version__) >= (3, 9):
            # a client that left cancels its request (3.8, Debian 12's, always does)
            kwargs["handler_cancellation"] = True
        self._runner = web.AppRunner(app, **kwargs)
        await self._runner.setup()
        # The listening socket is ours, not a web.TCPSite: a drain must stop accepting and
        # nothing more, and TCPSite.stop() of aiohttp 3.8 (Debian 12's) also shuts the open
        # connections down, cutting a request whose body is still on its way.
        assert self._runner.server is not None
        if self._given is not None:  # systemd kept it: connections may be waiting already
            self._listener = await loop.create_server(
                self._doors.protocol(self._runner.server), sock=self._given, backlog=1024)
        else:
            self._listener = await loop.create_server(
                self._doors.protocol(self._runner.server), self.listen[0], self.listen[1],
                reuse_address=True, backlog=1024)
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            self._doors.sweep()
            self.shedding.tick()

    async def _cleanup(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._doors.close_all()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            if self._runner.server is not None:
                await self._runner.server.shutdown(1.0)  # what is still open ends now
            await self._runner.cleanup()
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    # --- steering (from the supervisor's thread) ---------------------------------------------

    def command(self, cmd: FrontCommand) -> None:
        """What the supervisor tells it (steering.py), carried out on the front's own loop, in
        the order sent: Serve (requests go to that engine, held ones are released), Hold
        (requests wait; one that failed on the engine is replayed on the next), Drain (the
        listener closes; a request on an open connection gets a 503), Refuse (no engine will
        come: held requests get their 503 now)."""
        self._call(self._carry_out, cmd)

    async def _carry_out(self, cmd: FrontCommand) -> None:
        if isinstance(cmd, Serve):
            await self._set_engine((cmd.host, cmd.port))
            await self._set_up(cmd.engine)
        elif isinstance(cmd, Hold):
            await self._set_down(cmd.reason)
        elif isinstance(cmd, Drain):
            await self._set_draining()
        elif isinstance(cmd, Refuse):
            await self._set_refusing(cmd.reason)

    @property
    def api_key(self) -> str | None:
        """The key the front checks now (None: none)."""
        return self._key

    def configure(self, limits: Limits, key: str | None) -> None:
        """New limits and API key (a reload): they apply at once, to the requests already
        held too (a shorter hold_timeout ends the holds already past it)."""
        self._call(self._set_limits, limits, key)

    def sample(self) -> FrontSample:
        now = self.clock()
        with self._lock:
            oldest = now - min(self._unanswered.values()) if self._unanswered else 0.0
            at_engine = len(self._answering) + len(self._unanswered) - len(self._large)
            return FrontSample(self._in_flight, self._holding, len(self._unanswered),
                               max(0.0, oldest), self._bytes, self._open, self._draining,
                               self._last_byte, len(self._doors.open),
                               self.shedding.sample(),
                               tuple(sorted((str(k), n) for k, n in self._on_engine.items())),
                               self._gaps.longest(now), at_engine)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(fn(*args)))

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _set_up(self, generation: object) -> None:
        if self._open and generation == self._engine_id:
            return  # DEGRADED -> READY: the same engine
        self._open, self._gen, self._engine_id = True, self._gen + 1, generation
        self._routes[self._gen] = (self.engine, generation)
        for old in [g for g in self._routes if g < self._gen - ROUTES_KEPT]:
            del self._routes[old]
        burst, self._burst = self._burst, None
        with self._lock:  # those still held are released now; the first came first
            first = min(self._held.values(), default=None)
        if burst is not None and first is not None:
            burst.longest_wait = max(burst.longest_wait, self.clock() - first)
        if burst is not None and (burst.held or burst.replayed or burst.stream_errors
                                  or burst.hold_timeouts or burst.failed):
            self.log.info("front_released", after=round(self.clock() - burst.since, 2),
                          reason=burst.reason, held=burst.held, replayed=burst.replayed,
                          hold_timeouts=burst.hold_timeouts,
                          stream_errors=burst.stream_errors, failed=burst.failed,
                          longest_wait=round(burst.longest_wait, 2))
        await self._notify()

    async def _set_engine(self, engine: tuple[str, int]) -> None:
        if engine != self.engine:
            self.log.info("front_engine_moved", engine=_host_port(*engine),
                          was=_host_port(*self.engine))
            self.engine = engine

    async def _set_down(self, reason: str) -> None:
        if self._open:
            self._dead_gen = self._gen
        self._open = False
        if self._burst is None:
            self._burst = Burst(self.clock(), reason)
            self.log.info("front_holding", reason=reason, in_flight=self._in_flight,
                          hold_timeout=self.limits.hold_timeout)
        await self._notify()

    async def _set_draining(self) -> None:
        if self._draining:
            return
        self._draining = True
        self.log.info("front_draining", in_flight=self._in_flight, holding=self._holding)
        await self._notify()
        if self._listener is not None:
            self._listener.close()  # new connections are refused; open ones stay

    async def _set_refusing(self, reason: str) -> None:
        self._refusing = reason
        await self._notify()

    async def _set_limits(self, limits: Limits, key: str | None) -> None:
        self.limits, self._key = limits, key
        self.log.info("front_reconfigured", hold_timeout=limits.hold_timeout,
                      max_connections=limits.max_connections, max_held=limits.max_held,
                      header_timeout=limits.header_timeout,
                      max_body_mib=round(limits.max_body / 2**20, 2),
                      body_budget_mib=round(limits.body_budget / 2**20, 2),
                      api_key=key is not None)
        await self._notify()  # the held recount their deadlines

    # --- the data path -----------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        door = self._doors.busy(request.transport)
        began, status = self.clock(), 0  # 0: no answer (the client left, or a fault of ours)
        try:
            answer = await self._admit(request)
            status = answer.status
            return answer
        finally:
            self._doors.done(door)
            # one line per request, at debug (log.level = "debug" shows it): the client's own
            # address, which vLLM's access lines behind the front never have (issue 31.6)
            self.log.debug("request", client=request.remote, method=request.method,
                           path=request.rel_url.path, status=status,
                           seconds=round(self.clock() - began, 3))

    async def _admit(self, request: web.Request) -> web.StreamResponse:
        """The checks before any work, cheapest first: the target (one decision on the form
        that is forwarded), the key, room to hold; then the body, within its bounds."""
        if self._draining or self._refusing is not None:
            return self._refuse(request)
        route = clientpath.decide(request.method, request.raw_path)
        if isinstance(route, clientpath.Refusal):
            self.shedding.count_rejected(_REJECTED.get(route.status, "bad_request"))
            return _error(route.status, route.message, route.kind, close=True)
        if (self._key is not None and not route.public and request.method != "OPTIONS"
                and not clientpath.authorized(request.headers.get("Authorization"),
                                              self._key)):
            self.shedding.count_rejected("unauthorized")
            return _error(401, "a valid API key is needed: send Authorization: Bearer <key>",
                          "invalid_api_key", close=True)
        if (request.content_length or 0) > self.limits.max_body:
            return self._too_large(self.limits)  # a client's error, said before any wait
        if not self._open and self._holding >= self.limits.max_held:
            return self._shed_held()
        rid = next(self._ids)
        arrived = self.clock()
        with self._lock:
            self._in_flight += 1
            self.totals.requests += 1
        held = [0]  # body bytes counted against the budget, given back at the end
        try:
            body = await self._read_body(request, held)
            if isinstance(body, web.StreamResponse):
                return body
            return await self._forward(request, rid, arrived, body, route.target)
        finally:
            self._body_bytes -= held[0]
            with self._lock:
                self._in_flight -= 1
                self._settle(rid)

    async def _read_body(self, request: web.Request, held: list[int]
                         ) -> bytes | web.StreamResponse:
        """The whole body, counted against front.max_body_mib (413) and, with every other
        body in memory, against front.body_budget_mib (503); a client silent for
        front.header_timeout within it gets 408."""
        lim = self.limits  # the Content-Length past max_body was refused in _admit
        if not self._budget(request.content_length or 0, held):
            return self._shed_budget(lim)
        chunks: list[bytes] = []
        got = 0
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(), lim.header_timeout)
            except asyncio.TimeoutError:
                self.shedding.count_rejected("body_timeout")
                return _error(408, f"the request's body stopped for {lim.header_timeout:g}s "
                                   "(front.header_timeout)", "timeout", close=True)
            if not chunk:
                return b"".join(chunks)
            got += len(chunk)
            if got > lim.max_body:
                return self._too_large(lim)
            if got > held[0] and not self._budget(got - held[0], held):
                return self._shed_budget(lim)
            chunks.append(chunk)

    def _budget(self, n: int, held: list[int]) -> bool:
        if n and self._body_bytes + n > self.limits.body_budget:
            return False
        self._body_bytes += n
        held[0] += n
        return True

    def _too_large(self, lim: Limits) -> web.Response:
        self.shedding.count_rejected("body_too_large")
        return _error(413, f"the request body is larger than {lim.max_body / 2**20:g} MiB "
                           "(front.max_body_mib)", "request_too_large", close=True)

    def _shed_budget(self, lim: Limits) -> web.Response:
        self.shedding.count_shed("body_budget_mib", "front.body_budget_mib",
                                 round(lim.body_budget / 2**20, 2))
        return _error(503, f"qwen4090 holds {lim.body_budget / 2**20:g} MiB of request "
                           "bodies already (front.body_budget_mib); try again later",
                      "overloaded", retry_after=True, close=True)

    def _shed_held(self) -> web.Response:
        lim = self.limits
        self.shedding.count_shed("max_held", "front.max_held", lim.max_held)
        return _error(503, f"no engine is serving and {lim.max_held} requests wait for one "
                           "already (front.max_held); try again later", "overloaded",
                      retry_after=True, close=True)

    def _shed_connection(self, limit: str) -> None:  # Doors: past front.max_connections
        self.shedding.count_shed(limit, f"front.{limit}", self.limits.max_connections)

    def _deadline(self, arrived: float) -> float:
        return arrived + self.limits.hold_timeout  # read each time: a reload reaches holds

    async def _forward(self, request: web.Request, rid: int, arrived: float, body: bytes,
                       target: str) -> web.StreamResponse:
        after = 0  # an engine newer than this one (after a failure: the next engine)
        fresh = False  # the last send's connection failed unanswered: a new one
        attempt = 1
        origin = arrived  # the client's own wait counts from here, replays and all
        while True:
            gen = await self._wait_for_engine(rid, arrived, after, origin)
            if gen is None:
                return self._hold_timeout(request, arrived)
            if gen == HELD_FULL:
                return self._shed_held()
            if gen < 0:
                return self._refuse(request)
            try:
                return await self._send(request, rid, gen, body, target, fresh=fresh)
            except EngineFailed as e:
                with self._lock:
                    self._settle(rid)
                if (isinstance(e, NoAnswer) and self._refusing is None and not
                        await self._engine_declared_dead(gen, REPLAY_GRACE if fresh else 0.0)):
                    # Nobody says this engine died, its connection did: one its server closed
                    # for idling as the request went out, or a connect that timed out on a
                    # machine too busy to answer.  The same engine again on a new connection,
                    # at once the first time, then after a death verdict's grace, as long as
                    # the request may wait (a dead engine's verdict comes within the grace).
                    if self.clock() >= self._deadline(arrived):
                        with self._lock:
                            self.totals.failed += 1
                        return _error(503, f"vLLM could not be reached for "
                                           f"{self.clock() - arrived:.0f}s (front.hold_timeout"
                                           f" = {self.limits.hold_timeout:g}s): {e}",
                                      "engine_unavailable", retry_after=True)
                    fresh, after = True, gen - 1  # this engine (or a newer one)
                    with self._lock:
                        self.totals.retried += 1
                    self.log.debug("front_retry", error=str(e))
                    continue
                fresh = False
                if attempt == 2 or self._refusing is not None:
                    with self._lock:
                        self.totals.failed += 1
                    if self._burst is not None:
                        self._burst.failed += 1
                    return _error(502, f"the engine failed twice before answering: {e}",
                                  "engine_failed")
                with self._lock:
                    self.totals.replayed += 1
                if self._burst is not None:
                    self._burst.replayed += 1
                after, attempt = gen, 2
                arrived = self.clock()  # the replay waits for the next engine afresh

    async def _wait_for_engine(self, rid: int, arrived: float, after: int,
                               origin: float | None = None) -> int | None:
        """The serving engine's generation (newer than ``after``), None past hold_timeout
        from ``arrived``, -1 when requests are refused, HELD_FULL when front.max_held wait
        already.  ``origin``: when the client sent it (a replay's hold starts afresh, but
        the wait front_released reports is the client's, from its arrival: issue 30.6)."""
        origin = arrived if origin is None else origin
        assert self._changed is not None
        if self._open and self._gen > after and self._refusing is None:
            return self._gen
        if self._holding >= self.limits.max_held:
            return HELD_FULL
        with self._lock:
            self._holding += 1
            self._held[rid] = origin
            self.totals.held += 1
        if self._burst is not None:
            self._burst.held += 1
        try:
            async with self._changed:
                while True:
                    if self._refusing is not None or self._draining:
                        return -1
                    if self._open and self._gen > after:
                        return self._gen
                    left = self._deadline(arrived) - self.clock()
                    if left <= 0:
                        return None
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
        finally:
            waited = self.clock() - arrived
            with self._lock:
                self._holding -= 1
                self._held.pop(rid, None)
                t = self.totals
                t.queue_seconds += waited
                for i, bound in enumerate(QUEUE_BUCKETS):  # its own bucket; cumulated in
                    if waited <= bound:                     # _Collector
                        t.queue_buckets[i] += 1
                        break
            if self._burst is not None:
                self._burst.longest_wait = max(self._burst.longest_wait, self.clock() - origin)

    async def _send(self, request: web.Request, rid: int, gen: int, body: bytes, target: str,
                    fresh: bool = False) -> web.StreamResponse:
        """To the engine of generation ``gen``, counted as that engine's until answered."""
        addr, engine = self._routes.get(gen, (self.engine, self._engine_id))
        with self._lock:
            self._on_engine[engine] = self._on_engine.get(engine, 0) + 1
        try:
            return await self._send_to(addr, request, rid, gen, body, target, fresh)
        finally:
            with self._lock:
                left = self._on_engine[engine] - 1
                if left:
                    self._on_engine[engine] = left
                else:
                    del self._on_engine[engine]

    async def _send_to(self, addr: tuple[str, int], request: web.Request, rid: int, gen: int,
                       body: bytes, target: str, fresh: bool) -> web.StreamResponse:
        session = self._fresh if fresh else self._session
        assert session is not None
        # exactly the target decided on (clientpath): encoded=True, so yarl neither
        # re-quotes nor removes dot segments on the way
        url = URL(f"http://{_host_port(*addr)}{target}", encoded=True)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        with self._lock:
            self._unanswered[rid] = self.clock()
            if len(body) > SMALL_BODY:
                self._large.add(rid)
        try:
            upstream = await session.request(request.method, url, headers=headers,
                                             data=body, allow_redirects=False)
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise NoAnswer(_what(e)) from e
        async with upstream:
            if upstream.status >= 500 and await self._engine_declared_dead(gen):
                raise EngineFailed(f"vLLM answered {upstream.status} as its engine died")
            out_headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() not in HOP_BY_HOP}
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, OSError) as e:
                    raise EngineFailed(_what(e)) from e
                self._got(rid, len(data), request.method == "POST")
                return web.Response(status=upstream.status, headers=out_headers, body=data)
            return await self._stream(request, rid, upstream, out_headers)

    async def _stream(self, request: web.Request, rid: int,
                      upstream: aiohttp.ClientResponse, headers: dict[str, str]
                      ) -> web.StreamResponse:
        chunks = upstream.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise EngineFailed("the stream ended before its first byte") from None
        except (aiohttp.ClientError, OSError) as e:
            raise EngineFailed(_what(e)) from e
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        await resp.prepare(request)
        tail = b""
        said = aborted = False  # vLLM's own error event / a request it aborted
        last: float | None = None  # when this answer's previous chunk came in

        async def relay(chunk: bytes) -> None:
            nonlocal tail, said, aborted, last
            now = self._got(rid, len(chunk), request.method == "POST")
            if last is not None:  # one engine's answer: its gaps are its steps
                with self._lock:
                    self._gaps.add(now, now - last)
            last = now
            said = said or STREAM_ERROR in chunk
            aborted = aborted or any(a in chunk for a in ABORTED)
            if aborted and not said and (at := chunk.find(STREAM_DONE)) >= 0:
                # vLLM aborted it at its shutdown (a restart): an error event before [DONE]
                await write(chunk[:at] + _stream_error("the engine was stopped during this "
                                                       "response"))
                said, chunk = True, chunk[at:]
            await write(chunk)
            tail = (tail + chunk)[-64:]

        async def write(data: bytes) -> None:
            try:
                await resp.write(data)
            except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as e:
                raise ClientGone from e

        error = ""
        try:
            await relay(first)
            async for chunk in chunks:
                await relay(chunk)
        except ClientGone:
            return resp  # the client left: vLLM aborts the request when we close ours
        except (aiohttp.ClientError, OSError) as e:
            error = _what(e)
        cut = STREAM_DONE not in tail  # vLLM ends every stream with [DONE], errors too
        if cut or said:
            with self._lock:
                self.totals.stream_errors += 1
            if self._burst is not None:
                self._burst.stream_errors += 1
        if cut:  # the engine went away mid-stream: say so, never a silent cut
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(_stream_error(f"the engine stopped during this response "
                                               f"({error or 'stream cut'})"))
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _engine_declared_dead(self, gen: int, grace: float | None = None) -> bool:
        """A failure on ``gen``: is that engine being restarted (now or within ``grace``,
        REPLAY_GRACE unless given)?"""
        assert self._changed is not None
        deadline = self.clock() + (REPLAY_GRACE if grace is None else grace)
        async with self._changed:
            while self._dead_gen < gen and self._refusing is None:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
        return self._dead_gen >= gen

    def _got(self, rid: int, n: int, progress: bool) -> float:
        now = self.clock()
        with self._lock:
            if progress:
                self._bytes += n
                self._last_byte = now
            self._unanswered.pop(rid, None)
            self._large.discard(rid)
            self._answering.add(rid)
        return now

    def _settle(self, rid: int) -> None:
        """``rid`` is answered in full, or its engine failed (it may be sent again): it is no
        longer the engine's (under self._lock)."""
        self._unanswered.pop(rid, None)
        self._large.discard(rid)
        self._answering.discard(rid)

    def _hold_timeout(self, request: web.Request, arrived: float) -> web.Response:
        with self._lock:
            self.totals.hold_timeouts += 1
        if self._burst is not None:
            self._burst.hold_timeouts += 1
        waited = self.clock() - arrived
        return _error(503, f"no engine is serving: waited {waited:.0f}s (front.hold_timeout "
                           f"= {self.limits.hold_timeout:g}s); qwen4090 is restarting vLLM",
                      "engine_unavailable", retry_after=True)

    def _refuse(self, request: web.Request) -> web.Response:
        with self._lock:
            self.totals.refused += 1
        why = "qwen4090 is stopping" if self._draining else \
            f"qwen4090 gave up: {self._refusing}"
        resp = _error(503, why, "unavailable", retry_after=True)
        resp.force_close()
        return resp

    # --- telling -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """/status: the front's counts (httpapi.StatusSource)."""
        s = self.sample()
        lim = self.limits
        shed, rejected = self.shedding.copy()
        with self._lock:
            t = self.totals
            return {"front": {
                "listen": _host_port(*self.listen), "engine": _host_port(*self.engine),
                "open": s.open, "draining": s.draining, "in_flight": s.in_flight,
                "holding": s.holding, "unanswered": s.unanswered,
                "by_engine": dict(s.by_engine),
                "oldest_unanswered_seconds": round(s.oldest_unanswered, 2),
                "requests": t.requests, "held": t.held, "replayed": t.replayed,
                "retried": t.retried,
                "hold_timeouts": t.hold_timeouts, "refused": t.refused,
                "stream_errors": t.stream_errors, "failed": t.failed,
                "queue_seconds": round(t.queue_seconds, 3),
                "hold_timeout": lim.hold_timeout,
                "connections": s.connections, "body_bytes": self._body_bytes,
                "limits": {"max_connections": lim.max_connections, "max_held": lim.max_held,
                           "header_timeout": lim.header_timeout,
                           "max_body_mib": round(lim.max_body / 2**20, 2),
                           "body_budget_mib": round(lim.body_budget / 2**20, 2),
                           "fd_limit": lim.fd_limit},
                "shed": shed, "rejected": rejected, "shedding": s.shedding,
                "api_key": self._key is not None}}

    def register(self, registry: Any) -> None:
        """/metrics: the front's families (httpapi.StatusSource)."""
        registry.register(_Collector(self))


class _Collector:
    def __init__(self, front: Front) -> None:
        self.front = front

    def collect(self) -> Any:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        f = self.front
        s = f.sample()
        with f._lock:
            t = f.totals.copy()
        yield GaugeMetricFamily("qwen4090_front_in_flight",
                                "client requests in flight through the front", value=s.in_flight)
        yield GaugeMetricFamily("qwen4090_front_holding",
                                "client requests waiting for an engine now", value=s.holding)
        yield GaugeMetricFamily("qwen4090_front_unanswered",
                                "requests sent to vLLM with no byte of the answer back yet",
                                value=s.unanswered)
        yield GaugeMetricFamily("qwen4090_front_oldest_unanswered_seconds",
                                "how long the oldest of those has waited",
                                value=s.oldest_unanswered)
        yield GaugeMetricFamily("qwen4090_front_open", "1 while an engine takes requests",
                                value=1.0 if s.open else 0.0)
        for name, value, help_ in (
                ("requests", t.requests, "client requests taken"),
                ("held", t.held, "requests that waited for an engine"),
                ("replayed", t.replayed, "requests sent again after their engine failed "
                                         "before answering"),
                ("retried", t.retried, "sends again to the same engine, on a new connection: "
                                       "the last failed before any answer"),
                ("hold_timeouts", t.hold_timeouts, "503s: no engine within hold_timeout"),
                ("refused", t.refused, "503s: stopping, or the daemon gave up"),
                ("stream_errors", t.stream_errors, "started streams ended with an error event "
                                                   "because their engine stopped"),
                ("failed", t.failed, "requests answered with an error after the replay "
                                     "failed too")):
            yield CounterMetricFamily(f"qwen4090_front_{name}", help_, value=value)
        yield GaugeMetricFamily("qwen4090_front_connections", "client connections open",
                                value=s.connections)
        yield GaugeMetricFamily("qwen4090_front_body_bytes",
                                "request bodies held in memory now, all clients together",
                                value=f._body_bytes)
        lim = f.limits
        limit = GaugeMetricFamily("qwen4090_front_limit", "the front's limits in force "
                                  "([front]; max_connections within the file limit)",
                                  labels=["limit"])
        values: tuple[tuple[str, float], ...] = (
            ("max_connections", lim.max_connections), ("max_held", lim.max_held),
            ("header_timeout", lim.header_timeout), ("max_body_bytes", lim.max_body),
            ("body_budget_bytes", lim.body_budget))
        for name, amount in values:
            limit.add_metric([name], amount)
        yield limit
        shed, rejected = f.shedding.copy()
        family = CounterMetricFamily("qwen4090_front_shed", "503s because a [front] limit "
                                     "was reached, by the limit's key", labels=["limit"])
        for name in ("max_connections", "max_held", "body_budget_mib"):
            family.add_metric([name], shed.get(name, 0))
        yield family
        family = CounterMetricFamily("qwen4090_front_rejected", "requests refused as bad "
                                     "(4xx): a target not served or malformed, a method, no "
                                     "or a wrong API key, a body too large, too slow a client",
                                     labels=["reason"])
        for name in ("bad_target", "not_served", "method", "unauthorized", "body_too_large",
                     "head_too_large", "header_timeout", "body_timeout"):
            family.add_metric([name], rejected.get(name, 0))
        yield family
        buckets, running = [], 0
        for bound, n in zip(QUEUE_BUCKETS, t.queue_buckets, strict=True):
            running += n
            buckets.append(("+Inf" if math.isinf(bound) else f"{bound:g}", running))
        yield HistogramMetricFamily("qwen4090_front_queue_seconds",
                                    "time held requests waited for an engine",
                                    buckets=buckets, sum_value=t.queue_seconds)


def _stream_error(what: str) -> bytes:
    """The OpenAI-style error event that ends a stream whose engine stopped."""
    event = {"error": {"message": f"{what}; qwen4090 is restarting it: send the request "
                                  "again", "type": "engine_restarted", "param": None,
                       "code": 503}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _error(status: int, message: str, kind: str, retry_after: bool = False,
           close: bool = False) -> web.Response:
    """An OpenAI-style error answer; ``close``: the connection ends after it (its request's
    body may be unread)."""
    headers = {"Retry-After": str(RETRY_AFTER)} if retry_after else {}
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    resp = web.json_response(body, status=status, headers=headers)
    if close:
        resp.force_close()
    return resp


# clientpath's refusals by status, as counted in qwen4090_front_rejected_total{reason}
_REJECTED = {400: "bad_target", 404: "not_served", 405: "method"}


def _what(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().rstrip(":")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """The front alone, its engine always up (for benchmarks)."""
    from qwen4090.base import logs

    p = argparse.ArgumentParser(prog="python -m qwen4090.engine.front", description=main.__doc__)
    p.add_argument("--listen", type=_addr, required=True, help="HOST:PORT clients use")
    p.add_argument("--engine", type=_addr, required=True, help="HOST:PORT of vLLM")
    p.add_argument("--hold-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    logs.setup("keyvalue", "info")
    front = Front(args.listen, args.engine, Limits(hold_timeout=args.hold_timeout),
                  logs.get_logger(), engine_up=True)
    front.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        front.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
