"""Operability against the real supervisor and the real CPU vLLM (one daemon, two vLLM starts).

In file order: the endpoint while loading and when READY, /metrics, `qwen4090 status`, the page
in headless Chromium, `qwen4090 bench` with a tiny workload, probe access lines kept out of the
log, then a SIGKILLed EngineCore: /readyz flips to 503 and back, /metrics counts the restart;
last, SIGTERM and `qwen4090 status` says "not running".
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import Daemon
from tests.support.runtime import REPO, cpu_config, free_port, write_toml

START_TIMEOUT = 300.0


def _port(candidates: range) -> int:
    """A free port in our range (the project's convention for this suite), else any."""
    import socket

    for p in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    return free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("operability")
    vllm_port = _port(range(18340, 18360))
    status_port = _port(range(18360, 18380))
    cfg = write_toml(tmp / "qwen4090.toml", cpu_config(
        vllm_port, status={"enabled": True, "port": status_port},
        warmup={"lengths": [1, 16, 256], "concurrency": [1, 4]},
        watch={"poll_interval": 1.0, "canary_interval": 3.0}))
    d = Daemon(cfg, tmp)
    d.cfg_path = cfg  # type: ignore[attr-defined]
    d.vllm_port = vllm_port  # type: ignore[attr-defined]
    d.status_port = status_port  # type: ignore[attr-defined]
    yield d
    d.close()


def get(d: Daemon, path: str, timeout: float = 5.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", d.status_port,  # type: ignore[attr-defined]
                                      timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def until(pred: Callable[[], Any], timeout: float, what: str, d: Daemon) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = pred()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)  # polling an HTTP endpoint: there is nothing to wait on
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last log lines:\n"
                         + "\n".join(d.raw[-30:]))


