#!/usr/bin/env python3
"""HAProxy 2.6 (Debian 12's package) as qwen4090's front: the spike of issue 20, measured.

Starts its own CPU vLLM (the tiny model of scripts/setup-runtime.sh) and HAProxy on 127.0.0.1
with a config rendered here and a runtime-API UNIX socket in a temporary directory, then runs
the experiments named by --only (default: all) and prints what a client and the runtime API
saw. Findings: docs/front-spike.md.

    python3 bench/front_spike/haproxy_spike.py [--only stream,hold,replay,counts,cost]
        [--front-python PYTHON] [--json out.json]
    python3 bench/front_spike/haproxy_spike.py --print-cfg LISTEN_PORT ENGINE_PORT DIR

Experiments (issue 20 items):
  stream  SSE through HAProxy with and without 'option http-no-delay': events per recv()
  hold    (2) server in MAINT; the same with the Lua hold (hold.lua); engine port closed
          with 'retries' (1 s turn-around each)
  replay  (3) SIGKILL of vLLM's process group during a non-streaming request (small body,
          body above tune.bufsize, server set MAINT during the restart) and during a stream
  counts  (4, 5, 7) in-flight counts from 'show stat' and 'show sess', the age of the oldest
          request without a response byte from 'show sess all', retry/error counters
  cost    (8) bench/front_cost.py: direct vs HAProxy (vs qwen4090.engine.front with --front-python)

Everything it starts runs in its own process group and is killed on the way out; every wait
has a deadline. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RUNTIME = ROOT / ".runtime"
MODEL = "tiny"
OBSERVED: dict[str, Any] = {}


def say(key: str, text: str, **figures: Any) -> None:
    """One observation: printed, and kept for --json."""
    print(f"[{key}] {text}" + "".join(f" {k}={v}" for k, v in figures.items()), flush=True)
    OBSERVED.setdefault(key, []).append({"text": text, **figures})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """TERM the process group, KILL it after ``grace``; returns once the group is empty."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    if not wait_for(lambda: proc.poll() is not None and not group_alive(proc.pid), grace):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        wait_for(lambda: proc.poll() is not None and not group_alive(proc.pid), 10)


# --- vLLM ----------------------------------------------------------------------------------

class Vllm:
    """The CPU vLLM with the tiny model on a fixed port; restartable on the same port."""

    def __init__(self, python: Path, model: Path, port: int, logdir: Path) -> None:
        self.python, self.model, self.port, self.logdir = python, model, port, logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> float:
        """Launch; returns the monotonic launch time."""
        self.starts += 1
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1")
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", MODEL,
                "--load-format", "dummy", "--enforce-eager", "--dtype", "float32",
                "--max-model-len", "2048", "--max-num-seqs", "32",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--disable-uvicorn-access-log"]
        log = open(self.logdir / f"vllm-{self.starts}.log", "wb")  # noqa: SIM115 (child's)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return t0

    def serving(self) -> bool:
        try:
            return get(self.port, "/v1/models", 2.0)[0] == 200
        except OSError:
            return False

    def wait_serving(self, timeout: float = 240.0) -> float:
        if not wait_for(self.serving, timeout, 0.2):
            raise RuntimeError(f"vLLM not serving on {self.port} after {timeout:.0f} s; "
                               f"log in {self.logdir}")
        return time.monotonic()

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would end it; wait until it is gone."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        wait_for(lambda: self.proc is not None and self.proc.poll() is not None
                 and not group_alive(self.proc.pid), 20)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 20)


# --- HAProxy -------------------------------------------------------------------------------

@dataclass(frozen=True)
class HaConf:
    """What varies between the experiments' configs."""

    no_delay: bool = True           # option http-no-delay
    lua_hold_ms: int = 0            # 0: no Lua hold
    retries: int = 3
    retry_on: str = "conn-failure empty-response response-timeout"
    buffer_request: bool = True     # option http-buffer-request
    engine_port: int | None = None  # None: the vLLM's port
    nbthread: int = 1


