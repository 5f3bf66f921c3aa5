"""packaging/examples refer only to metrics that qwen4090 exports, the GPU's included: those
come from a real NVML sample (probes/nvml.py over a fake pynvml), as the watch emits it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_gpu_joints import load_fake

from qwen4090.probes import nvml
from qwen4090.surfaces.httpapi import VLLM_COUNTERS, VLLM_GAUGES, _vllm_name, metric_families

EXAMPLES = Path(__file__).resolve().parents[2] / "packaging" / "examples"
# A selector by name pattern, as the dashboard's GPU panels use: {__name__=~"qwen4090_gpu_..."}
NAME_PATTERN = re.compile(r'__name__=~\\?"([^"\\]+)\\?"')


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", load_fake())
    monkeypatch.setattr(nvml, "_initialized", False)


def exported() -> set[str]:
    sample = nvml.sample(0)
    assert not isinstance(sample, str), sample
    doc = {"state": "ready", "ready": True, "time_to_ready_seconds": 1.0,
           "warmup": {"ok": True, "seconds": 1.0, "rows": []}, "supervisor": {},
           "gpu": sample.metrics(0),
           "standby": {"mode": "sleep", "state": "ready", "ready": True, "failovers": 1,
                       "fallbacks": 0, "rebuilds": 1,
                       "last_failover": {"cause": "hang", "ok": True, "seconds": 1.4,
                                         "wake_seconds": 0.5, "kv_tokens": None}}}
    names = set()
    for fam in metric_families(doc):
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "info":
            names.add(fam.name + "_info")
    names |= {_vllm_name(n) for n in VLLM_GAUGES}
    names |= {_vllm_name(n) + "_total" for n in VLLM_COUNTERS}
    return names


def test_dashboard_and_scrape_example_use_exported_names() -> None:
    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]]
    exprs.append((EXAMPLES / "prometheus-scrape.yml").read_text())
    names = exported()
    patterns = {p for e in exprs for p in NAME_PATTERN.findall(e)}
    unmatched = {p for p in patterns if not any(re.fullmatch(p, n) for n in names)}
    assert patterns and not unmatched, (unmatched, sorted(names))
    plain = [NAME_PATTERN.sub("", e) for e in exprs]
    used = {m for e in plain for m in re.findall(r"\bqwen4090_[a-z_]+\b", e)}
    assert used and used <= names, used - names


def test_the_demos_config_draws_no_warning_from_check_config() -> None:
    # issue 31.7: scripts/demo-config.sh's config warned that its health_timeout 5 was above
    # its poll_interval 2 (README's first command serves it)
    from tests.support.runtime import demo_config

    from qwen4090.launching.configrisk import config_warnings
    from qwen4090.settings.config import from_dict
    assert config_warnings(from_dict(demo_config(8000)), env={}) == []
