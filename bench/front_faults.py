#!/usr/bin/env python3
"""Faults under a steady client load, through qwen4090's front (issue 20.9): what clients saw.

One real supervisor (tests/support/daemon.py) over a real vLLM, its front on the client port;
``--clients`` threads send short completions back to back and ``--streams`` long streams run
while each fault is injected: ``kill-engine`` (SIGKILL of the EngineCore), ``hang`` (SIGSTOP of
the EngineCore), ``reload`` (a [vllm] change + SIGHUP).  Per fault: requests, refused or reset,
answers other than 200, the longest wait, how each long stream ended, and the front's own
journal line (front_released).  The same daemon serves all faults in turn.

CPU:  .venv/bin/python bench/front_faults.py --base cpu --out docs/data/front-faults-cpu.json
GPU (H200 with the kit, PYTHONPATH as scripts/gpu/kit.sh sets it):
      python3 bench/front_faults.py --base gpu --clients 16 --streams 4 \
          --set watch.hang_timeout=15 --out $OUT/front-faults-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "daemon"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from bench.recovery import apply_sets, base_config  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402
from tests.support.load import Load, stream_endings, summary  # noqa: E402
from tests.support.runtime import write_toml  # noqa: E402

READY_TIMEOUT = 600.0


def run(base: str, faults: list[str], clients: int, streams: int, sets: list[str],
        tmp: Path) -> list[dict[str, Any]]:
    cfg = base_config(base, tmp)
    cfg.setdefault("front", {})["enabled"] = True
    apply_sets(cfg, sets, [])
    model = cfg["vllm"].get("served_model_name", "tiny")
    path = write_toml(tmp / "qwen4090.toml", cfg)
    (tmp / "conf.d").mkdir(exist_ok=True)
    d = Daemon(path, tmp, port=int(cfg["vllm"]["port"]), log_path=tmp / "daemon.log")
    out = []
    try:
        d.wait_state("ready", READY_TIMEOUT)
        for fault in faults:
            load = Load(d.port, streams=streams, clients=clients, model=model).start()
            load.wait_streaming(120)
            mark = d.mark()
            fault_at = time.monotonic()
            if fault in ("kill-engine", "hang"):
                engine = d.engine_core()
                os.kill(engine.pid, signal.SIGKILL if fault == "kill-engine" else signal.SIGSTOP)
            elif fault == "reload":
                seqs = int(cfg["vllm"].get("max_num_seqs", 32)) - 1
                (tmp / "conf.d" / "50-reload.toml").write_text(f"[vllm]\nmax_num_seqs = {seqs}\n")
                d.signal(signal.SIGHUP)
            else:
                raise SystemExit(f"unknown fault {fault!r}")
            d.wait_event("state_changed", 120, after=mark, to="restarting")
            ready = d.wait_event("state_changed", READY_TIMEOUT, after=mark, to="ready")
            time.sleep(3.0)
            outcomes = load.finish(READY_TIMEOUT)
            released = d.event("front_released", after=mark) or {}
            row = {"fault": fault, "ready_after_fault_s": round(ready["_t"] - fault_at, 1),
                   **summary(outcomes, fault_at), "streams": stream_endings(outcomes),
                   "front_released": {k: v for k, v in released.items()
                                      if k in ("held", "replayed", "hold_timeouts",
                                               "stream_errors", "failed", "longest_wait",
                                               "reason")}}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        d.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--faults", default="kill-engine,hang,reload")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=JSON")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="qwen4090-front-faults-"))
    rows = run(args.base, [f for f in args.faults.split(",") if f], args.clients,
               args.streams, args.set, tmp)
    doc = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    bad = [r for r in rows if r["refused_or_reset"] or r["not_200"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
