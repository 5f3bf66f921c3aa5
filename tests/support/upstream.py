"""A scripted stand-in vLLM on loopback and the front in front of it, for the front's unit tests
(tests/unit/test_front.py, test_front_edge.py): a fast proof of the data path's rules; the
proof with the real vLLM is tests/integration/."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from qwen4090.engine.front import Front
from qwen4090.engine.frontlimits import Limits
from tests.support.fakes import Log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


class Upstream:
    """A stand-in vLLM on loopback: ``mode`` says what the next completion request gets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.mode = "ok"  # ok | die (close before answering) | cut (2 chunks, then close)
        #                   | 500 | slow (stream 1 chunk per 0.1 s, 10 of them) | stuck
        #                   | die-once (die, then ok) | hang-die (no byte for 1 s, then
        #                   closed: a hung engine, killed)
        self.seen: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, auto_decompress=False)  # bodies as the front sent them
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            doc = {}
        self.seen.append({"path": request.path, "raw": request.raw_path, "raw_body": body,
                          "auth": request.headers.get("Authorization"),
                          "body": doc, "peer": request.transport.get_extra_info("peername")
                          if request.transport is not None else None})
        mode = self.mode
        if mode == "die-once":
            mode, self.mode = "die", "ok"
        if mode == "hang-die":
            await asyncio.sleep(1.0)
            mode = "die"
        if mode == "die":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response(status=200)
        if mode == "stuck":  # a wedged engine: no byte back
            await asyncio.sleep(30)
        if mode == "500":
            return web.json_response({"error": {"message": "EngineDeadError"}}, status=500)
        if not doc.get("stream"):
            return web.json_response({"choices": [{"text": "hello"}], "n": len(self.seen)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 10 if mode == "slow" else 3
        if mode == "abort":  # vLLM's shutdown aborts it: a last chunk, then [DONE]
            await resp.write(b'data: {"choices": [{"text": "t0"}]}\n\n')
            await resp.write(b'data: {"choices":[{"text":"","finish_reason":"abort"}]}\n\n'
                             b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        for i in range(n):
            await resp.write(f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode())
            if mode == "slow":
                await asyncio.sleep(0.1)
            if mode == "cut" and i == 1:
                assert request.transport is not None
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.close()


def make_front(upstream: Upstream, up: bool = True, hold: float = 5.0, **limits: Any) -> Front:
    f = Front(("127.0.0.1", free_port()), ("127.0.0.1", upstream.port),
              Limits(hold_timeout=hold, **limits), Log(), engine_up=up)
    f.start()
    return f


def request(port: int, stream: bool = False, timeout: float = 20.0,
            body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            body or {"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": stream}),
            headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class Later(threading.Thread):
    """A request on a thread of its own; ``result`` once it returns."""

    def __init__(self, port: int, stream: bool = False, body: dict[str, Any] | None = None
                 ) -> None:
        super().__init__(daemon=True)
        self.port, self.stream, self.body = port, stream, body
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = request(self.port, self.stream, body=self.body)
        except BaseException as e:
            self.error = e

    def get(self, timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
        self.join(timeout)
        assert self.error is None, self.error
        assert self.result is not None, "no answer"
        return self.result