def render_cfg(d: Path, listen: int, engine: int, c: HaConf) -> str:
    """The haproxy.cfg qwen4090 would render from its TOML (plus the knobs under test)."""
    lua = f"    lua-load {HERE / 'hold.lua'}\n" if c.lua_hold_ms else ""
    hold = (f"    http-request lua.hold vllm engine {c.lua_hold_ms} 5\n"
            if c.lua_hold_ms else "")
    return f"""global
    stats socket {d}/admin.sock mode 600 level admin
    nbthread {c.nbthread}
    log stdout format raw local0
{lua}defaults
    mode http
    log global
    option httplog
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout queue 10s
    retries {c.retries}
    retry-on {c.retry_on}
{'    option http-buffer-request' if c.buffer_request else ''}
{'    option http-no-delay' if c.no_delay else ''}
    http-error status 503 content-type application/json hdr retry-after 5 string '{{"error":{{"message":"no engine","type":"service_unavailable","code":503}}}}'
frontend fe
    bind 127.0.0.1:{listen}
{hold}    default_backend vllm
backend vllm
    server engine 127.0.0.1:{engine}
"""  # noqa: E501 (the http-error line is one HAProxy directive)


# what qwen4090 would run: SSE unbuffered, new requests held up to 120 s while the server is
# in MAINT, a request replayed while the engine port refuses for up to 120 s
COST_CONF = HaConf(lua_hold_ms=120000, retries=120)


