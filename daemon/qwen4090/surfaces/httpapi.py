"""The supervisor's own HTTP endpoint: /livez, /readyz, /status, /metrics and a status page.

It decides nothing.  It shows what the supervisor knows: the supervisor's snapshot, the config in
effect, the last GPU sample and the last vLLM metrics poll, plus what it counted itself from the
supervisor's events (restarts by cause, hang detections, time to ready).  It listens on its own
address (``[status]``, default 127.0.0.1:8090), never on vLLM's port, and runs on daemon
threads, so a stuck client can never hold up the supervisor's loop or its exit.  What clients
can cost it is bounded (issue 28.5): at most STATUS_CONNECTIONS threads (more connections get a
503 at once), and /status, /metrics and the page rendered at most once per RENDER_TTL, shared by
the scrapes that come meanwhile (the loop never renders, and never waits for a render).

``/readyz`` answers 200 only in READY.  DEGRADED (vLLM answers but /health fails or tokens stop
flowing) is 503 on purpose: a balancer with another backend should move traffic away while it
lasts, and it is also what a client would see as errors or stalls.
"""

from __future__ import annotations

import bisect
import html
import http.server
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from qwen4090 import __version__
from qwen4090.base import vllmfacts
from qwen4090.base.events import Event, GpuSampled, HangSeen, Restarted, Transition
from qwen4090.base.redact import safe_error
from qwen4090.base.states import State
from qwen4090.decide.policy import Cause
from qwen4090.parts.contracts import Published
from qwen4090.settings.config import Config, StatusConfig, as_dict

# /livez fails when the supervisor's loop has not stepped for this long (it steps every <= 0.5 s).
LOOP_STALL_SECONDS = 15.0
# qwen4090_loop_step_seconds: fine up to the 0.5 s a step may take under client load (issue
# 28.5), coarse above it (cli.LOOP_STALL says the steps past 2 s in the journal as well).
LOOP_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0,
                     10.0, math.inf)
# /status, /metrics and the page are rendered at most once per RENDER_TTL seconds and shared by
# the scrapes that come meanwhile: eight clients scraping as fast as they can cost two renders a
# second, not one per request (issue 28.5); a change of state is shown at once (Renders.forget).
# /livez and /readyz are answered live.
RENDER_TTL = 0.5
CACHED_PATHS = ("/status", "/metrics", "/", "/index.html")
# Connections served at once (a thread each); one more is answered 503 at once and closed, so a
# storm of clients cannot grow the supervisor's threads without bound.  A refused client's
# request is read for at most REFUSE_READ seconds first (closing on unread bytes would be a
# reset, not an answer).
STATUS_CONNECTIONS = 16
REFUSE_READ = 0.1
# vLLM's gauges and counters worth re-exporting (from the supervisor's own /metrics poll).
VLLM_GAUGES = vllmfacts.SHOWN_GAUGES
VLLM_COUNTERS = vllmfacts.SHOWN_COUNTERS
# The standby engine's states in the snapshot's "standby" (issue 21), for qwen4090_standby_state.
STANDBY_STATES = ("none", "waiting", "starting", "loading", "warming", "checking", "sleeping",
                  "ready", "waking", "failed")
# Config values whose names say they are secrets are never shown.
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSW|CREDENTIAL)", re.I)


class SupervisorLike(Protocol):
    @property
    def published(self) -> Published: ...  # the loop's last; read whole, never the live state


class PartsView(Protocol):
    """The supervisor's parts the endpoint uses: its clocks, and its listeners (Telemetry)."""

    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def wall(self) -> Callable[[], float]: ...
    @property
    def listeners(self) -> list[Any]: ...


class ServedSupervisor(SupervisorLike, Protocol):
    """What cli.start_status needs of the supervisor."""

    @property
    def p(self) -> PartsView: ...


# --- what we count from the supervisor's events ------------------------------------------------


