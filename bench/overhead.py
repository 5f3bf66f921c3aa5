#!/usr/bin/env python3
"""Side by side, one run: raw vLLM vs the same vLLM under `qwen4090 run`.

Measures, for each: seconds from launch to /health 200, to READY=1 (qwen4090 only), the TTFT of
the first request after the service says it is up (raw: /health; qwen4090: READY=1), and the
warm TTFT; then the supervisor's own CPU and RSS over an idle window and a loaded window.

    .venv/bin/python bench/overhead.py --config .runtime/demo.toml [--window 60] [--out FILE]

Needs scripts/setup-runtime.sh (CPU) or any config whose vLLM runs on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))

from tests.support.daemon import Daemon, Proc  # noqa: E402

from qwen4090.engine.child import render_env  # noqa: E402
from qwen4090.launching.launch import render_argv  # noqa: E402
from qwen4090.probes.http import VllmProbe  # noqa: E402
from qwen4090.settings import config as config_mod  # noqa: E402

PROMPT = [500 + i % 300 for i in range(256)]  # 256 token ids


def wait_health(probe: VllmProbe, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        if probe.health(2.0).ok:
            return time.monotonic()
        time.sleep(0.1)
    return None


def ttft_ms(probe: VllmProbe) -> float:
    r = probe.complete(PROMPT, 4, 60)
    if not r.ok or r.ttft is None:
        raise RuntimeError(f"request failed: {r.error}")
    return r.ttft * 1000


def run_raw(cfg: config_mod.Config) -> dict[str, float]:
    v = cfg.vllm
    probe = VllmProbe(v.host, v.port, v.served_model_name)
    proc = Proc(render_argv(v), env=render_env(v, os.environ, None)).start()
    try:
        t_health = wait_health(probe, proc.t0 + 600)
        if t_health is None:
            raise RuntimeError("raw vLLM never answered /health")
        first = ttft_ms(probe)
        warm = statistics.median(ttft_ms(probe) for _ in range(5))
        return {"health_s": t_health - proc.t0, "first_ttft_ms": first, "warm_ttft_ms": warm}
    finally:
        proc.stop(signal.SIGTERM, 30)


def load(probe: VllmProbe, stop: threading.Event, counts: dict[str, int], n: int = 4) -> None:
    def worker() -> None:
        while not stop.is_set():
            ok = probe.complete(PROMPT, 32, 60).ok
            counts["ok" if ok else "failed"] += 1
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(70)


def sample(proc: psutil.Process, seconds: float) -> tuple[float, float]:
    """(% of one core, max RSS MiB) of the supervisor process itself over a window."""
    c0 = proc.cpu_times()
    t0 = time.monotonic()
    rss = 0
    while time.monotonic() - t0 < seconds:
        rss = max(rss, proc.memory_info().rss)
        time.sleep(1)
    c1 = proc.cpu_times()
    busy = (c1.user - c0.user) + (c1.system - c0.system)
    return 100 * busy / (time.monotonic() - t0), rss / 2**20


def run_supervised(cfg_path: Path, cfg: config_mod.Config, window: float) -> dict[str, float]:
    v = cfg.vllm
    probe = VllmProbe(v.host, v.port, v.served_model_name)
    with tempfile.TemporaryDirectory(prefix="qwen4090-bench-") as tmp:
        d = Daemon(cfg_path, Path(tmp), own_runtime_dir=False)
        try:
            health_thread_result: list[float] = []
            th = threading.Thread(target=lambda: health_thread_result.append(
                wait_health(probe, d.t0 + 600) or 0.0), daemon=True)
            th.start()
            try:
                t_ready = d.wait_notify("READY=1", 600)
            except AssertionError as e:
                raise RuntimeError(f"no READY=1: {str(e).splitlines()[0]}") from None
            first = ttft_ms(probe)
            warm = statistics.median(ttft_ms(probe) for _ in range(5))
            th.join(5)
            t_health = health_thread_result[0] if health_thread_result else 0.0
            sup = psutil.Process(d.proc.pid)
            idle_cpu, idle_rss = sample(sup, window)
            stop = threading.Event()
            counts = {"ok": 0, "failed": 0}
            loader = threading.Thread(target=load, args=(probe, stop, counts), daemon=True)
            loader.start()
            load_cpu, load_rss = sample(sup, window)
            stop.set()
            loader.join(80)
            return {"health_s": t_health - d.t0, "ready_s": t_ready - d.t0,
                    "first_ttft_ms": first, "warm_ttft_ms": warm, "idle_cpu_pct": idle_cpu,
                    "idle_rss_mib": idle_rss, "load_cpu_pct": load_cpu,
                    "load_rss_mib": load_rss, "load_ok": counts["ok"],
                    "load_failed": counts["failed"]}
        finally:
            d.stop(signal.SIGTERM, 30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--window", type=float, default=60.0, help="seconds per CPU/RSS window")
    ap.add_argument("--out", type=Path, help="append the markdown table to this file")
    a = ap.parse_args()
    cfg = config_mod.load(a.config)
    raw = run_raw(cfg)
    sup = run_supervised(a.config, cfg, a.window)
    rows = [
        ("launch -> /health 200 (s)", f"{raw['health_s']:.1f}", f"{sup['health_s']:.1f}"),
        ("launch -> READY=1 (s)", "-", f"{sup['ready_s']:.1f}"),
        ("first request TTFT after 'up' (ms)", f"{raw['first_ttft_ms']:.1f}",
         f"{sup['first_ttft_ms']:.1f}"),
        ("warm TTFT, median of 5 (ms)", f"{raw['warm_ttft_ms']:.1f}",
         f"{sup['warm_ttft_ms']:.1f}"),
        (f"supervisor CPU, {a.window:g} s idle (% of a core)", "-", f"{sup['idle_cpu_pct']:.2f}"),
        (f"supervisor CPU, {a.window:g} s load (% of a core; {sup['load_ok']} requests ok, "
         f"{sup['load_failed']} failed, 4 streams)", "-", f"{sup['load_cpu_pct']:.2f}"),
        ("supervisor RSS, idle / load (MiB)", "-",
         f"{sup['idle_rss_mib']:.1f} / {sup['load_rss_mib']:.1f}"),
    ]
    ratio = sup["first_ttft_ms"] / raw["first_ttft_ms"]
    machine = (f"{platform.node()}: {os.cpu_count()} cores, "
               f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.platform()}")
    md = ["| measure | raw vLLM | qwen4090 |", "| --- | --- | --- |"]
    md += [f"| {a_} | {b} | {c} |" for a_, b, c in rows]
    md += ["", f"First-request TTFT ratio qwen4090/raw: {ratio:.2f}; READY=1 comes "
           f"{sup['ready_s'] - sup['health_s']:.1f} s after /health (the warmup).",
           f"Machine: {machine}. Command: `{' '.join(sys.argv)}`."]
    text = "\n".join(md)
    print(text)
    if a.out:
        with a.out.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