def qwen4090(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "daemon")}
    return subprocess.run([sys.executable, "-m", "qwen4090", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def status_cmd(d: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    return qwen4090("status", "--config", str(d.cfg_path), *extra)  # type: ignore[attr-defined]


def metrics(d: Daemon) -> dict[str, list[Any]]:
    code, text = get(d, "/metrics")
    assert code == 200
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_not_ready_while_starting(daemon: Daemon) -> None:
    until(lambda: get(daemon, "/livez")[0] == 200, 60, "/livez", daemon)
    doc = json.loads(get(daemon, "/status")[1])
    if doc["state"] == "ready":
        pytest.skip("vLLM was READY before the first look (nothing to see while starting)")
    assert get(daemon, "/readyz")[0] == 503
    r = status_cmd(daemon)
    assert r.returncode in (0, 1), r.stderr  # it may just have become ready
    if r.returncode == 1:
        assert "READY" not in r.stdout.splitlines()[0]


def test_ready_endpoint_contents(daemon: Daemon) -> None:
    until(lambda: get(daemon, "/readyz")[0] == 200, START_TIMEOUT, "/readyz 200", daemon)
    doc = json.loads(get(daemon, "/status")[1])
    assert doc["state"] == "ready" and doc["ready"] is True
    assert doc["child_pid"] == daemon.last_child_pid()
    assert doc["model"] == "tiny"
    assert doc["config"]["vllm"]["port"] == daemon.vllm_port  # type: ignore[attr-defined]
    assert doc["config"]["status"]["port"] == daemon.status_port  # type: ignore[attr-defined]
    assert doc["warmup"]["ok"] is True
    # the lengths asked for, then the longest engine step the settings allow (a
    # max_num_batched_tokens prefill, capped below max_model_len: issue 18.5), then the batch
    assert [(r["length"], r["concurrency"]) for r in doc["warmup"]["rows"]] == [
        (1, 1), (16, 1), (256, 1), (2044, 1), (256, 4)]
    assert doc["time_to_ready_seconds"] > 0
    assert doc["restarts"] == 0 and doc["history"] == []
    assert "gpu" in doc  # None here: no GPU sampler on this machine
    doc = until(lambda: (d := json.loads(get(daemon, "/status")[1]))["vllm_metrics"] and d,
                30, "a vLLM metrics poll in /status", daemon)
    assert "vllm:num_requests_running" in doc["vllm_metrics"]


def test_metrics_when_ready(daemon: Daemon) -> None:
    fams = until(lambda: (m := metrics(daemon)).get("qwen4090_vllm_num_requests_running") and m,
                 30, "vLLM gauges in /metrics", daemon)
    assert fams["qwen4090_ready"][0].value == 1.0
    state = {s.labels["state"]: s.value for s in fams["qwen4090_state"]}
    assert state["ready"] == 1.0 and sum(state.values()) == 1.0
    ttft = {s.labels["length"] for s in fams["qwen4090_warmup_ttft_seconds"]}
    assert ttft == {"1", "16", "256", "2044"}
    assert fams["qwen4090_time_to_ready_seconds"][0].value > 0
    restarts = [s for s in fams["qwen4090_restarts"] if s.name.endswith("_total")]
    assert restarts and sum(s.value for s in restarts) == 0
    assert fams["process_resident_memory_bytes"][0].value > 0


def test_status_command_ready(daemon: Daemon) -> None:
    r = status_cmd(daemon)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("qwen4090: READY")
    assert "warmup    ok" in r.stdout
    r = status_cmd(daemon, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "ready"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
                       capture_output=True, timeout=600, env={**os.environ,
                                                             "DEBIAN_FRONTEND": "noninteractive"})
        path = shutil.which("chromium")
        if path:
            return path
    pytest.skip("no Chromium and it could not be installed (apt-get install chromium)")


def test_status_page_in_headless_chromium(daemon: Daemon) -> None:
    browser = chromium()
    url = f"http://127.0.0.1:{daemon.status_port}/"  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--no-first-run", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync",
                            f"--user-data-dir={profile}", "--dump-dom", url],
                           capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert 'data-state="ready"' in dom
    assert "<title>qwen4090: ready</title>" in dom
    assert "Warmup" in dom and "<td>256</td><td>4</td>" in dom
    assert "no restarts" in dom


def test_the_bench_resolves_the_platform_the_server_does(tmp_path: Path) -> None:
    """`qwen4090 bench` runs vLLM's CLI behind a prelude (bench.CLI_PRELUDE) with the server's
    environment (bench.bench_env); its vLLM must resolve the platform that a plain import
    resolves, CpuPlatform.  Under the old prelude it resolved UnspecifiedPlatform, which loads
    vllm._C, the AVX-512 kernels: on a CPU without AVX-512 every `vllm bench serve` died of
    SIGILL (issue 18.9); on this one it shows as the platform's name."""
    from qwen4090.commandline import bench
    from qwen4090.settings import config

    cfg = config.load(write_toml(tmp_path / "q.toml", cpu_config(free_port())))
    argv = bench.bench_command(cfg, None)
    assert argv[1] == "-c" and argv[2].startswith(bench.METADATA_ALIAS)
    probe = "from vllm.platforms import current_platform\nprint(type(current_platform).__name__)\n"
    env = bench.bench_env(cfg, os.environ)
    found = {}
    for name, code in (("bench", bench.METADATA_ALIAS + probe), ("plain", probe)):
        r = subprocess.run([argv[0], "-c", code], capture_output=True, text=True, env=env,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr[-2000:]
        found[name] = r.stdout.strip().splitlines()[-1]
    assert found == {"bench": "CpuPlatform", "plain": "CpuPlatform"}


def test_bench_with_a_tiny_workload(daemon: Daemon, tmp_path: Path) -> None:
    # READY first, so that the test also runs alone (-k), not only after the ones above
    until(lambda: get(daemon, "/readyz")[0] == 200, START_TIMEOUT, "/readyz 200", daemon)
    r = qwen4090("bench", "--config", str(daemon.cfg_path),  # type: ignore[attr-defined]
                 "--concurrency", "1,2", "--short", "20-40", "--long", "100-200",
                 "--max-tokens", "8", "--num-prompts", "5", "--slo-ttft-p99-ms", "60000",
                 "--keep", str(tmp_path), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("concurrency"))
    assert "TTFT p50 ms" in lines[head] and "output tok/s" in lines[head]
    rows = [ln.split() for ln in lines[head + 2:head + 4]]
    assert [r[:2] for r in rows] == [["1", "5/5"], ["2", "5/5"]]
    assert all(r[6] == "0" for r in rows)  # errors
    assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows)
    assert "SLO met" in r.stdout
    assert (tmp_path / "c2-long.json").is_file()


def test_no_access_line_is_relogged_and_the_front_says_each_request_at_debug(
        daemon: Daemon) -> None:
    # issue 31.6: vLLM's access lines behind the front name only 127.0.0.1 and cost journald a
    # line each: the probes' are dropped, the users' go at debug (log.vllm_level here: info);
    # the front's own "request" line names the client (log.level here: debug)
    daemon.wait_state("ready", 600)
    conn = http.client.HTTPConnection("127.0.0.1", daemon.vllm_port,  # type: ignore[attr-defined]
                                      timeout=120)
    try:  # a request of this test's own: the module's others may not have run (-k)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}),
            {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    daemon.wait_event("request", 30, path="/v1/completions")
    with daemon.lock:
        events = list(daemon.events)
    access = [str(ev.get("event")) for ev in events if " HTTP/1.1\" " in str(ev.get("event"))]
    assert access == [], access[:3]
    mine = [ev for ev in events if ev.get("event") == "request"]
    assert any(ev.get("path") == "/v1/completions" and ev.get("status") == 200
               and ev.get("client") == "127.0.0.1" and ev.get("level") == "debug"
               for ev in mine), mine[:3]


def test_readyz_flips_during_a_restart_and_metrics_count_it(daemon: Daemon) -> None:
    engine = daemon.engine_core()
    mark = daemon.mark()
    engine.send_signal(signal.SIGKILL)
    until(lambda: get(daemon, "/readyz")[0] == 503, 60, "/readyz 503 after SIGKILL", daemon)
    r = status_cmd(daemon)
    assert r.returncode == 1, r.stdout
    daemon.wait_state("ready", START_TIMEOUT, after=mark)
    until(lambda: get(daemon, "/readyz")[0] == 200, 30, "/readyz 200 again", daemon)
    fams = metrics(daemon)
    restarts = {s.labels["cause"]: s.value for s in fams["qwen4090_restarts"]
                if s.name.endswith("_total")}
    # vLLM's line that its engine died restarts it, unless the idle canary notices first.
    assert sum(restarts.values()) == 1, restarts
    (cause,) = [c for c, n in restarts.items() if n == 1]
    assert cause in ("engine_dead", "canary"), restarts
    doc = json.loads(get(daemon, "/status")[1])
    assert doc["restarts"] == 1 and doc["history"][0]["cause"] == cause
    assert status_cmd(daemon).returncode == 0


def test_not_running_after_stop(daemon: Daemon) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0
    r = status_cmd(daemon)
    assert r.returncode == 3 and "not running" in r.stdout
