"""Where a sysadmin sees the standby engine (restart.standby, issue 21): the line of `qwen4090
status`, the status page's Standby table and the qwen4090_standby_* / failover families of
/metrics, all from the snapshot's "standby" (absent in older daemons: mode off)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from test_httpapi import FakeSup, doc_with, parse
from test_statuscmd import DOC

from qwen4090.commandline import statuscmd
from qwen4090.surfaces import httpapi
from qwen4090.surfaces.httpapi import STANDBY_STATES, metric_families, render_html, standby_summary

READY: dict[str, Any] = {
    "mode": "sleep", "state": "ready", "ready": True, "pid": 1234, "port": 18001,
    "seconds": 300.0, "kv_tokens": 28672, "failovers": 2, "fallbacks": 0, "rebuilds": 2,
    "last_failover": {"cause": "hang", "ok": True, "seconds": 1.4, "wake_seconds": 0.48,
                      "kv_tokens": 28672},
    "detail": "asleep since the last rebuild"}
WAITING: dict[str, Any] = {
    "mode": "sleep", "state": "waiting", "ready": False, "pid": None, "port": None,
    "seconds": 4.2, "kv_tokens": None, "failovers": 1, "fallbacks": 1, "rebuilds": 0,
    "last_failover": {"cause": "crash", "ok": False, "seconds": 3.1, "wake_seconds": 3.0,
                      "kv_tokens": None},
    "detail": "rebuild after a failover: waiting for 10 s without a request"}
NEVER: dict[str, Any] = {
    "mode": "awake", "state": "starting", "ready": False, "pid": 99, "port": 18001,
    "seconds": 12.0, "kv_tokens": None, "failovers": 0, "fallbacks": 0, "rebuilds": 0,
    "last_failover": None, "detail": "first start"}
OFF: dict[str, Any] = {**NEVER, "mode": "off", "state": "none", "pid": None, "port": None}


# --- `qwen4090 status` ------------------------------------------------------------------------


def test_status_says_a_standby_is_ready_and_what_the_failovers_did() -> None:
    text = statuscmd.summary({**DOC, "standby": READY}, now=1060.0)
    assert "  standby   ready (asleep, pid 1234, port 18001, 28,672 KV tokens); 2 failovers, " \
           "2 rebuilds, last: hang, back in 1.4 s (woke in 0.48 s)" in text.splitlines()
    assert len(text.splitlines()) <= 14
    assert statuscmd.exit_code({**DOC, "standby": READY}) == 0


def test_status_says_what_a_standby_not_ready_is_doing_and_why() -> None:
    text = statuscmd.summary({**DOC, "standby": WAITING}, now=1060.0)
    assert "  standby   not ready: waiting for a quiet moment to start, 4.2 s so far (rebuild " \
           "after a failover: waiting for 10 s without a request); 1 failover, 1 fallback to " \
           "a restart, last: crash, fell back to a restart after 3.1 s" in text.splitlines()
    awake = standby_summary(NEVER)
    assert awake == "not ready: starting, 12.0 s so far, pid 99 (first start); 0 failovers"
    assert standby_summary({**NEVER, "state": "failed", "pid": None, "detail": "OOM"}) == \
        "not ready: FAILED, 12.0 s so far (OOM); 0 failovers"
    assert standby_summary({**READY, "state": "sleeping", "ready": False, "failovers": 0,
                            "rebuilds": 0, "last_failover": None, "detail": ""}) == \
        "not ready: going to sleep, 300.0 s so far, pid 1234; 0 failovers"
    assert standby_summary({**READY, "mode": "awake", "state": "ready", "last_failover": None,
                            "rebuilds": 0, "failovers": 1}).startswith(
        "ready (awake, pid 1234, port 18001, 28,672 KV tokens); 1 failover")


def test_a_standby_is_never_serving_by_itself() -> None:
    # the exit code is the serving engine's: a ready standby does not make a restart READY
    assert statuscmd.exit_code({**DOC, "state": "restarting", "standby": READY}) == 1


@pytest.mark.parametrize("doc", [DOC, {**DOC, "standby": OFF}, {**DOC, "standby": None}])
def test_no_standby_line_when_off_or_from_an_older_daemon(doc: dict[str, Any]) -> None:
    assert "standby" not in statuscmd.summary(doc, now=1060.0)


# --- /metrics ---------------------------------------------------------------------------------


def scrape(standby: dict[str, Any] | None) -> dict[str, list[Any]]:
    sup = FakeSup()
    base = sup.snapshot
    if standby is not None:
        sup.snapshot = lambda: {**base(), "standby": standby}  # type: ignore[method-assign]
    doc = doc_with([], sup)
    reg = CollectorRegistry()
    reg.register(httpapi.Collector(lambda: doc))
    return parse(generate_latest(reg).decode())


def test_metrics_export_the_standby_and_the_failovers() -> None:
    fams = scrape(READY)
    assert fams["qwen4090_standby_ready"][0].value == 1.0
    state = {s.labels["state"]: s.value for s in fams["qwen4090_standby_state"]}
    assert set(state) == set(STANDBY_STATES) and state["ready"] == 1.0
    assert sum(state.values()) == 1.0
    fo = {s.labels["result"]: s.value for s in fams["qwen4090_failovers"]
          if s.name == "qwen4090_failovers_total"}
    assert fo == {"ok": 2.0, "fallback": 0.0}
    rebuilds = [s for s in fams["qwen4090_standby_rebuilds"]
                if s.name == "qwen4090_standby_rebuilds_total"]
    assert rebuilds[0].value == 2.0
    assert fams["qwen4090_last_failover_seconds"][0].value == 1.4


def test_metrics_of_a_standby_not_ready() -> None:
    fams = scrape(WAITING)
    assert fams["qwen4090_standby_ready"][0].value == 0.0
    state = {s.labels["state"]: s.value for s in fams["qwen4090_standby_state"]}
    assert state["waiting"] == 1.0 and state["ready"] == 0.0
    fo = {s.labels["result"]: s.value for s in fams["qwen4090_failovers"]
          if s.name == "qwen4090_failovers_total"}
    assert fo == {"ok": 1.0, "fallback": 1.0}
    assert "qwen4090_last_failover_seconds" in fams
    assert "qwen4090_last_failover_seconds" not in scrape(NEVER)
    odd = {s.labels["state"]: s.value for s in scrape({**NEVER, "state": "paused"})[
        "qwen4090_standby_state"]}
    assert odd["paused"] == 1.0  # a state this list does not know yet is still shown


@pytest.mark.parametrize("standby", [None, OFF])
def test_no_standby_families_when_off_or_from_an_older_daemon(
        standby: dict[str, Any] | None) -> None:
    names = {f.name for f in metric_families({"state": "ready", "standby": standby}
                                             if standby else {"state": "ready"})}
    assert not {n for n in names if "standby" in n or "failover" in n}


# --- the status page --------------------------------------------------------------------------


def page(standby: dict[str, Any] | None) -> str:
    sup = FakeSup()
    base = sup.snapshot
    if standby is not None:
        sup.snapshot = lambda: {**base(), "standby": standby}  # type: ignore[method-assign]
    return render_html(doc_with([], sup))


def test_status_page_shows_the_standby() -> None:
    html = page({**READY, "detail": "<b>asleep</b>"})
    assert "<h2>Standby</h2>" in html
    assert "<td>standby</td><td>ready (asleep, pid 1234, port 18001, 28,672 KV tokens)" in html
    assert "<td>state</td><td>ready</td>" in html and "<td>ready</td><td>yes</td>" in html
    assert "<td>last failover</td><td>hang: ok in 1.4 s (woke in 0.48 s), 28,672 KV " \
           "tokens</td>" in html
    assert "&lt;b&gt;asleep&lt;/b&gt;" in html and "<b>asleep</b>" not in html
    failed = page(WAITING)
    assert "<td>last failover</td><td>crash: fell back to a restart in 3.1 s" in failed
    assert "<td>ready</td><td>no</td>" in failed


@pytest.mark.parametrize("standby", [None, OFF])
def test_status_page_without_a_standby(standby: dict[str, Any] | None) -> None:
    html = page(standby)
    assert "<h2>Standby</h2>" in html and "no standby engine (restart.standby = off)" in html
    assert "<td>standby</td><td>off</td>" in html


def test_status_page_says_what_auto_chose_and_why() -> None:
    why = "no GPU (gpu.enabled = off): sleep mode needs CUDA"
    html = page({**OFF, "configured": "auto", "why": why})
    assert f"no standby engine (restart.standby = auto: off: {why})" in html
    on = page({**READY, "configured": "auto", "why": "sleeping standby: 1.0 GiB on the GPU"})
    assert "<td>configured</td><td>auto</td>" in on
    assert "<td>why</td><td>sleeping standby: 1.0 GiB on the GPU</td>" in on
