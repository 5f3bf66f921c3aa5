"""Helpers for the GPU tests: configs, a supervisor or raw vLLM in its own process group, its
timestamped log, streamed TTFT requests and result files.  Standard library, psutil and
tests/support only (plus qwen4090 itself), because the GPU machine has no network and only the
image's packages.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.clients import http_get
from tests.support.daemon import Daemon, Proc, daemon_env
from tests.support.runtime import REPO, TINY_MODEL, cpu_vllm, merge, write_toml

__all__ = ["Daemon", "Proc", "daemon_env"]  # the GPU tests use them as lab.*

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
    MODEL = str(TINY_MODEL)
    NAME, PORT, STATUS_PORT = "tiny", 18241, 18242
    LENGTHS = [16, 256, 1024]
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # vLLM 0.26 imports flashinfer for its sampler unless this is 0 (not carried)
            "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    """The H200 config the validation uses, with per-test overrides."""
    base: dict[str, dict[str, Any]] = {
        "vllm": {"command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
                 "model": MODEL, "served_model_name": NAME, "port": PORT,
                 "quantization": "fp8", "gpu_memory_utilization": 0.16,
                 "max_model_len": 8192, "max_num_seqs": 8, "max_num_batched_tokens": 8192,
                 "extra_args": ["--load-format", "dummy"], "env": VLLM_ENV,
                 # QWEN4090_GPU_EAGER=true: no torch.compile (a short sitting's faster starts)
                 "enforce_eager": os.environ.get("QWEN4090_GPU_EAGER") == "true"},
        "warmup": {"lengths": LENGTHS, "concurrency": [1, 8], "max_tokens": 4},
        "watch": {"poll_interval": 2.0, "hang_timeout": 15.0, "canary_interval": 30.0,
                  "load_timeout": 540.0},
        # no standby: these tests measure one engine (restart.standby = "auto", the default
        # since issue 30.1, would build a sleeping one after READY on a box with the RAM for
        # it); scripts/gpu/standby.sh measures the standby
        "restart": {"backoff_initial": 1.0, "budget_failures": 5, "standby": "off"},
        "stop": {"drain_timeout": 5.0, "term_timeout": 15.0},
        "log": {"format": "json"},
        "status": {"port": STATUS_PORT},
        "gpu": {"state_directory": str(path.parent / "state"), "sample_interval": 5.0},
    }
    if DRYRUN:
        base["vllm"].update({**cpu_vllm(PORT), "quantization": ""})
    return write_toml(path, merge(base, sections))


# --- processes -------------------------------------------------------------------------------


def supervisor(config: Path, log_path: Path) -> Daemon:
    """``qwen4090 run`` in its own process group, its output timestamped in ``log_path``; the
    runtime directory is the environment's (a second supervisor finds the first one's orphan)."""
    return Daemon(config, log_path.parent, own_runtime_dir=False, log_path=log_path, cwd=REPO)


def events(sup: Daemon, name: str | None = None) -> Iterator[tuple[float, dict[str, Any]]]:
    """The supervisor's JSON log lines (after the '<N>' priority prefix), timed since launch."""
    return iter(sup.timed_events(name))


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
    return http_get(port, path, timeout)


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
