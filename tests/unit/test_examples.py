"""packaging/examples refer only to metrics that qwen4090 exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qwen4090.httpapi import VLLM_COUNTERS, VLLM_GAUGES, _vllm_name, metric_families

EXAMPLES = Path(__file__).resolve().parents[2] / "packaging" / "examples"


def exported() -> set[str]:
    doc = {"state": "ready", "ready": True, "time_to_ready_seconds": 1.0,
           "warmup": {"ok": True, "seconds": 1.0, "rows": []}, "supervisor": {}}
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
    used = {m for e in exprs for m in re.findall(r"\bqwen4090_[a-z_]+\b", e)}
    used -= {m for m in used if m.startswith("qwen4090_gpu_")}  # fields of the GPU sampler
    assert used and used <= exported(), used - exported()
