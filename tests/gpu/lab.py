"""Helpers for the GPU tests: configs, a supervisor or raw vLLM in its own process group, its
timestamped log, streamed TTFT requests and result files.  Standard library only (plus
qwen4090 itself), because the GPU machine has no network and only the image's packages.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("QWEN4090_GPU_MODEL", "/tmp/vllm_lab/model")
RESULTS = Path(os.environ.get("QWEN4090_GPU_RESULTS", "/tmp/qwen4090_gpu_results"))
NAME = "qwen3-14b-dummy"
PORT = 8000
STATUS_PORT = 8090
LENGTHS = [16, 256, 1024, 4096, 8000]
# QWEN4090_GPU_DRYRUN_CPU=1: run these tests' flow against the CPU vLLM and the tiny model
# (scripts/setup-runtime.sh) to find bugs in the harness before spending GPU time.
DRYRUN = os.environ.get("QWEN4090_GPU_DRYRUN_CPU") == "1"
if DRYRUN:
    MODEL = str(REPO / ".runtime" / "tiny-model")
    NAME, PORT, STATUS_PORT = "tiny", 18241, 18242
    LENGTHS = [16, 256, 1024]
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # vLLM 0.26 imports flashinfer for its sampler unless this is 0 (not carried)
            "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    """The H200 config the validation uses, with per-test overrides."""
    base: dict[str, dict[str, Any]] = {
        "vllm": {"command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
                 "model": MODEL, "served_model_name": NAME, "port": PORT,
                 "quantization": "fp8", "gpu_memory_utilization": 0.16,
                 "max_model_len": 8192, "max_num_seqs": 8, "max_num_batched_tokens": 8192,
                 "extra_args": ["--load-format", "dummy"], "env": VLLM_ENV},
        "warmup": {"lengths": LENGTHS, "concurrency": [1, 8], "max_tokens": 4},
        "watch": {"poll_interval": 2.0, "hang_timeout": 15.0, "canary_interval": 30.0,
                  "load_timeout": 540.0},
        "restart": {"backoff_initial": 1.0, "budget_failures": 5},
        "stop": {"drain_timeout": 5.0, "term_timeout": 15.0},
        "log": {"format": "json"},
        "status": {"port": STATUS_PORT},
        "gpu": {"state_directory": str(path.parent / "state"), "sample_interval": 5.0},
    }
    if DRYRUN:
        base["vllm"].update({
            "command": [str(REPO / ".runtime/venv/bin/python"), "-m",
                        "vllm.entrypoints.openai.api_server"],
            "quantization": "", "dtype": "float32", "enforce_eager": True,
            "max_model_len": 2048, "max_num_batched_tokens": 2048,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}})
        base["warmup"]["lengths"] = LENGTHS
    for name, over in sections.items():
        base.setdefault(name, {}).update(over)
    lines = []
    for name, table in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


# --- processes -------------------------------------------------------------------------------


@dataclass
class Proc:
    """A process group we started, its output with seconds-since-launch on every line."""

    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    t0: float = field(default_factory=time.monotonic)
    lines: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Proc:
        env = dict(os.environ)
        env.update(self.env or {})
        env["PYTHONUNBUFFERED"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.log_path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env, cwd=REPO)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for raw in iter(self.p.stdout.readline, b""):
            t = time.monotonic() - self.t0
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.lines.append((t, line))
                if not self._fh.closed:
                    self._fh.write(f"{t:9.3f} {line}\n")
                    self._fh.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def find(self, pattern: str, after: float = -1.0) -> tuple[float, str] | None:
        rx = re.compile(pattern)
        with self._lock:
            for t, line in self.lines:
                if t > after and rx.search(line):
                    return t, line
        return None

    def wait_for(self, pattern: str, timeout: float, after: float = -1.0,
                 fail: str | None = None) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = self.find(pattern, after)
            if hit:
                return hit
            if fail and self.find(fail, after):
                raise AssertionError(f"{fail!r} seen while waiting for {pattern!r}; "
                                     f"log: {self.log_path}")
            if self.p.poll() is not None and not self.find(pattern, after):
                time.sleep(0.5)
                hit = self.find(pattern, after)
                if hit:
                    return hit
                raise AssertionError(f"exited {self.p.returncode} before {pattern!r}; "
                                     f"log: {self.log_path}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout:g}s; log: {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)
        self._reader.join(10)
        if self.p.stdout is not None:
            self.p.stdout.close()
        with self._lock:
            self._fh.close()


def py_env() -> dict[str, str]:
    """Our environment with the repo's daemon/ first on PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(REPO / "daemon"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def supervisor(config: Path, log_path: Path) -> Proc:
    env = {"PYTHONPATH": py_env()["PYTHONPATH"]}
    return Proc([sys.executable, "-m", "qwen4090", "run", "-c", str(config)], log_path,
                env=env).start()


def events(proc: Proc, name: str | None = None) -> Iterator[tuple[float, dict[str, Any]]]:
    """The supervisor's JSON log lines (after the '<N>' priority prefix)."""
    for t, line in list(proc.lines):
        i = line.find("{")
        if i < 0:
            continue
        try:
            ev = json.loads(line[i:])
        except ValueError:
            continue
        if name is None or ev.get("event") == name:
            yield t, ev


def engine_pids() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if "EngineCore" in (d / "cmdline").read_bytes().decode("utf-8", "replace") or \
                    "EngineCore" in (d / "comm").read_text():
                out.append(int(d.name))
    return out


# --- requests --------------------------------------------------------------------------------


def get(path: str, port: int = PORT, timeout: float = 5.0) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def ttft(length: int, max_tokens: int = 16, seed: int = 0, timeout: float = 120.0
         ) -> dict[str, float]:
    """One streamed completion of exactly ``length`` token ids: TTFT and total, in ms."""
    rng = random.Random(seed * 100_003 + length)
    body = json.dumps({"model": NAME, "prompt": [rng.randrange(100, 1000)
                                                 for _ in range(length)],
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0})
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    t0 = time.monotonic()
    first = None
    try:
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise AssertionError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for raw in r:
            if raw.startswith(b"data: {") and first is None:
                if b'"error"' in raw[:40]:
                    raise AssertionError(f"error in the stream: {raw[:300]!r}")
                first = time.monotonic()
            if raw.startswith(b"data: [DONE]"):
                break
    finally:
        c.close()
    end = time.monotonic()
    return {"length": length, "ttft_ms": round(((first or end) - t0) * 1000, 1),
            "total_ms": round((end - t0) * 1000, 1)}


def ttft_series(seed: int) -> list[dict[str, float]]:
    return [ttft(n, seed=seed) for n in LENGTHS]


def load(n: int, max_tokens: int, stop: threading.Event) -> list[threading.Thread]:
    """n long streams in the background (they end when the server goes or at max_tokens)."""
    def one(i: int) -> None:
        with contextlib.suppress(Exception):
            ttft(512, max_tokens=max_tokens, seed=1000 + i, timeout=600)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def metric(name: str) -> float | None:
    try:
        status, body = get("/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    total = None
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def save(name: str, data: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    p = RESULTS / f"{name}.json"
    p.write_text(json.dumps(data, indent=2, default=str))
    print(f"\n=== {name}\n{json.dumps(data, indent=1, default=str)[:6000]}", flush=True)
    return p


def nvml_used_mib() -> float | None:
    from qwen4090.probes import nvml

    nvml.bind([sys.executable])
    m = nvml.memory(0)
    return None if isinstance(m, str) else round(m.used / 1024 ** 2)


def wait_until(pred: Callable[[], bool], timeout: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()