class Telemetry:
    """A supervisor listener: counts restarts and hangs, times starts, keeps the GPU sample.

    Called on the supervisor's thread; read on the HTTP threads, hence the lock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        self._lock = threading.Lock()
        self.restarts_by_cause: dict[str, int] = {c.value: 0 for c in Cause}
        self.hangs = 0
        self.spawned_at: float | None = None
        self.time_to_ready: float | None = None  # seconds from spawn to READY, last start
        self.first_ready_after: float | None = None  # seconds from our start to the first READY
        self.started_at = clock()
        self.gpu: dict[str, Any] | None = None
        self.gpu_at: float | None = None  # monotonic time of the GPU sample

    def __call__(self, event: Event) -> None:
        now = self.clock()
        with self._lock:
            if isinstance(event, Transition):
                if event.dst is State.STARTING:
                    self.spawned_at = now
                elif event.dst is State.READY and event.src is State.WARMING \
                        and self.spawned_at is not None:
                    self.time_to_ready = now - self.spawned_at
                    if self.first_ready_after is None:
                        self.first_ready_after = now - self.started_at
            elif isinstance(event, Restarted):
                self.restarts_by_cause[event.cause] = \
                    self.restarts_by_cause.get(event.cause, 0) + 1
            elif isinstance(event, HangSeen):
                self.hangs += 1
            elif isinstance(event, GpuSampled):
                self.gpu = dict(event.fields)
                self.gpu_at = now

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {"restarts_by_cause": dict(self.restarts_by_cause), "hangs": self.hangs,
                    "time_to_ready_seconds": _round(self.time_to_ready),
                    "first_ready_after_seconds": _round(self.first_ready_after),
                    "gpu": None if self.gpu is None else dict(self.gpu),
                    "gpu_age_seconds": None if self.gpu_at is None
                    else round(self.clock() - self.gpu_at, 1)}


def _round(x: float | None, n: int = 3) -> float | None:
    return None if x is None else round(x, n)


class StepTimes:
    """How long the supervisor's loop steps take (qwen4090_loop_step_seconds): a step that
    takes long is a late watchdog, a late verdict and a late failover.

    Only the loop's thread observes, the scrape threads copy: no lock, so a scrape can never
    hold up the loop (a lock held by a thread that waits for the GIL would); a copy taken
    between the two additions of one observation misses at most that one in its sum.
    """

    def __init__(self, buckets: tuple[float, ...] = LOOP_STEP_BUCKETS) -> None:
        if buckets[-1] != math.inf:
            raise ValueError("the last bucket must be +Inf")
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return [self.family()]

    def family(self) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, n in zip(self.buckets, counts, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == math.inf else repr(bound), running))
        return HistogramMetricFamily(
            "qwen4090_loop_step_seconds", "seconds one step of the supervisor's loop took "
            "(its sleep not included)", buckets=cumulative, sum_value=total)


# --- the facts, as one JSON document --------------------------------------------------------


def redacted_config(cfg: Config) -> dict[str, Any]:
    """The config in effect, with values of secret-looking environment names hidden."""
    out: dict[str, Any] = as_dict(cfg)
    env = out.get("vllm", {}).get("env", {})
    for k in env:
        if _SECRET_NAME.search(k):
            env[k] = "(hidden)"
    out["sources"] = list(cfg.sources)
    return out


def status_document(sup: SupervisorLike, telemetry: Telemetry) -> dict[str, Any]:
    """Everything /status, /metrics and the page show, read once."""
    view = sup.published
    snap, cfg = view.snapshot, view.cfg
    wall = telemetry.wall()
    counts = telemetry.counts()
    gpu = counts.pop("gpu")
    if gpu is None and isinstance(snap.get("gpu"), dict):
        gpu = snap["gpu"]  # a sampler that reports through the snapshot instead of events
    metrics = view.last_metrics
    return {
        **snap,
        "ready": snap.get("state") == State.READY.value,
        "state_since": _iso(wall - float(snap.get("state_seconds", 0.0))),
        "supervisor": {"version": __version__, "pid": os.getpid(),
                       "uptime_seconds": round(telemetry.clock() - telemetry.started_at, 1)},
        "endpoint": f"{vllmfacts.local_url(cfg.vllm.host, cfg.vllm.port)}/v1",
        **counts,
        "gpu": gpu,
        "vllm_metrics": None if metrics is None or not metrics.ok else {
            k: v for k, v in metrics.values.items() if k in VLLM_GAUGES + VLLM_COUNTERS},
        "config": redacted_config(cfg),
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


# --- /metrics -------------------------------------------------------------------------------


class Collector:
    """Builds the qwen4090_* families at scrape time from one status document."""

    def __init__(self, document: Callable[[], dict[str, Any]]) -> None:
        self.document = document

    def describe(self) -> list[Metric]:
        return []  # families vary (GPU fields); no auto-describe needed

    def collect(self) -> list[Metric]:
        return metric_families(self.document())


def metric_families(doc: Mapping[str, Any]) -> list[Metric]:
    out: list[Metric] = []
    info = InfoMetricFamily("qwen4090", "qwen4090 version and the model it serves",
                            value={"version": str(doc.get("supervisor", {}).get("version", "")),
                                   "model": str(doc.get("model", ""))})
    out.append(info)
    state = GaugeMetricFamily("qwen4090_state", "1 for the supervisor's current state",
                              labels=["state"])
    for s in State:
        state.add_metric([s.value], 1.0 if doc.get("state") == s.value else 0.0)
    out.append(state)
    out.append(GaugeMetricFamily("qwen4090_ready", "1 when READY (what /readyz says)",
                                 value=1.0 if doc.get("ready") else 0.0))
    out.append(GaugeMetricFamily("qwen4090_state_seconds", "seconds in the current state",
                                 value=float(doc.get("state_seconds") or 0.0)))
    restarts = CounterMetricFamily("qwen4090_restarts", "vLLM restarts, by cause",
                                   labels=["cause"])
    for cause, n in sorted((doc.get("restarts_by_cause") or {}).items()):
        restarts.add_metric([cause], float(n))
    out.append(restarts)
    out.append(GaugeMetricFamily("qwen4090_failures_in_window",
                                 "failures counted in the crash-loop window",
                                 value=float(doc.get("failures_in_window") or 0)))
    out.append(CounterMetricFamily("qwen4090_hangs", "hangs detected (requests in flight, no "
                                                     "token progress)",
                                   value=float(doc.get("hangs") or 0)))
    hang = doc.get("hang")
    if hang:
        out.append(GaugeMetricFamily("qwen4090_hang_bound_seconds",
                                     "the stall of a busy engine that counts as a hang now (3 x "
                                     "the longest step measured, within watch.hang_floor and "
                                     "watch.hang_timeout)",
                                     value=float(hang["bound_seconds"])))
    if doc.get("time_to_ready_seconds") is not None:
        out.append(GaugeMetricFamily("qwen4090_time_to_ready_seconds",
                                     "seconds from launching vLLM to READY, last start",
                                     value=float(doc["time_to_ready_seconds"])))
    warmup = doc.get("warmup")
    if warmup:
        out.append(GaugeMetricFamily("qwen4090_warmup_ok", "1 if the last warmup succeeded",
                                     value=1.0 if warmup.get("ok") else 0.0))
        out.append(GaugeMetricFamily("qwen4090_warmup_seconds", "duration of the last warmup",
                                     value=float(warmup.get("seconds") or 0.0)))
        ttft = GaugeMetricFamily("qwen4090_warmup_ttft_seconds",
                                 "median time to first token in the last warmup, by prompt "
                                 "length and concurrency", labels=["length", "concurrency"])
        for row in warmup.get("rows") or []:
            ttft.add_metric([str(row["length"]), str(row["concurrency"])],
                            float(row["ttft_ms"]) / 1000.0)
        out.append(ttft)
    out.extend(_gpu_families(doc.get("gpu")))
    out.extend(_standby_families(standby_of(doc)))
    vm = doc.get("vllm_metrics")
    if vm:
        for name in VLLM_GAUGES:
            if name in vm:
                out.append(GaugeMetricFamily(_vllm_name(name), f"vLLM's {name} at the "
                                                               "supervisor's last poll",
                                             value=float(vm[name])))
        for name in VLLM_COUNTERS:
            if name in vm:
                out.append(CounterMetricFamily(_vllm_name(name), f"vLLM's {name} at the "
                                                                 "supervisor's last poll",
                                               value=float(vm[name])))
    return out


def _vllm_name(name: str) -> str:
    base = "qwen4090_vllm_" + name.split(":", 1)[1]
    return base[: -len("_total")] if base.endswith("_total") else base


def _metric_word(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


def gpu_list(gpu: Any) -> list[dict[str, Any]]:
    """A GPU sample as a list of per-GPU dicts: {"gpus": [...]} or one GPU's fields."""
    if not isinstance(gpu, dict):
        return []
    if isinstance(gpu.get("gpus"), list):
        return [g for g in gpu["gpus"] if isinstance(g, dict)]
    return [gpu]