class Haproxy:
    def __init__(self, workdir: Path, engine_port: int, conf: HaConf) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="haproxy-", dir=workdir))
        self.port = free_port()
        self.conf = conf
        self.cfg = self.dir / "haproxy.cfg"
        self.cfg.write_text(render_cfg(self.dir, self.port, conf.engine_port or engine_port,
                                       conf))
        self.log = self.dir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Haproxy:
        check = subprocess.run(["haproxy", "-c", "-q", "-f", str(self.cfg)],
                               capture_output=True, timeout=30)
        if check.returncode:
            raise RuntimeError(f"haproxy -c: {check.stderr.decode()}")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.cfg)],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        if not wait_for(lambda: (self.dir / "admin.sock").exists(), 10):
            raise RuntimeError(f"haproxy did not start: {self.log.read_text()}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_group(self.proc, 5)

    def api(self, command: str, timeout: float = 5.0) -> str:
        """One command over the runtime API's UNIX socket (non-interactive: it closes)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(self.dir / "admin.sock"))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
        return b"".join(chunks).decode()

    def stat(self, proxy: str, name: str) -> dict[str, str]:
        lines = self.api("show stat").splitlines()
        head = lines[0].lstrip("# ").split(",")
        for ln in lines[1:]:
            row = dict(zip(head, ln.split(","), strict=False))
            if row.get("pxname") == proxy and row.get("svname") == name:
                return row
        raise KeyError(f"{proxy}/{name} not in show stat")

    def log_lines(self, pattern: str) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines()
                if pattern in ln]


# --- clients -------------------------------------------------------------------------------

def get(port: int, path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@dataclass
class Answer:
    status: int | None
    elapsed: float
    headers: dict[str, str]
    body: bytes
    error: str = ""


def complete(port: int, max_tokens: int, *, stream: bool = False, timeout: float = 300.0,
             pad: int = 0, prompt: list[int] | None = None) -> Answer:
    """A /v1/completions request; ``pad`` bytes of padding (the "user" field) enlarge the body
    without changing the work."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt or [5, 6, 7, 8],
                            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if pad:
        body["user"] = "x" * pad
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return Answer(r.status, time.monotonic() - t0, {k.lower(): v for k, v in r.getheaders()},
                      data)
    except (OSError, http.client.HTTPException) as e:
        return Answer(None, time.monotonic() - t0, {}, b"", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def raw_stream(port: int, max_tokens: int, on_event: Callable[[int], None] | None = None,
               timeout: float = 120.0) -> dict[str, Any]:
    """A streaming request on a raw socket: what bytes came, in how many recv() calls, and
    how the stream ended (the chunked terminator, [DONE], an error event, or a cut)."""
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10, 11, 12],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: spike\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    s.sendall(req)
    recvs: list[tuple[float, int]] = []     # (ms since send, SSE events in this recv)
    raw, events, end = b"", 0, "timeout"
    try:
        while True:
            data = s.recv(65536)
            if not data:
                end = "closed"
                break
            raw += data
            n = data.count(b"data:")
            recvs.append(((time.perf_counter() - t0) * 1000, n))
            events += n
            if on_event and n:
                on_event(events)
            if raw.endswith(b"0\r\n\r\n"):
                end = "chunked terminator"
                break
    except ConnectionResetError:
        end = "reset"
    except TimeoutError:
        end = "timeout"
    finally:
        s.close()
    return {"recvs": recvs, "events": events, "end": end, "done": b"[DONE]" in raw,
            "error_event": re.search(rb'data: ?\{"error"', raw) is not None,
            "tail": raw[-80:].decode(errors="replace")}


def in_thread(fn: Callable[[], Answer]) -> tuple[threading.Thread, list[Answer]]:
    out: list[Answer] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    return th, out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


# --- the experiments -----------------------------------------------------------------------

class TickingSse:
    """A stand-in engine for the stream experiment: each request gets ``events`` SSE events,
    one every ``interval`` s, each carrying its send time (``perf_counter``, this process), in
    HTTP/1.1 chunked encoding as vLLM sends them. The CPU vLLM cannot serve here: the tiny
    model makes tokens faster than its API server writes them, so they leave it in bursts."""

    def __init__(self, events: int = 20, interval: float = 0.01) -> None:
        self.events, self.interval = events, interval
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn, contextlib.suppress(OSError):
            f = conn.makefile("rb")
            while True:                      # keep-alive: one request after another
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if not line:
                    return
                f.read(length)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(self.events):
                    time.sleep(self.interval)
                    ev = b"data: %s\n\n" % json.dumps(
                        {"i": i, "t": time.perf_counter(), "choices": [{"text": "x"}]}).encode()
                    conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                done = b"data: [DONE]\n\n"
                conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def close(self) -> None:
        self.sock.close()


def event_lags(port: int) -> tuple[list[float], int, int]:
    """One stream: per event, ms from its send to its arrival; recv() calls; events."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: spike\r\nContent-Length: 2\r\n\r\n{}")
    lags: list[float] = []
    recvs, buf = 0, b""
    with s:
        while not buf.endswith(b"0\r\n\r\n"):
            data = s.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            recvs += 1
            buf += data
            events = [json.loads(m.group(1)) for m in re.finditer(rb"data: (\{.*?\})\n", data)]
            if any("t" not in e for e in events):
                raise RuntimeError(f"an event not sent by the engine: {data[:200]!r}")
            lags += [(now - e["t"]) * 1000 for e in events]
    return lags, recvs, len(lags)


def exp_stream(vllm: Vllm, work: Path, front_python: Path | None) -> None:
    """SSE through HAProxy (and the front): does each event reach the client when the engine
    sends it, and what does passing 32 streams cost?"""
    engine = TickingSse()
    paths: list[tuple[str, HaConf | None]] = [
        ("direct", None), ("haproxy default", HaConf(no_delay=False)),
        ("haproxy option http-no-delay", HaConf(no_delay=True))]
    if front_python is not None:
        paths.append(("qwen4090.engine.front", None))
    try:
        for name, conf in paths:
            with contextlib.ExitStack() as stack:
                port, pid = engine.port, None
                if conf is not None:
                    ha = stack.enter_context(Haproxy(work, engine.port, conf))
                    port, pid = ha.port, ha.proc.pid if ha.proc else None
                elif front_python is not None and name == "qwen4090.engine.front":
                    port, pid = stack.enter_context(
                        running_front(front_python, engine.port, work))
                runs = [event_lags(port) for _ in range(10)]
                lags = sorted(x for r in runs for x in r[0])
                say("stream", f"{name}: 10 streams of 20 events 10 ms apart, lag send->arrival",
                    events=sum(r[2] for r in runs), recvs=sum(r[1] for r in runs),
                    lag_p50_ms=round(lags[len(lags) // 2], 2),
                    lag_p99_ms=round(lags[int(len(lags) * 0.99)], 2),
                    lag_max_ms=round(lags[-1], 2))
                if name == "haproxy default":
                    continue
                # 32 streams at once, 100 events/s each: about vLLM's c=32 token rate
                engine.events = 200
                results: list[tuple[list[float], int, int]] = []
                cpu0 = proc_cpu(pid) if pid else 0.0
                t0 = time.monotonic()
                threads = [threading.Thread(target=_collect_lags, args=(port, results),
                                            daemon=True) for _ in range(32)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join(60)
                wall = time.monotonic() - t0
                engine.events = 20
                lags = sorted(x for r in results for x in r[0])
                events = sum(r[2] for r in results)
                say("stream", f"{name}: 32 streams at once, 200 events each",
                    events=events, events_per_s=round(events / wall),
                    lag_p50_ms=round(lags[len(lags) // 2], 2),
                    lag_p99_ms=round(lags[int(len(lags) * 0.99)], 2),
                    proxy_cores=round((proc_cpu(pid) - cpu0) / wall, 3) if pid else None)
    finally:
        engine.close()


def _collect_lags(port: int, out: list[tuple[list[float], int, int]]) -> None:
    out.append(event_lags(port))


def proc_cpu(pid: int) -> float:
    """utime+stime of one process, all its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exp_hold(vllm: Vllm, work: Path) -> None:
    """Item 2: what a client sees while the server is down, and how to hold it."""
    with Haproxy(work, vllm.port, HaConf()) as ha:
        ha.api("set server vllm/engine state maint")
        a = complete(ha.port, 4)
        say("hold", "plain config, server MAINT (runtime API): answer", status=a.status,
            elapsed_s=round(a.elapsed, 3), retry_after=a.headers.get("retry-after"))
        ha.api("set server vllm/engine state ready")
    with Haproxy(work, vllm.port, HaConf(lua_hold_ms=6000)) as ha:
        ha.api("set server vllm/engine state maint")
        a = complete(ha.port, 4)
        say("hold", "Lua hold 6000 ms (above tune.lua.session-timeout 4 s), server stays "
            "MAINT: answer", status=a.status,
            elapsed_s=round(a.elapsed, 3), retry_after=a.headers.get("retry-after"),
            body=a.body.decode()[:80])
        th, out = in_thread(lambda: complete(ha.port, 4))
        time.sleep(1.5)
        t_ready = time.monotonic()
        ha.api("set server vllm/engine state ready")
        th.join(30)
        say("hold", "Lua hold 6000 ms, server READY after 1.5 s: answer", status=out[0].status,
            elapsed_s=round(out[0].elapsed, 3),
            after_ready_ms=round((time.monotonic() - t_ready) * 1000, 1))
        # many held at once: does the hold scale, and does HAProxy's own counter see them?
        ha.api("set server vllm/engine state maint")
        many = [in_thread(lambda: complete(ha.port, 4)) for _ in range(32)]
        time.sleep(1.0)
        fe = ha.stat("fe", "FRONTEND")
        be = ha.stat("vllm", "BACKEND")
        ha.api("set server vllm/engine state ready")
        for th, _ in many:
            th.join(60)
        statuses = sorted({str(o[0].status) for _, o in many if o})
        say("hold", "32 held at once (MAINT 1 s, then READY)", statuses=",".join(statuses),
            fe_scur_while_held=fe["scur"], be_qcur_while_held=be["qcur"],
            be_scur_while_held=be["scur"], lua=ha.api("show front").strip())
    closed = free_port()
    for retries in (0, 5):
        with Haproxy(work, vllm.port, HaConf(retries=retries, engine_port=closed)) as ha:
            a = complete(ha.port, 4)
            srv = ha.stat("vllm", "engine")
            say("hold", f"engine port closed (refused), server left UP, retries {retries}",
                status=a.status, elapsed_s=round(a.elapsed, 3),
                retry_after=a.headers.get("retry-after"), wretr=srv["wretr"],
                econ=srv["econ"])


def exp_replay(vllm: Vllm, work: Path) -> None:
    """Item 3: the engine dies before (non-streaming) or after (stream) the first byte."""
    conf = HaConf(retries=120)
    cases = [("non-streaming, small body", 0, False),
             ("non-streaming, body 20 kB (> tune.bufsize 16384)", 20000, False),
             ("non-streaming, server set MAINT during the restart", 0, True)]
    for name, pad, maint in cases:
        with Haproxy(work, vllm.port, conf) as ha:
            th, out = in_thread(functools.partial(complete, ha.port, 1900, pad=pad))
            time.sleep(0.7)
            t_kill = time.monotonic()
            vllm.kill()
            if maint:
                ha.api("set server vllm/engine state maint")
            vllm.start()
            t_up = vllm.wait_serving()
            if maint:
                ha.api("set server vllm/engine state ready")
            th.join(300)
            a = out[0]
            srv = ha.stat("vllm", "engine")
            logs = ha.log_lines("/v1/completions")
            say("replay", f"SIGKILL of vLLM 0.7 s into a request ({name}), vLLM restarted",
                status=a.status, client_elapsed_s=round(a.elapsed, 1),
                engine_back_after_s=round(t_up - t_kill, 1),
                tokens=(json.loads(a.body)["usage"]["completion_tokens"]
                        if a.status == 200 else None),
                wretr=srv["wretr"], eresp=srv["eresp"], econ=srv["econ"],
                log=logs[-1].split(" fe ", 1)[-1] if logs else "")
    # a started stream
    with Haproxy(work, vllm.port, conf) as ha:
        killed = threading.Event()

        def kill_at(events: int) -> None:
            if events >= 5 and not killed.is_set():
                killed.set()
                vllm.kill()

        r = raw_stream(ha.port, 1900, kill_at)
        say("replay", "SIGKILL of vLLM after 5 SSE events of a stream: the client's end",
            end=r["end"], events=r["events"], done=r["done"], error_event=r["error_event"],
            tail=repr(r["tail"][-40:]))
        vllm.start()
        vllm.wait_serving()
    # the same without HAProxy, for comparison
    killed.clear()
    r = raw_stream(vllm.port, 1900, kill_at)
    say("replay", "the same stream straight from vLLM (no proxy)", end=r["end"],
        events=r["events"], done=r["done"], error_event=r["error_event"])
    vllm.start()
    vllm.wait_serving()


SESS_HEAD = re.compile(r"^(0x[0-9a-f]+): \[(\d\d/\w{3}/\d{4}:\d\d:\d\d:\d\d\.\d+)\] id=(\d+)"
                       r" proto=(\S+)")
RES_TOTAL = re.compile(r"^\s+res=0x[0-9a-f]+ \(.*total=(\d+)\)")
SESS_SERVER = re.compile(r"^\s+server=(\S+) ")
REQ_TOTAL = re.compile(r"^\s+req=0x[0-9a-f]+ \(.*total=(\d+)\)")


def parse_sessions(text: str) -> list[dict[str, Any]]:
    """``show sess all``: per client stream, its accept time and the bytes each way."""
    out: list[dict[str, Any]] = []
    for ln in text.splitlines():
        if m := SESS_HEAD.match(ln):
            accepted = datetime.strptime(m.group(2), "%d/%b/%Y:%H:%M:%S.%f")
            out.append({"id": int(m.group(3)), "proto": m.group(4), "accepted": accepted,
                        "server": None, "req_total": None, "res_total": None})
        elif out and (m := SESS_SERVER.match(ln)):
            out[-1]["server"] = m.group(1)
        elif out and (m := RES_TOTAL.match(ln)):
            out[-1]["res_total"] = int(m.group(1))
        elif out and (m := REQ_TOTAL.match(ln)):
            out[-1]["req_total"] = int(m.group(1))
    return [s for s in out if s["proto"].startswith("tcp")]


def exp_counts(vllm: Vllm, work: Path) -> None:
    """Items 4, 5, 7: exact in-flight counts, the oldest request without a byte, counters."""
    with Haproxy(work, vllm.port, HaConf()) as ha:
        t_first = time.monotonic()
        plain = [in_thread(lambda: complete(ha.port, 1900)) for _ in range(3)]
        time.sleep(0.3)
        streams: list[threading.Thread] = []
        for _ in range(2):
            th = threading.Thread(target=raw_stream, args=(ha.port, 1900), daemon=True)
            th.start()
            streams.append(th)
        time.sleep(1.0)
        t_api = time.monotonic()
        fe, be, srv = (ha.stat("fe", "FRONTEND"), ha.stat("vllm", "BACKEND"),
                       ha.stat("vllm", "engine"))
        sess = ha.api("show sess")
        detail = ha.api("show sess all")
        api_ms = (time.monotonic() - t_api) * 1000
        now = datetime.now()
        streams_ = parse_sessions(detail)
        truth_age = time.monotonic() - t_first
        # sent to the engine (a server assigned: not held) and no byte of the answer back yet
        silent = [s for s in streams_ if s["res_total"] == 0 and s["server"] != "<NONE>"]
        oldest = max(((now - s["accepted"]).total_seconds() for s in silent), default=None)
        metrics = get(vllm.port, "/metrics", 5)[1].decode()
        running = next((ln.split()[-1] for ln in metrics.splitlines()
                        if ln.startswith("vllm:num_requests_running")), "?")
        say("counts", "truth: 5 requests in flight (3 non-streaming, no byte yet; 2 streams)",
            fe_scur=fe["scur"], be_scur=be["scur"], srv_scur=srv["scur"], be_qcur=be["qcur"],
            show_sess_client_streams=sum(1 for ln in sess.splitlines() if "proto=tcpv4" in ln),
            streams_without_response_byte=len(silent),
            oldest_without_byte_s=None if oldest is None else round(oldest, 2),
            client_side_age_s=round(truth_age, 2),
            vllm_num_requests_running=running, api_ms=round(api_ms, 1))
        for th, _ in plain:
            th.join(120)
        for th in streams:
            th.join(120)
        srv = ha.stat("vllm", "engine")
        fields = ["stot", "wretr", "wredis", "econ", "eresp", "hrsp_2xx", "hrsp_5xx", "cli_abrt",
                  "srv_abrt", "qtime", "rtime", "ttime"]
        say("counts", "server counters after they finished", **{k: srv.get(k) for k in fields})


def exp_cost(vllm: Vllm, work: Path, front_python: Path | None, bench_args: list[str]) -> None:
    """Item 8: bench/front_cost.py, direct vs HAProxy (vs qwen4090.engine.front) in one run."""
    with contextlib.ExitStack() as stack:
        ha = stack.enter_context(Haproxy(work, vllm.port, COST_CONF))
        assert ha.proc is not None
        proxies = ["--proxy", "haproxy", f"http://127.0.0.1:{ha.port}", str(ha.proc.pid)]
        if front_python is not None:
            port, pid = stack.enter_context(running_front(front_python, vllm.port, work))
            proxies += ["--proxy", "front", f"http://127.0.0.1:{port}", str(pid)]
        out = work / "front-cost.json"
        argv = [sys.executable, str(ROOT / "bench" / "front_cost.py"),
                "--engine", f"http://127.0.0.1:{vllm.port}", "--model", MODEL, *proxies,
                "--out", str(out), *bench_args]
        print("$ " + " ".join(argv), flush=True)
        rc = subprocess.run(argv, timeout=3600).returncode
        say("cost", "bench/front_cost.py", rc=rc, json=str(out))
        with contextlib.suppress(OSError):
            OBSERVED["cost_result"] = json.loads(out.read_text())


@contextlib.contextmanager
def running_front(python: Path, engine_port: int, work: Path) -> Iterator[tuple[int, int]]:
    """``python -m qwen4090.engine.front`` alone in front of ``engine_port``: (its port, its
    pid)."""
    port = free_port()
    log = open(work / "front.log", "ab")  # noqa: SIM115 (the child's)
    front = subprocess.Popen(
        [str(python), "-m", "qwen4090.engine.front", "--listen", f"127.0.0.1:{port}",
         "--engine", f"127.0.0.1:{engine_port}"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT / "daemon"), *filter(None, [os.environ.get("PYTHONPATH")])])),
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    log.close()
    try:
        if not wait_for(lambda: _listening(port), 30, 0.1):
            raise RuntimeError(f"qwen4090.engine.front did not listen: {work / 'front.log'}")
        yield port, front.pid
    finally:
        stop_group(front, 5)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


