"""`qwen4090 status`: ask the running daemon's status endpoint and summarise it.

The exit code is for scripts, after the LSB init-script convention: 0 READY, 1 running but not
ready (starting, warming, degraded, restarting, stopping), 3 not running (no answer, or the
daemon stopped or failed and is about to exit).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from typing import Any

from qwen4090.base.vllmfacts import RUNNING, WAITING, kv_cache_usage, local_host
from qwen4090.commandline.commands import config_arg
from qwen4090.launching.runtime import version_warning
from qwen4090.settings import config as config_mod
from qwen4090.settings.config import ConfigError, StatusConfig

EXIT_READY = 0
EXIT_NOT_READY = 1
EXIT_NOT_RUNNING = 3
FINAL_STATES = ("stopped", "failed")


def add_args(p: argparse.ArgumentParser) -> None:
    config_arg(p)
    p.add_argument("--json", action="store_true", help="print the /status document as JSON")
    p.add_argument("--url", help="status endpoint, e.g. http://127.0.0.1:8090 (default: "
                                 "[status] host and port of the config)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")


def runtime_note(args: argparse.Namespace) -> str | None:
    """A warning when the runtime's vLLM is not the pinned version (None when it is, or when
    the config cannot be read: endpoint() says that)."""
    try:
        cfg = config_mod.load(args.config)
    except ConfigError:
        return None
    return version_warning(cfg.vllm.command)


def endpoint(args: argparse.Namespace) -> tuple[str, int, str | None]:
    """(host, port, a note when the config could not be read and defaults are used)."""
    if args.url:
        rest = args.url.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = rest.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port), None
    note = None
    try:
        st = config_mod.load(args.config).status
    except ConfigError as e:
        st, note = StatusConfig(), f"cannot read the config ({e}); trying the default endpoint"
    return local_host(st.host), st.port, note


def fetch(host: str, port: int, timeout: float) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/status", headers={"User-Agent": "qwen4090-status"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}")
    finally:
        conn.close()
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def exit_code(doc: dict[str, Any]) -> int:
    state = doc.get("state")
    if state == "ready":
        return EXIT_READY
    if state in FINAL_STATES:
        return EXIT_NOT_RUNNING
    return EXIT_NOT_READY


def summary(doc: dict[str, Any], now: float | None = None) -> str:
    """A compact human summary (about ten lines)."""
    now = time.time() if now is None else now
    lines = [f"qwen4090: {str(doc.get('state', '?')).upper()} for "
             f"{_dur(doc.get('state_seconds'))} ({doc.get('state_reason')})"]
    lines.append(f"  model     {doc.get('model')} at {doc.get('endpoint')}  "
                 f"ctx={doc.get('max_model_len')} seqs={doc.get('max_num_seqs')}  "
                 f"vLLM pid {doc.get('child_pid') or '-'}")
    if doc.get("status"):
        lines.append(f"  systemd   {doc['status']}")
    warm = doc.get("warmup")
    if warm:
        rows = warm.get("rows") or []
        ttft = " ".join(f"{r['length']}:{r['ttft_ms']:.0f}ms" for r in rows
                        if r.get("concurrency") == 1)
        conc = " ".join(f"x{r['concurrency']}:{r['ttft_ms']:.0f}ms" for r in rows
                        if r.get("concurrency", 1) > 1)
        ok = "ok" if warm.get("ok") else f"FAILED: {warm.get('error')}"
        lines.append(f"  warmup    {ok} in {_dur(warm.get('seconds'))}; TTFT by prompt length "
                     f"{ttft or '-'}" + (f"; by concurrency {conc}" if conc else ""))
    if doc.get("time_to_ready_seconds") is not None:
        lines.append(f"  started   READY {_dur(doc['time_to_ready_seconds'])} after launching "
                     "vLLM (last start)")
    vm = doc.get("vllm_metrics") or {}
    if vm:
        kv = kv_cache_usage(vm)
        lines.append(f"  load      {vm.get(RUNNING, 0):g} running, "
                     f"{vm.get(WAITING, 0):g} waiting"
                     + (f", KV cache {kv * 100:.0f}% used" if kv is not None else ""))
    front = doc.get("front")
    if front:
        now_ = ("draining" if front.get("draining") else "open" if front.get("open")
                else "holding requests")
        lines.append(f"  clients   {now_}: {front.get('in_flight', 0)} in flight, "
                     f"{front.get('holding', 0)} held now; since start {front.get('requests')} "
                     f"requests, {front.get('held')} held, {front.get('replayed')} replayed, "
                     f"{front.get('hold_timeouts')} timed out, {front.get('stream_errors')} "
                     "streams ended by an error")
    from qwen4090.surfaces.httpapi import gpu_list, standby_of, standby_summary

    standby = standby_of(doc)  # none with restart.standby = "off" (or an older daemon)
    if standby is not None:
        lines.append(f"  standby   {standby_summary(standby)}")
    elif isinstance(sb := doc.get("standby"), dict) and sb.get("configured") == "auto":
        lines.append(f"  standby   off (restart.standby = \"auto\": {sb.get('why')})")
    for i, g in enumerate(gpu_list(doc.get("gpu"))):
        shown = ", ".join(f"{k}={_val(v)}" for k, v in g.items() if k != "index")
        lines.append(f"  gpu{g.get('index', i)}      {shown}")
    pre = doc.get("preimport")
    if pre:
        rss = pre.get("rss_bytes")
        lines.append(f"  next      vLLM pre-imported in pid {pre.get('pid')} for "
                     f"{_dur(pre.get('age_s'))}" + (f", {rss / 1024 ** 3:.1f} GiB RAM"
                                                    if rss else ""))
    hist = doc.get("history") or []
    restarts = doc.get("restarts", 0)
    lines.append(f"  restarts  {restarts} ({doc.get('failures_in_window', 0)} failures in the "
                 f"crash-loop window; hangs detected {doc.get('hangs', 0)})")
    for h in hist[-3:]:
        ago = _dur(now - float(h.get("wall_time", now)))
        lines.append(f"    {ago} ago  {h.get('cause')}: {str(h.get('detail'))[:100]}")
    return "\n".join(lines)


def _val(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _dur(s: Any) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 120:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}min"
    return f"{s / 3600:.1f}h"


def cmd_status(args: argparse.Namespace) -> int:
    host, port, note = endpoint(args)
    if note:
        print(f"qwen4090: {note}", file=sys.stderr)
    runtime = None if args.url else runtime_note(args)
    if runtime:
        print(f"qwen4090: warning: {runtime}", file=sys.stderr)
    try:
        doc = fetch(host, port, args.timeout)
    except (OSError, http.client.HTTPException, ValueError) as e:
        why = "connection refused" if isinstance(e, ConnectionRefusedError) else \
            (str(e) or type(e).__name__)
        if args.json:
            print(json.dumps({"state": None, "running": False, "error": why}))
        else:
            print(f"qwen4090: not running (no answer from http://{host}:{port}/status: {why})")
        return EXIT_NOT_RUNNING
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(summary(doc))
    return exit_code(doc)

