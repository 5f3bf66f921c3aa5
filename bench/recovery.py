#!/usr/bin/env python3
"""Fault -> READY, phase by phase: the real supervisor over a real vLLM, faults injected.

For each scenario the bench starts ``qwen4090 run`` (tests/support/daemon.py's Daemon:
a real NOTIFY_SOCKET, JSON logs read as they arrive), waits for READY, injects the fault and
times, on its own monotonic clock, every step the supervisor logs: detected (state ->
restarting), group gone, relaunched (child_spawned), /health (-> warming), READY.  The same
events exist in older builds, so ``--repo OLD_CHECKOUT`` measures "before" with the same bench.
Where the daemon logs ``startup_timeline`` / ``recovery_timeline`` (timeline.py) they are
printed too (vLLM's own phases: imports, engine up, weights, compile, KV, graphs).

Scenarios: ``cold`` (first start, empty VLLM_CACHE_ROOT), ``warm`` (a second daemon on the
cache the cold one filled), ``kill-engine`` (SIGKILL of the EngineCore, once the pre-imported
interpreter has imported), ``kill-engine-at-ready`` (the same, at READY: issue 18.7),
``kill-api`` (SIGKILL of the API server), ``hang`` (SIGSTOP of the EngineCore while requests
stream), ``serve`` (a start, then output tokens/s at 32 concurrent 512-in/256-out completions:
for the env toggles).

CPU (here, under the shared lock):
    flock /tmp/qwen4090-vllm.lock .venv/bin/python bench/recovery.py --base cpu \
        --scenarios cold,warm,kill-engine,kill-api,hang --out docs/data/recovery-cpu.json
GPU (H200 with the kit): see scripts/gpu/recovery.sh.
Options: ``--set section.key=JSON`` (repeatable) changes the config, ``--env NAME=VALUE`` adds
to vLLM's environment, ``--repo DIR`` runs another checkout's daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from tests.support import daemon as daemon_mod  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402
from tests.support.runtime import cpu_config, free_port, require_runtime, write_toml  # noqa: E402

from qwen4090.settings.config import RestartConfig  # noqa: E402

STEPS = ("detected", "group_gone", "relaunched", "health", "ready")
READY_TIMEOUT = 540.0
THROUGHPUT_CONCURRENCY = int(os.environ.get("QWEN4090_BENCH_CONCURRENCY", "32"))


def base_config(base: str, tmp: Path) -> dict[str, dict[str, Any]]:
    if base == "cpu":
        cfg = cpu_config(free_port())
        cfg["status"] = {"enabled": False}
        cfg["gpu"] = {"enabled": "off", "state_directory": str(tmp / "state")}
        return cfg
    import lab  # tests/gpu/lab.py: the H200 config of the GPU validation
    import tomllib

    path = lab.write_config(tmp / "gpu-base.toml")
    cfg = tomllib.loads(path.read_text())
    cfg["status"] = {"enabled": False}
    cfg["gpu"]["state_directory"] = str(tmp / "state")
    return cfg


def apply_sets(cfg: dict[str, dict[str, Any]], sets: list[str], env: list[str]) -> None:
    for s in sets:
        key, _, raw = s.partition("=")
        section, _, name = key.partition(".")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        cfg.setdefault(section, {})[name] = value
    for e in env:
        name, _, value = e.partition("=")
        cfg["vllm"].setdefault("env", {})[name] = value


# --- load for the hang: requests in flight while the EngineCore is stopped ---------------------


class Load:
    def __init__(self, port: int, model: str, streams: int = 2) -> None:
        self.port, self.model = port, model
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": [500 + i for i in range(64)],
                           "max_tokens": 512, "ignore_eos": True, "stream": True})
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                c.request("POST", "/v1/completions", body,
                          {"Content-Type": "application/json"})
                r = c.getresponse()
                while not self.stop.is_set() and r.read(256):
                    pass
                c.close()
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()


def throughput(port: int, model: str, concurrency: int, requests: int, prompt_len: int,
               max_tokens: int) -> dict[str, float]:
    """Output tokens per second of `requests` completions at `concurrency` (non-streamed)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        body = json.dumps({"model": model, "prompt": [300 + (i * 7 + j) % 700
                                                      for j in range(prompt_len)],
                           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = json.loads(c.getresponse().read())
        c.close()
        return int(r["usage"]["completion_tokens"])

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as ex:
        tokens = sum(ex.map(one, range(requests)))
    secs = time.monotonic() - t0
    return {"concurrency": concurrency, "requests": requests, "prompt_len": prompt_len,
            "output_tokens": tokens, "seconds": round(secs, 2),
            "output_tok_s": round(tokens / secs, 1)}


# --- one daemon, one scenario --------------------------------------------------------------------


def vllm_lines(d: Daemon, after: int, text: str) -> list[str]:
    return [str(e.get("event")) for e in d.events[after:]
            if e.get("source") == "vllm" and text in str(e.get("event"))]


def kv_tokens(d: Daemon, after: int) -> int | None:
    import re

    for line in vllm_lines(d, after, "KV cache size"):
        m = re.search(r"KV cache size: ([\d,]+) tokens", line)
        if m:
            return int(m[1].replace(",", ""))
    return None


def steps_after(d: Daemon, mark: int, t0: float) -> dict[str, float]:
    """Seconds from t0 to each step the supervisor logged after the fault."""
    want = {"detected": ("state_changed", {"to": "restarting"}),
            "group_gone": ("group_gone", {}), "relaunched": ("child_spawned", {}),
            "health": ("state_changed", {"to": "warming"}),
            "ready": ("state_changed", {"to": "ready"})}
    out = {}
    for step, (name, match) in want.items():
        ev = d.event(name, mark, **match)
        if ev is not None:
            out[step] = round(ev["_t"] - t0, 2)
    return out


def event_soon(d: Daemon, name: str, after: int = 0) -> dict[str, Any] | None:
    """An event logged right after READY (the log reader may not have it yet); None when this
    daemon does not log it (an older checkout)."""
    try:
        return d.wait_for(lambda: d.event(name, after), 5.0, name)
    except AssertionError:
        return None


def first_start(d: Daemon, t_launch: float) -> dict[str, Any]:
    ev = d.wait_state("ready", READY_TIMEOUT)
    res: dict[str, Any] = {"ready": round(ev["_t"] - t_launch, 2), "kv_tokens": kv_tokens(d, 0)}
    st = event_soon(d, "startup_timeline")
    if st is not None:
        res["startup_timeline"] = {k: st[k] for k in ("at", "took", "compile_cache",
                                                      "kv_tokens")}
    return res


def run_scenario(name: str, cfg: dict[str, dict[str, Any]], tmp: Path, cache: Path,
                 repo: Path | None) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    if name == "cold":
        shutil.rmtree(cache, ignore_errors=True)  # nothing compiled, nothing cached
    cfg["vllm"].setdefault("env", {})["VLLM_CACHE_ROOT"] = str(cache)
    port = int(cfg["vllm"]["port"])
    conf = write_toml(tmp / f"{name}.toml", cfg)
    if repo is not None:
        # the Daemon runs that checkout's qwen4090 (PYTHONPATH=REPO/daemon first)
        daemon_mod.DAEMON_SRC = repo / "daemon"
    t_launch = time.monotonic()
    d = Daemon(conf, tmp)
    load: Load | None = None
    try:
        res: dict[str, Any] = {"scenario": name, "first_start": first_start(d, t_launch)}
        if name in ("cold", "warm"):
            return res
        if name == "serve":  # a start plus a throughput sample (for the env toggles)
            model = str(cfg["vllm"]["served_model_name"])
            throughput(port, model, 4, 8, 64, 16)  # warm the paths outside the sample
            res["throughput"] = throughput(port, model, THROUGHPUT_CONCURRENCY,
                                           4 * THROUGHPUT_CONCURRENCY, 512, 256)
            return res
        # a fault after the pre-imported interpreter's imports are done (on by default: a
        # fault 2 s after READY finds it still importing, and the start waits for it; fifth-c)
        # (kill-engine-at-ready: the fault comes at READY; the interpreter is started beside
        # the spawn since issue 18.7, so it should have imported by then)
        if cfg.get("restart", {}).get("preimport", RestartConfig().preimport) \
                and name != "kill-engine-at-ready":
            t_pre = time.monotonic()
            res["preimport_pid"] = d.wait_preimported(300)
            res["preimport_wait"] = round(time.monotonic() - t_pre, 2)
        elif name == "kill-engine-at-ready":
            started = d.event("preimport_started")
            res["preimport_imported_at_ready"] = started is not None \
                and daemon_mod.reading_stdin(int(started["pid"]))
        mark = d.mark()
        if name == "hang":
            load = Load(port, str(cfg["vllm"]["served_model_name"]))
            d.wait_for(lambda: any(e.get("source") == "vllm" and "POST /v1/completions"
                                   in str(e.get("event")) for e in d.events[mark:]),
                       60, "vLLM's access line of a load request")
            time.sleep(1.0)  # tokens flowing before the stop (a measurement, not a sync)
            mark = d.mark()
            victim = d.engine_core()
            t0 = time.monotonic()
            victim.send_signal(signal.SIGSTOP)
        elif name in ("kill-engine", "kill-engine-at-ready"):
            victim = d.engine_core()
            t0 = time.monotonic()
            victim.send_signal(signal.SIGKILL)
        elif name == "kill-api":
            pid = d.last_child_pid()
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        else:
            raise SystemExit(f"unknown scenario {name}")
        d.wait_event("state_changed", READY_TIMEOUT, after=mark, to="ready")
        if load is not None:
            load.close()
        res["steps"] = steps_after(d, mark, t0)
        used = d.event("preimport_used", mark)
        res["preimport_used"] = used is not None
        res["kv_tokens_after"] = kv_tokens(d, mark)
        rec = event_soon(d, "recovery_timeline", mark)
        if rec is not None:
            res["recovery_timeline"] = {k: rec[k] for k in ("at", "took", "fault_source",
                                                            "cause", "attempts")}
            res["fault_to_detected_by_daemon_wall"] = round(
                rec["detected_wall"] - (time.time() - (time.monotonic() - t0)), 2)
        st = event_soon(d, "startup_timeline", mark)
        if st is not None:
            res["restart_startup_timeline"] = {k: st[k] for k in ("at", "took",
                                                                  "compile_cache")}
        return res
    finally:
        if load is not None:
            load.close()
        d.signal(signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            d.wait_exit(90)
        d.close()


# --- the table -----------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| scenario | first READY s | KV tokens | " + " | ".join(STEPS) + " | output tok/s | "
            "vLLM phases of the (re)start (s since spawn) |",
            "| --- | --- | --- | " + " | ".join("---" for _ in STEPS) + " | --- | --- |"]
    for r in results:
        steps = r.get("steps", {})
        st = r.get("restart_startup_timeline") or r["first_start"].get("startup_timeline") or {}
        phases = " ".join(f"{k}={v:g}" for k, v in (st.get("at") or {}).items())
        kv = r["first_start"].get("kv_tokens")
        if "kv_tokens_after" in r:
            kv = f"{kv} / {r['kv_tokens_after']}"
        tok = r["throughput"]["output_tok_s"] if "throughput" in r else "-"
        rows.append(f"| {r['scenario']} | {r['first_start']['ready']} | {kv} | "
                    + " | ".join(str(steps.get(s, "-")) for s in STEPS)
                    + f" | {tok} | {phases or '-'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--scenarios", default="cold,warm,kill-engine,kill-api,hang")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=JSON")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--repo", type=Path, help="run this checkout's daemon (e.g. main, before)")
    ap.add_argument("--cache", type=Path, help="VLLM_CACHE_ROOT to use (default: a fresh one)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.base == "cpu":
        require_runtime()
    tmp = Path(tempfile.mkdtemp(prefix="qwen4090-recovery-"))
    cache = args.cache or tmp / "vllm-cache"
    cfg = base_config(args.base, tmp)
    apply_sets(cfg, args.set, args.env)
    results = []
    try:
        for name in [s for s in args.scenarios.split(",") if s]:
            t = time.monotonic()
            r = run_scenario(name, cfg, tmp, cache, args.repo)
            r["wall_seconds"] = round(time.monotonic() - t, 1)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(tmp / "state", ignore_errors=True)
    doc = {"label": args.label, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores "
                      f"{platform.python_version()}", "repo": str(args.repo or ROOT),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results,
           "median_ready_after_fault": {
               name: statistics.median(r["steps"]["ready"] for r in results
                                       if r["scenario"] == name and "ready" in r.get("steps", {}))
               for name in {r["scenario"] for r in results if "steps" in r}}}
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