EXPERIMENTS = ("stream", "hold", "replay", "counts", "cost")


@contextlib.contextmanager
def running_vllm(a: argparse.Namespace, work: Path) -> Iterator[Vllm]:
    vllm = Vllm(a.vllm_python, a.model, free_port(), work)
    try:
        t0 = vllm.start()
        say("setup", "vLLM serving", after_s=round(vllm.wait_serving() - t0, 1), port=vllm.port)
        yield vllm
    finally:
        vllm.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", default=",".join(EXPERIMENTS),
                    help=f"comma-separated, of: {', '.join(EXPERIMENTS)}")
    ap.add_argument("--vllm-python", type=Path, default=RUNTIME / "venv" / "bin" / "python")
    ap.add_argument("--model", type=Path, default=RUNTIME / "tiny-model")
    ap.add_argument("--front-python", type=Path,
                    help="a python with aiohttp and structlog: also bench 'python -m "
                    "qwen4090.engine.front' (daemon/ and $PYTHONPATH on its path)")
    ap.add_argument("--bench-args", default="--concurrency 1 32 --requests 32 128 --rounds 4 "
                    "--prompt-len 256 --max-tokens 64", help="passed to bench/front_cost.py")
    ap.add_argument("--json", type=Path, help="write the observations here")
    ap.add_argument("--print-cfg", nargs=3, metavar=("LISTEN_PORT", "ENGINE_PORT", "DIR"),
                    help="only print the haproxy.cfg the cost run uses (http-no-delay, the Lua "
                    "hold, retries 120; runtime API at DIR/admin.sock), e.g. for another "
                    "machine: haproxy -db -f FILE")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = ap.parse_args(argv)
    if a.print_cfg:
        listen, engine, d = a.print_cfg
        print(render_cfg(Path(d).resolve(), int(listen), int(engine), COST_CONF), end="")
        return 0
    only = [x for x in a.only.split(",") if x]
    if unknown := set(only) - set(EXPERIMENTS):
        ap.error(f"unknown experiments: {', '.join(sorted(unknown))}")
    if not shutil.which("haproxy"):
        ap.error("no haproxy on PATH: apt-get install haproxy")
    version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[0]
    say("setup", version, cpus=os.cpu_count())
    work = Path(tempfile.mkdtemp(prefix="front-spike-"))
    try:
        with running_vllm(a, work) as vllm:
            for name in only:
                print(f"== {name}", flush=True)
                if name == "cost":
                    exp_cost(vllm, work, a.front_python, a.bench_args.split())
                elif name == "stream":
                    exp_stream(vllm, work, a.front_python)
                else:
                    {"hold": exp_hold, "replay": exp_replay,
                     "counts": exp_counts}[name](vllm, work)
    finally:
        if a.json:
            a.json.write_text(json.dumps(OBSERVED, indent=1, default=str) + "\n")
        if a.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
