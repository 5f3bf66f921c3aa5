"""The status endpoint: documents, metrics, the page and the HTTP server (no vLLM)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.fakes import Clock, Log

from qwen4090.base.events import Event, GpuSampled, HangSeen, Restarted, Transition
from qwen4090.base.states import State
from qwen4090.commandline import cli
from qwen4090.decide.results import MetricsResult
from qwen4090.parts.contracts import Published
from qwen4090.settings.config import Config, from_dict
from qwen4090.surfaces import httpapi
from qwen4090.surfaces.httpapi import (
    StatusApi,
    Telemetry,
    metric_families,
    render_html,
    status_document,
)


class FakeSup:
    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or from_dict({"vllm": {"served_model_name": "tiny",
                                              "env": {"HF_TOKEN": "s3cret", "X": "1"}}})
        self.last_metrics: MetricsResult | None = MetricsResult(True, {
            "vllm:num_requests_running": 2.0, "vllm:kv_cache_usage_perc": 0.25,
            "vllm:generation_tokens_total": 1234.0, "vllm:other": 9.0})
        self.state = "ready"
        self.history: list[dict[str, Any]] = []
        self.p = Parts()

    @property
    def published(self) -> Published:
        return Published(self.snapshot(), self.cfg, self.last_metrics, 0.0)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state, "state_reason": "warmed up", "state_seconds": 12.5,
                "child_pid": 4321, "restarts": len(self.history), "failures_in_window": 1,
                "history": self.history, "model": "tiny", "max_model_len": 2048,
                "max_num_seqs": 8, "status": "ready: tiny",
                "warmup": {"ok": True, "seconds": 3.2, "error": "", "rows": [
                    {"length": 16, "concurrency": 1, "ttft_ms": 12.0, "ttft_max_ms": 12.0,
                     "seconds": 0.1},
                    {"length": 256, "concurrency": 4, "ttft_ms": 40.0, "ttft_max_ms": 55.0,
                     "seconds": 0.3}]}}


def doc_with(events: list[Event], sup: FakeSup | None = None) -> dict[str, Any]:
    clock = Clock()
    tel = Telemetry(clock=clock, wall=lambda: 1.7e9)
    for ev in events:
        tel(ev)
        clock.t += 10
    return status_document(sup or FakeSup(), tel)


def test_telemetry_counts_restarts_hangs_and_times_a_start() -> None:
    doc = doc_with([Transition(State.PREFLIGHT, State.STARTING, ""),
                    Transition(State.WARMING, State.READY, ""),
                    Restarted("hang", True),
                    HangSeen(12.0),
                    GpuSampled({"index": 0, "memory_used_bytes": 5e9, "name": "RTX 4090"})])
    assert doc["restarts_by_cause"]["hang"] == 1
    assert doc["restarts_by_cause"]["crash"] == 0
    assert doc["hangs"] == 1
    assert doc["time_to_ready_seconds"] == 10.0
    assert doc["gpu"] == {"index": 0, "memory_used_bytes": 5e9, "name": "RTX 4090"}
    assert doc["ready"] is True
    assert doc["endpoint"] == "http://127.0.0.1:8000/v1"


def test_status_document_hides_secret_env_and_keeps_vllm_key_metrics() -> None:
    doc = doc_with([])
    assert doc["config"]["vllm"]["env"] == {"HF_TOKEN": "(hidden)", "X": "1"}
    assert doc["config"]["status"] == {"enabled": True, "host": "127.0.0.1", "port": 8090}
    assert doc["vllm_metrics"] == {"vllm:num_requests_running": 2.0,
                                   "vllm:kv_cache_usage_perc": 0.25,
                                   "vllm:generation_tokens_total": 1234.0}
    json.dumps(doc)  # JSON-friendly


def test_gpu_from_the_snapshot_when_no_event_came() -> None:
    sup = FakeSup()
    base = sup.snapshot
    sup.snapshot = lambda: {**base(), "gpu": {"gpus": [{"index": 1, "util": 50}]}}  # type: ignore[method-assign]
    assert doc_with([], sup)["gpu"] == {"gpus": [{"index": 1, "util": 50}]}


def parse(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = fam.samples
    return out


def test_metrics_parse_with_prometheus_clients_parser() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    doc = doc_with([Transition(State.PREFLIGHT, State.STARTING, ""),
                    Transition(State.WARMING, State.READY, ""),
                    Restarted("signal", True),
                    GpuSampled({"gpus": [{"index": 0, "memory_used_bytes": 1.0,
                                          "temperature_c": 60, "throttled": False}]})])
    reg = CollectorRegistry()
    reg.register(httpapi.Collector(lambda: doc))
    fams = parse(generate_latest(reg).decode())
    state = {s.labels["state"]: s.value for s in fams["qwen4090_state"]}
    assert state["ready"] == 1.0 and state["restarting"] == 0.0
    assert fams["qwen4090_ready"][0].value == 1.0
    restarts = {s.labels["cause"]: s.value for s in fams["qwen4090_restarts"]
                if s.name == "qwen4090_restarts_total"}
    assert restarts["signal"] == 1.0 and restarts["hang"] == 0.0
    assert fams["qwen4090_time_to_ready_seconds"][0].value == 10.0
    ttft = {(s.labels["length"], s.labels["concurrency"]): s.value
            for s in fams["qwen4090_warmup_ttft_seconds"]}
    assert ttft == {("16", "1"): 0.012, ("256", "4"): 0.04}
    assert fams["qwen4090_gpu_memory_used_bytes"][0].labels == {"gpu": "0"}
    assert "qwen4090_gpu_throttled" not in fams  # booleans are not gauges
    assert fams["qwen4090_vllm_num_requests_running"][0].value == 2.0
    assert fams["qwen4090_vllm_generation_tokens"][0].value == 1234.0
    assert fams["qwen4090_info"][0].labels == {"version": doc["supervisor"]["version"],
                                          "model": "tiny"}


def test_no_warmup_or_metrics_yet_still_renders() -> None:
    sup = FakeSup()
    sup.last_metrics = None
    base = sup.snapshot
    sup.snapshot = lambda: {**base(), "warmup": None, "state": "loading"}  # type: ignore[method-assign]
    doc = doc_with([], sup)
    names = {f.name for f in metric_families(doc)}
    assert "qwen4090_warmup_ttft_seconds" not in names
    assert "qwen4090_time_to_ready_seconds" not in names
    page = render_html(doc)
    assert 'data-state="loading"' in page and "no warmup yet" in page


def test_html_page_shows_state_tables_and_escapes() -> None:
    sup = FakeSup()
    sup.history = [{"wall_time": 1.7e9, "cause": "hang", "detail": "<script>x</script>",
                    "counted": True}]
    page = render_html(doc_with([GpuSampled({"index": 0, "util_percent": 97})], sup))
    assert 'id=state data-state="ready"' in page
    assert "&lt;script&gt;" in page and "<script>" not in page
    assert "util_percent" in page and "97" in page
    assert "<td>256</td><td>4</td><td>40.0</td>" in page
    assert "(hidden)" in page and "s3cret" not in page


@pytest.fixture
def api() -> Iterator[tuple[StatusApi, FakeSup, Clock]]:
    sup, clock = FakeSup(), Clock()
    tel = Telemetry(clock=clock)
    a = StatusApi(lambda: status_document(sup, tel), clock=clock)
    a.start("127.0.0.1", 0)
    yield a, sup, clock
    a.stop()


def get(a: StatusApi, path: str) -> tuple[int, str, str]:
    host, port = a.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read().decode()
    finally:
        conn.close()


def test_endpoints(api: tuple[StatusApi, FakeSup, Clock]) -> None:
    a, sup, clock = api
    assert get(a, "/livez")[0] == 200
    assert get(a, "/readyz")[:1] == (200,)
    code, ctype, body = get(a, "/status")
    assert code == 200 and ctype == "application/json"
    assert json.loads(body)["state"] == "ready"
    code, ctype, body = get(a, "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    fams = parse(body)
    assert "qwen4090_ready" in fams and "process_resident_memory_bytes" in fams
    code, ctype, body = get(a, "/")
    assert code == 200 and ctype.startswith("text/html") and "qwen4090" in body
    assert get(a, "/nope")[0] == 404
    sup.state = "degraded"
    code, _, body = get(a, "/readyz")
    assert code == 503 and body.startswith("degraded: ")
    clock.t += httpapi.LOOP_STALL_SECONDS + 1
    code, _, body = get(a, "/livez")
    assert code == 503 and "stalled" in body
    a.beat()
    assert get(a, "/livez")[0] == 200


def test_a_broken_document_is_a_500_not_a_dead_endpoint(
        api: tuple[StatusApi, FakeSup, Clock]) -> None:
    a, sup, _ = api

    def boom() -> dict[str, Any]:
        raise ValueError("bug")

    sup.snapshot = boom  # type: ignore[method-assign]
    assert get(a, "/status")[0] == 500
    assert get(a, "/livez")[0] == 200


def test_a_client_that_leaves_before_its_answer_is_no_error() -> None:
    # a balancer's health check that reset the connection once it had read enough
    from tests.support.fakes import Log

    log = Log()
    a = StatusApi(lambda: {"ready": True, "state": "ready"}, clock=Clock(), log=log)

    class Gone:
        path = "/readyz"

        def __getattr__(self, name: str) -> Any:
            def call(*args: Any) -> None:
                raise BrokenPipeError(32, "Broken pipe")
            return call

    a.handle(Gone())  # type: ignore[arg-type]
    assert log.events == []


class Parts:
    def __init__(self) -> None:
        self.clock = Clock()
        self.wall = lambda: 1.7e9
        self.listeners: list[Any] = []


def test_start_binds_from_config_and_a_busy_port_is_not_fatal() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        sup = FakeSup(from_dict({"status": {"port": busy}}))
        log = Log()
        a = cli.start_status(sup, log)
        assert a.server is None
        assert log.names()[-1] == "status_endpoint_failed"
        assert len(sup.p.listeners) == 1
        a.beat()


def test_start_disabled() -> None:
    sup = FakeSup(from_dict({"status": {"enabled": False}}))
    log = Log()
    assert cli.start_status(sup, log).server is None
    assert log.names()[-1] == "status_endpoint_off"