def _gpu_families(gpu: Any) -> list[Metric]:
    families: dict[str, GaugeMetricFamily] = {}
    for i, g in enumerate(gpu_list(gpu)):
        index = str(g.get("index", i))
        for key, value in g.items():
            if key == "index" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "qwen4090_gpu_" + _metric_word(key)
            fam = families.get(name)
            if fam is None:
                fam = families[name] = GaugeMetricFamily(name, f"GPU sample field {key}",
                                                         labels=["gpu"])
            fam.add_metric([index], float(value))
    return list(families.values())


# --- the standby engine (restart.standby, issue 21) ---------------------------------------------


def standby_of(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The snapshot's "standby" when there is one to show: None with restart.standby = "off"
    and in the documents of daemons older than it (no key)."""
    sb = doc.get("standby")
    if not isinstance(sb, dict) or sb.get("mode", "off") == "off":
        return None
    return sb


def standby_summary(sb: Mapping[str, Any]) -> str:
    """One line: is a standby ready to take over, else what it is doing and why; then what the
    failovers did ("ready (asleep, pid 1234, port 18001, 28,672 KV tokens); 2 failovers, last:
    hang, back in 1.4 s")."""
    state = str(sb.get("state") or "none")
    detail = str(sb.get("detail") or "")
    if sb.get("ready"):
        facts = ["asleep" if sb.get("mode") == "sleep" else "awake"]
        if sb.get("pid"):
            facts.append(f"pid {sb['pid']}")
        if sb.get("port"):
            facts.append(f"port {sb['port']}")
        if sb.get("kv_tokens"):
            facts.append(f"{int(sb['kv_tokens']):,} KV tokens")
        head = f"ready ({', '.join(facts)})"
    else:
        doing = {"none": "none", "waiting": "waiting for a quiet moment to start",
                 "starting": "starting", "loading": "loading", "warming": "warming up",
                 "checking": "checking its known answer", "sleeping": "going to sleep",
                 "waking": "waking to take over", "failed": "FAILED"}.get(state, state)
        head = f"not ready: {doing}, {_secs(sb.get('seconds'))} so far"
        if sb.get("pid"):
            head += f", pid {sb['pid']}"
        if detail:
            head += f" ({detail})"
    counts = [_count(sb.get("failovers"), "failover")]
    if sb.get("fallbacks"):
        counts.append(_count(sb["fallbacks"], "fallback") + " to a restart")
    if sb.get("rebuilds"):
        counts.append(_count(sb["rebuilds"], "rebuild"))
    line = f"{head}; {', '.join(counts)}"
    last = sb.get("last_failover")
    if isinstance(last, dict):
        if last.get("ok"):
            line += (f", last: {last.get('cause')}, back in {_secs(last.get('seconds'))} "
                     f"(woke in {_secs(last.get('wake_seconds'), 2)})")
        else:
            line += (f", last: {last.get('cause')}, fell back to a restart after "
                     f"{_secs(last.get('seconds'))}")
    return line


def _no_standby(doc: Mapping[str, Any]) -> str:
    """The status page's words when no standby is kept: off, or what "auto" chose and why."""
    sb = doc.get("standby")
    if isinstance(sb, dict) and sb.get("configured") == "auto":
        return f"no standby engine (restart.standby = auto: off: {sb.get('why')})"
    return "no standby engine (restart.standby = off)"


def _count(n: Any, word: str) -> str:
    n = int(n or 0)
    return f"{n} {word}{'' if n == 1 else 's'}"


def _standby_families(sb: Mapping[str, Any] | None) -> list[Metric]:
    if sb is None:
        return []
    out: list[Metric] = [GaugeMetricFamily(
        "qwen4090_standby_ready", "1 when a standby engine is ready to take over",
        value=1.0 if sb.get("ready") else 0.0)]
    state = GaugeMetricFamily("qwen4090_standby_state", "1 for the standby engine's current "
                                                        "state", labels=["state"])
    current = str(sb.get("state") or "none")
    for s in (*STANDBY_STATES, *((current,) if current not in STANDBY_STATES else ())):
        state.add_metric([s], 1.0 if s == current else 0.0)
    out.append(state)
    failovers = CounterMetricFamily("qwen4090_failovers", "faults taken over by the standby "
                                    "(ok), and those that fell back to a restart (fallback)",
                                    labels=["result"])
    failovers.add_metric(["ok"], float(sb.get("failovers") or 0))
    failovers.add_metric(["fallback"], float(sb.get("fallbacks") or 0))
    out.append(failovers)
    out.append(CounterMetricFamily("qwen4090_standby_rebuilds", "builds of a standby engine "
                                   "begun (the first included)",
                                   value=float(sb.get("rebuilds") or 0)))
    last = sb.get("last_failover")
    if isinstance(last, dict) and last.get("seconds") is not None:
        out.append(GaugeMetricFamily("qwen4090_last_failover_seconds",
                                     "seconds from the fault to serving again, last failover",
                                     value=float(last["seconds"])))
    return out


# --- the status page ------------------------------------------------------------------------

_COLORS = {"ready": "#1a7f37", "degraded": "#b35900", "failed": "#cf222e", "restarting": "#cf222e"}


def render_html(doc: Mapping[str, Any]) -> str:
    """A small self-contained page (no scripts, no external files); refreshes every 5 s."""
    e = html.escape
    state = str(doc.get("state", "?"))
    color = _COLORS.get(state, "#0969da")

    def table(head: list[str], rows: list[list[Any]], empty: str) -> str:
        if not rows:
            return f"<p class=muted>{e(empty)}</p>"
        th = "".join(f"<th>{e(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{e(_cell(c))}</td>" for c in r) + "</tr>"
                       for r in rows)
        return f"<table><tr>{th}</tr>{body}</table>"

    sb = standby_of(doc)
    facts: list[list[Any]] = [["state", state], ["reason", doc.get("state_reason")],
             ["since", f"{doc.get('state_since')} ({doc.get('state_seconds')} s)"],
             ["model", doc.get("model")], ["endpoint", doc.get("endpoint")],
             ["vLLM pid", doc.get("child_pid")],
             ["max_model_len / max_num_seqs", f"{doc.get('max_model_len')} / "
                                              f"{doc.get('max_num_seqs')}"],
             ["restarts", f"{doc.get('restarts')} ({doc.get('failures_in_window')} failures in "
                          f"the crash-loop window)"],
             ["hangs detected", doc.get("hangs")],
             ["standby", "off" if sb is None else standby_summary(sb)],
             ["time to ready (last start)", _secs(doc.get("time_to_ready_seconds"))],
             ["systemd status", doc.get("status")],
             ["supervisor", f"qwen4090 {doc.get('supervisor', {}).get('version')} pid "
                            f"{doc.get('supervisor', {}).get('pid')}"]]
    warm = doc.get("warmup") or {}
    wrows = [[r["length"], r["concurrency"], f"{r['ttft_ms']:.1f}", f"{r['ttft_max_ms']:.1f}",
              f"{r['seconds']:.2f}"] for r in warm.get("rows") or []]
    gpus = gpu_list(doc.get("gpu"))
    gkeys = sorted({k for g in gpus for k in g})
    hist = [[_iso(float(h["wall_time"])), h["cause"], "yes" if h["counted"] else "no",
             h["detail"]] for h in reversed(doc.get("history") or [])]
    vm = doc.get("vllm_metrics") or {}
    front = doc.get("front") or {}
    frows = [[k, front[k]] for k in ("listen", "engine", "open", "draining", "in_flight",
                                     "holding", "unanswered", "oldest_unanswered_seconds",
                                     "requests", "held", "replayed", "retried", "hold_timeouts",
                                     "stream_errors", "failed", "refused", "queue_seconds",
                                     "hold_timeout") if k in front]
    srows: list[list[Any]] = [] if sb is None else [
        ["now", standby_summary(sb)], ["mode", sb.get("mode")],
        ["configured", sb.get("configured")], ["why", sb.get("why")], ["state", sb.get("state")],
        ["ready", "yes" if sb.get("ready") else "no"], ["pid", sb.get("pid")],
        ["port", sb.get("port")], ["in this state", _secs(sb.get("seconds"))],
        ["KV tokens", sb.get("kv_tokens")], ["failovers", sb.get("failovers")],
        ["fell back to a restart", sb.get("fallbacks")], ["rebuilds", sb.get("rebuilds")],
        ["last failover", _last_failover(sb.get("last_failover"))],
        ["detail", sb.get("detail")]]
    config = json.dumps(doc.get("config"), indent=1, sort_keys=True)
    warm_note = "" if not warm else (f"<p>{'ok' if warm.get('ok') else 'FAILED'} in "
                                     f"{warm.get('seconds')} s {e(warm.get('error') or '')}</p>")
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content=5>
<meta name=viewport content="width=device-width,initial-scale=1">
<title>qwen4090: {e(state)}</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;max-width:70em;color:#1f2328}}
h1{{font-size:1.4em}} h2{{font-size:1.1em;margin-top:1.5em}}
#state{{display:inline-block;padding:.15em .6em;border-radius:.4em;color:#fff;
background:{color};text-transform:uppercase}}
table{{border-collapse:collapse}} td,th{{border:1px solid #d0d7de;padding:.2em .6em;
text-align:left;vertical-align:top}} th{{background:#f6f8fa}} .muted{{color:#656d76}}
pre{{background:#f6f8fa;padding:.6em;overflow:auto;font-size:12px}}
</style></head><body>
<h1>qwen4090 <span id=state data-state="{e(state)}">{e(state)}</span></h1>
{table(["", ""], facts, "")}
<h2>Warmup (time to first token, ms)</h2>
{warm_note}{table(["prompt tokens", "concurrency", "TTFT p50", "TTFT max", "seconds"], wrows,
                  "no warmup yet")}
<h2>GPU</h2>
{table(["gpu", *gkeys], [[i, *[g.get(k, "") for k in gkeys]] for i, g in enumerate(gpus)],
       "no GPU sample")}
<h2>Client port (front)</h2>
{table(["", ""], frows, "no front: clients talk to vLLM directly (front.enabled = false)")}
<h2>Standby</h2>
{table(["", ""], srows, _no_standby(doc))}
<h2>vLLM (last poll)</h2>
{table(["metric", "value"], [[k, v] for k, v in sorted(vm.items())], "no metrics yet")}
<h2>Restart history</h2>
{table(["time", "cause", "counted", "detail"], hist, "no restarts")}
<h2>Config in effect</h2>
<pre>{e(config)}</pre>
<p class=muted>Machine-readable: <a href="/status">/status</a> (JSON),
<a href="/metrics">/metrics</a> (Prometheus), <a href="/readyz">/readyz</a>.</p>
</body></html>
"""


def _cell(c: Any) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:g}"
    return str(c)


def _secs(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{float(x):.{digits}f} s"


def _last_failover(last: Any) -> str | None:
    if not isinstance(last, dict):
        return None
    kv = last.get("kv_tokens")
    return (f"{last.get('cause')}: {'ok' if last.get('ok') else 'fell back to a restart'} in "
            f"{_secs(last.get('seconds'))} (woke in {_secs(last.get('wake_seconds'), 2)})"
            + (f", {int(kv):,} KV tokens" if kv else ""))


# --- the server -----------------------------------------------------------------------------


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], api: StatusApi,
                 connections: int = STATUS_CONNECTIONS) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.api = api
        self.slots = threading.BoundedSemaphore(connections)
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection while a slot is free; else 503 from here (the listener's
        thread), without a thread."""
        if not self.slots.acquire(blocking=False):
            self.api.refused += 1
            refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


_BUSY_TEXT = b"status endpoint busy: too many connections now, try again\n"
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Retry-After: 1\r\nCache-Control: no-store\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT))


def refuse(sock: socket.socket) -> None:
    """The 503 of a connection over the bound: its request read (briefly), the answer sent."""
    try:
        sock.settimeout(REFUSE_READ)
        sock.recv(65536)
        sock.sendall(BUSY)
    except OSError:
        pass  # gone, or silent: it is closed all the same


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a client that stops sending is dropped
    protocol_version = "HTTP/1.0"
    server_version = f"qwen4090/{__version__}"

    def do_GET(self) -> None:
        self.server.api.handle(self)

    def do_HEAD(self) -> None:
        self.server.api.handle(self, head=True)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the journal


class StatusApi:
    """The endpoint: owns the HTTP server thread and the metrics registry."""

    def __init__(self, document: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic, log: Any = None,
                 connections: int = STATUS_CONNECTIONS) -> None:
        self.document = document
        self.clock = clock
        self.connections = connections
        self.log = log
        self.last_beat = clock()
        self.steps = StepTimes()  # the loop observes each step (cli.loop)
        self.renders = Renders(clock)
        self.refused = 0  # connections answered 503: over STATUS_CONNECTIONS
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Collector(document))
        self.registry.register(self.steps)
        self.registry.register(_Refusals(self))
        # The supervisor's own CPU time and memory (the targets are <= 1% CPU, <= 60 MB RSS).
        ProcessCollector(registry=self.registry)
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None

    # The loop calls this every step: /livez is "the loop stepped recently".
    def beat(self) -> None:
        self.last_beat = self.clock()

    def start(self, host: str, port: int) -> None:
        self.server = _Server((host, port), self, self.connections)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={
            "poll_interval": 0.5}, name="qwen4090-status", daemon=True)
        self.thread.start()

    def serve(self, s: StatusConfig) -> None:
        """Start on ``[status]`` host:port if enabled.  A port we cannot bind is logged, not
        fatal: serving the model matters more than showing it."""
        log = self.log
        assert log is not None, "serve() logs what it did: pass StatusApi a log"
        if not s.enabled:
            log.info("status_endpoint_off")
            return
        try:
            self.start(s.host, s.port)
        except OSError as e:
            log.error("status_endpoint_failed", host=s.host, port=s.port,
                      error=e.strerror or str(e))
            return
        log.info("status_endpoint", url=f"http://{vllmfacts.host_port(s.host, s.port)}/")

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def handle(self, req: _Handler, head: bool = False) -> None:
        path = req.path.split("?", 1)[0]
        try:
            if path == "/livez":
                stalled = self.clock() - self.last_beat
                if stalled < LOOP_STALL_SECONDS:
                    self._send(req, 200, "ok\n", head=head)
                else:
                    self._send(req, 503, f"supervisor loop stalled for {stalled:.0f}s\n",
                               head=head)
            elif path == "/readyz":
                doc = self.document()
                if doc.get("ready"):
                    self._send(req, 200, "ready\n", head=head)
                else:
                    self._send(req, 503, f"{doc.get('state')}: {doc.get('state_reason')}\n",
                               head=head)
            elif path == "/status":
                self._send(req, 200, self.renders.get(path, lambda: (json.dumps(
                    self.document(), indent=1, default=str) + "\n").encode()),
                           "application/json", head=head)
            elif path == "/metrics":
                self._send(req, 200, self.renders.get(path, lambda: generate_latest(
                    self.registry)), CONTENT_TYPE_LATEST, head=head)
            elif path in ("/", "/index.html"):
                self._send(req, 200, self.renders.get("/", lambda: render_html(
                    self.document()).encode()), "text/html; charset=utf-8", head=head)
            else:
                self._send(req, 404, "not found: try /, /status, /metrics, /livez, /readyz\n",
                           head=head)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client left before its answer (a balancer's check that had seen enough)
        except Exception as e:  # a bug here must not take the endpoint down
            if self.log is not None:
                self.log.error("status_endpoint_error", path=path,
                               error=safe_error(e, where=True))
            self._send(req, 500, f"internal error: {safe_error(e)}\n", head=head)

    @staticmethod
    def _send(req: _Handler, code: int, body: str | bytes,
              ctype: str = "text/plain; charset=utf-8", head: bool = False) -> None:
        data = body.encode() if isinstance(body, str) else body
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        req.send_header("Cache-Control", "no-store")
        req.end_headers()
        if not head:
            req.wfile.write(data)


class Renders:
    """Answers rendered at most once per ``ttl`` and shared: a scrape that comes while one is
    rendered waits for it and takes it.  Renders happen one at a time, on the scrapes' threads
    (never the loop's), so a storm of scrapes costs one render a ``ttl``, not one each.  A new
    state is shown at once: the loop calls :meth:`forget` after a step that changed it."""

    def __init__(self, clock: Callable[[], float], ttl: float = RENDER_TTL) -> None:
        self.clock = clock
        self.ttl = ttl
        self.count = 0  # renders done (tests)
        self.generation = 0  # bumped by forget()
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[float, int, bytes]] = {}

    def forget(self) -> None:
        """What was rendered is not shown again.  Called on the loop's thread: no lock (one
        held by a scrape's thread that waits for the GIL would hold up the loop)."""
        self.generation += 1

    def get(self, key: str, render: Callable[[], bytes]) -> bytes:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and kept[1] == self.generation \
                    and 0 <= self.clock() - kept[0] < self.ttl:
                return kept[2]
            generation = self.generation
            body = render()  # an exception: the scrape's 500, nothing kept
            self.count += 1
            self._kept[key] = (self.clock(), generation, body)
            return body


class _Refusals:
    def __init__(self, api: StatusApi) -> None:
        self.api = api

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return [CounterMetricFamily(
            "qwen4090_status_refused", "connections to the status endpoint answered 503: "
            f"more than {STATUS_CONNECTIONS} at once", value=float(self.api.refused))]


class StatusSource(Protocol):
    """More facts for /status and more families for /metrics (e.g. timeline.TimelineWatch)."""

    def status(self) -> dict[str, Any]: ...
    def register(self, registry: CollectorRegistry) -> None: ...
