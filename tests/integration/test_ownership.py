"""READY=1 and health mean "this supervisor's vLLM" (issue 8.2-8.5), with the real supervisor
and the real CPU vLLM: one instance per port, a held port waited on (not a crash), a stranger's
200 never trusted, and a vLLM orphaned by a SIGKILLed supervisor stopped by the next start.
vLLM's own port is the engine port behind the front (front.engine_port): the strangers take
that one; the instance is named by the client port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.daemon import Daemon
from tests.support.runtime import REPO, cpu_config, free_port, write_toml

START_TIMEOUT = 300.0

# A process that is not our vLLM but answers like one: /health 200, /metrics, a streamed
# completion.  Before issue 8.2 such a 200 was taken for our vLLM's (warmup, READY=1).
STRANGER = r'''
import http.server, sys
log = open(sys.argv[2], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, body, ctype="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        log.write(f"GET {self.path}\n")
        self._send(b"vllm:num_requests_running 0\n" if self.path == "/metrics" else b"")
    def do_POST(self):
        log.write(f"POST {self.path}\n")
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunk = b'data: {"choices": [{"text": "x", "finish_reason": "length"}]}\n\n'
        self._send(chunk + b"data: [DONE]\n\n", "text/event-stream")
    def log_message(self, *a):
        pass
class S(http.server.ThreadingHTTPServer):
    allow_reuse_address = True  # SO_REUSEADDR, like vLLM: it can bind beside vLLM's socket
S(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


@contextlib.contextmanager
def stranger(port: int, tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp / f"stranger-{port}.log"
    log.touch()
    proc = subprocess.Popen([sys.executable, "-c", STRANGER, str(port), str(log)])
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, "the stranger could not bind"
            assert time.monotonic() < deadline, "the stranger never listened"
            time.sleep(0.05)
        yield proc, log
    finally:
        proc.kill()
        proc.wait(10)


def requests_seen(log: Path) -> list[str]:
    return log.read_text().splitlines()


def health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return int(r.status)


def gone(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE or abs(p.create_time() - create_time) > 0.05
    except psutil.NoSuchProcess:
        return True


def run_second(cfg: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "daemon"), "RUNTIME_DIRECTORY": str(tmp)}
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "qwen4090", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in reversed(started):
        d.close()


def test_held_port_is_waited_on_and_a_second_instance_is_refused(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    port, engine = free_port(), free_port()
    # budget_failures = 1: before 8.4 the held port was a counted failure: exit 75 at once.
    cfg = write_toml(tmp_path / "q.toml", cpu_config(port, restart={"budget_failures": 1},
                                                     front={"engine_port": engine}))
    holder = socket.socket()
    holder.bind(("127.0.0.1", engine))
    holder.listen()
    try:
        d = Daemon(cfg, tmp_path)
        daemons.append(d)
        busy = d.wait_event("port_busy", 60)
        assert busy["holder"].startswith(f"pid {os.getpid()} (")  # the test itself holds it
        assert busy["_prio"] == 4  # warning
        d.wait_for(lambda: any(s.startswith(f"waiting for port 127.0.0.1:{engine} held by pid "
                                            f"{os.getpid()} (") for s in d.statuses()),
                   30, "STATUS naming the holder")
        # 8.3: a second run for the same port refuses at once with 78, naming the first.
        t0 = time.monotonic()
        second = run_second(cfg, tmp_path)
        refused_in = time.monotonic() - t0
        assert second.returncode == 78, second.stderr
        refusal = [ln for ln in second.stderr.splitlines() if "instance_refused" in ln]
        assert len(refusal) == 1 and f"pid {d.proc.pid} (" in refusal[0]
        assert "qwen4090 run" in refusal[0] and "vllm.port" in refusal[0]
        assert "child_spawned" not in second.stderr
        print(f"second instance refused in {refused_in:.2f}s")
        assert d.proc.poll() is None and d.event("child_spawned") is None
        assert d.event("restart_scheduled") is None and d.event("giving_up") is None
        released = time.monotonic()
    finally:
        holder.close()
    d.wait_event("port_free", 30)
    d.wait_notify("READY=1", START_TIMEOUT)
    print(f"READY {time.monotonic() - released:.1f}s after the port was released")
    assert d.event("giving_up") is None and d.event("restart_scheduled") is None
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    assert not (tmp_path / f"instance-127.0.0.1-{port}.child.json").exists()


def test_a_strangers_200_is_not_our_vllm(tmp_path: Path, daemons: list[Daemon]) -> None:
    # Our vLLM listens on another port than the one we probe (a later --port wins), so a
    # stranger can answer on the probed port while our vLLM is alive and loading: the case
    # of a second supervisor's vLLM or a stray server answering 200 on "our" port.
    # (config.py refuses a second --port in extra_args, so a wrapper appends it to the argv)
    port, real, engine = free_port(), free_port(), free_port()
    wrapper = tmp_path / "vllm_on_another_port.py"
    wrapper.write_text("import runpy, sys\n"
                       f"sys.argv = [sys.argv[0], *sys.argv[1:], '--port', '{real}']\n"
                       "runpy.run_module('vllm.entrypoints.openai.api_server', "
                       "run_name='__main__', alter_sys=True)\n")
    base = cpu_config(port)
    cfg = write_toml(tmp_path / "q.toml", cpu_config(port, vllm={
        "command": [base["vllm"]["command"][0], str(wrapper)]}, front={"engine_port": engine}))
    d = Daemon(cfg, tmp_path)
    daemons.append(d)
    d.wait_event("child_spawned", 60)
    with stranger(engine, tmp_path) as (proc, log):
        said = d.wait_event("port_answered_by_stranger", START_TIMEOUT)
        assert said["holder"].startswith(f"pid {proc.pid} (")
        # Our own vLLM comes up on its real port; we keep probing the stranger meanwhile.
        d.wait_for(lambda: _answers(real), START_TIMEOUT, "our vLLM on its real port")
        seen = len(requests_seen(log))
        d.wait_for(lambda: requests_seen(log)[seen:].count("GET /health") >= 5, 60,
                   "five more probes answered by the stranger")
        assert d.notified("READY=1") is None
        assert d.event("health_ok") is None and d.event("warmup_finished") is None
        assert d.state() == "loading"
        assert not [r for r in requests_seen(log) if r.startswith("POST")]
        assert len([e for e in d.events if e.get("event") == "port_answered_by_stranger"]) == 1
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    assert d.survivors() == []


def _answers(port: int) -> bool:
    try:
        return health(port) == 200
    except OSError:
        return False


def test_vllm_losing_its_port_to_a_stranger_waits_then_serves(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    # The stranger takes the port after our preflight: our vLLM dies of "Address already in
    # use" (at its bind, or at its listen after loading).  Not a crash: wait for the port.
    port, engine = free_port(), free_port()
    cfg = write_toml(tmp_path / "q.toml", cpu_config(port, restart={"budget_failures": 1},
                                                     front={"engine_port": engine}))
    d = Daemon(cfg, tmp_path)
    daemons.append(d)
    d.wait_event("child_spawned", 60)
    with stranger(engine, tmp_path) as (proc, log):
        exited = d.wait_event("child_exited", START_TIMEOUT)
        assert exited["cause"] == "port_held", exited
        busy = d.wait_event("port_busy", 60)
        assert busy["holder"].startswith(f"pid {proc.pid} (")
        d.wait_for(lambda: any(s.startswith(f"waiting for port 127.0.0.1:{engine} held by pid "
                                            f"{proc.pid} (") for s in d.statuses()),
                   30, "STATUS naming the stranger")
        assert d.notified("READY=1") is None
        assert d.event("health_ok") is None and d.event("warmup_finished") is None
        assert not [r for r in requests_seen(log) if r.startswith("POST")]
        assert d.event("giving_up") is None
        released = time.monotonic()
    d.wait_notify("READY=1", START_TIMEOUT)
    print(f"READY {time.monotonic() - released:.1f}s after the stranger left")
    restarts = [e for e in d.events if e.get("event") == "restart_scheduled"]
    assert [e["cause"] for e in restarts] == ["port_held"] and restarts[0]["delay"] == 0
    assert restarts[0]["failures_in_window"] == 0
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0


def test_orphan_of_a_killed_supervisor_is_stopped_by_the_next_start(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    port, eport = free_port(), free_port()
    cfg = write_toml(tmp_path / "q.toml", cpu_config(port, front={"engine_port": eport}))
    first = Daemon(cfg, tmp_path)
    daemons.append(first)
    first.wait_notify("READY=1", START_TIMEOUT)
    engine = first.engine_core()
    old: dict[int, float] = {}
    for p in first.descendants():
        with contextlib.suppress(psutil.Error):
            old[p.pid] = p.create_time()
    api = first.last_child_pid()
    assert api in old and engine.pid in old
    os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor only
    first.wait_exit(30)
    # Orphaned, and still serving (on its own port: the front died with its supervisor).
    assert health(eport) == 200
    assert all(not gone(pid, t) for pid, t in old.items() if pid in (api, engine.pid))
    t0 = time.monotonic()
    second = Daemon(cfg, tmp_path)
    daemons.append(second)
    found = second.wait_event("orphan_found", 60)
    assert api in found["pids"] and engine.pid in found["pids"]
    assert found["supervisor_pid"] == first.proc.pid
    stopped = second.wait_event("orphan_stopped", 60)
    assert set(stopped["pids"]) == set(found["pids"])
    print(f"orphan stopped {stopped['seconds']}s by {stopped['signal']}, "
          f"{time.monotonic() - t0:.1f}s after the start")
    assert all(gone(pid, t) for pid, t in old.items())
    spawned = second.wait_event("child_spawned", 60)
    assert second.events.index(stopped) < second.events.index(spawned)
    second.wait_notify("READY=1", START_TIMEOUT)
    print(f"READY {time.monotonic() - t0:.1f}s after the second start")
    assert second.last_child_pid() not in old
    second.signal(signal.SIGTERM)
    assert second.wait_exit(60) == 0


def test_a_record_whose_pid_was_reused_kills_nobody(tmp_path: Path) -> None:
    # No vLLM: a live process with a recorded pid but another start time is a stranger.
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        p = psutil.Process(bystander.pid)
        from qwen4090.launching.instance import ChildRecord, instance_name

        port = free_port()
        rec = ChildRecord(bystander.pid, bystander.pid, p.create_time() - 5.0,
                          tuple(p.cmdline()), 1)
        (tmp_path / f"{instance_name('127.0.0.1', port)}.child.json").write_text(rec.to_json())
        cfg = write_toml(tmp_path / "q.toml", cpu_config(
            port, vllm={"model": str(tmp_path / "absent")}))  # 78 right after the orphan step
        env = {**os.environ, "PYTHONPATH": str(REPO / "daemon"),
               "RUNTIME_DIRECTORY": str(tmp_path)}
        out = subprocess.run([sys.executable, "-m", "qwen4090", "run", "--config", str(cfg)],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 78, out.stderr
        assert "orphan_pid_reused" in out.stderr and "orphan_found" not in out.stderr
        assert bystander.poll() is None and p.is_running()
    finally:
        bystander.kill()
        bystander.wait(10)

