"""The Launch value: what one vLLM is launched with, where its engine listens, and why.

Values and pure helpers on them only: :class:`Launch` (the final config, the argv, the
engine's :class:`Endpoint`, where each limit came from: :class:`Setting`), the engines'
addresses (:func:`engine_endpoints`, :func:`engine_endpoint`) and what launching one instead of
another changes (:func:`relaunch_changes`).  Resolving a Launch (the learned limits, the
KV-cache plan, the KV budget, the runtime: files and NVML) is launch.py's; the supervisor, its
runs and the parts only hold and compare Launches, so they take them from here and load none
of the resolver (issue 29: what importing the supervisor loads).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from qwen4090.base.vllmfacts import host_port
from qwen4090.launching.plan import GpuMemory, HostMemory, Plan
from qwen4090.settings.config import Config


class Origin(enum.Enum):
    CONFIGURED = "configured"
    PLAN = "auto"  # "auto" chosen by the KV-cache plan
    LEARNED = "learned"  # an OOM limit learned from an earlier restart
    KV_BUDGET = "kv budget"  # the fixed KV budget of the last good start


@dataclass(frozen=True)
class Setting:
    value: object
    origin: Origin
    why: str = ""

    def as_json(self) -> dict[str, object]:
        return {"value": self.value, "source": self.origin.value, "why": self.why}


@dataclass(frozen=True)
class Endpoint:
    """Where one engine listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return host_port(self.host, self.port)


@dataclass(frozen=True)
class Launch:
    config: Config  # what vLLM is launched with: every setting final (vllm.host/port: clients')
    argv: tuple[str, ...]  # its command line (launch.render_argv of config.vllm at engine)
    engine: Endpoint  # where this engine listens (engine_endpoint)
    settings: dict[str, Setting]  # launch.LIMIT_KEYS (+ launch.KV_KEY when given)
    gpu: GpuMemory | str  # the one GPU description; a str says why there is none
    fingerprint: dict[str, Any]  # what learned settings belong to
    kv_base: dict[str, Any] = field(default_factory=dict)  # ... and the KV budget (+ runtime)
    plan: Plan | None = None
    no_plan: str = ""  # why there is no plan (when the GPU is known)
    learned: tuple[str, ...] = ()  # one line per learned value applied or ignored
    kv_budget: int | None = None  # --kv-cache-memory-bytes given to this launch
    kv_note: str | None = None  # the budget given, or why the remembered one was not
    runtime: str = ""  # "vllm 0.26.0": what vllm.command's venv held at the launch
    # ... and the directory that venv was (install-runtime switches a symlink: a reinstall of
    # the same version is another runtime, issue 31.7)
    runtime_dir: str = ""
    # the host's memory it was resolved on (a standby beside it, and a reload's comparison,
    # are resolved on the same: auto's choice changes only at a serving engine's launch)
    host: HostMemory | str = "no host facts"
    standby_configured: str = "off"  # restart.standby as configured ("auto" among them)
    standby_why: str = ""  # why "auto" resolved to :attr:`standby` ("" when not auto)

    @property
    def gpu_name(self) -> str:
        return self.gpu.name if isinstance(self.gpu, GpuMemory) else "none"

    @property
    def standby(self) -> str:
        """The standby's mode this launch has: "off", "sleep" or "awake" ("auto" resolved)."""
        return self.config.restart.standby


def engine_endpoints(cfg: Config) -> tuple[Endpoint, ...]:
    """Where engines may listen.  With the front off, the client address: one engine, no
    standby.  Behind the front, two loopback ports that the serving engine and a standby take
    in turn (after a failover the standby serves on its own port; the next one starts on the
    other)."""
    if not cfg.front.enabled:
        return (Endpoint(cfg.vllm.host, cfg.vllm.port),)
    port = cfg.front.engine_port
    return Endpoint("127.0.0.1", port), Endpoint("127.0.0.1", port + 1)


def engine_endpoint(cfg: Config, beside: Endpoint | None = None) -> Endpoint:
    """The endpoint of an engine started while ``beside`` listens (a standby beside the
    serving engine); None: the first, where a serving engine starts when no other runs."""
    ends = engine_endpoints(cfg)
    return next((e for e in ends if e != beside), ends[0])


def relaunch_changes(a: Launch, b: Launch) -> str:
    """What launching ``b`` instead of ``a`` changes for vLLM: the flags of its command line
    that differ, its environment ([vllm] env, the API key file); "" when nothing (the one rule
    of what a reload restarts: reloading.relaunch_reason)."""
    out: list[str] = []
    if a.argv != b.argv:
        fa, fb = _flags(a.argv), _flags(b.argv)
        flags = [f"{k} {fa.get(k, '(none)')} -> {fb.get(k, '(none)')}"
                 for k in sorted({*fa, *fb}) if fa.get(k) != fb.get(k)]
        out += flags or ["vLLM's command line"]
    va, vb = a.config.vllm, b.config.vllm
    if va.env != vb.env:
        out.append("vllm.env")
    if va.api_key_file != vb.api_key_file:
        out.append("vllm.api_key_file")
    return ", ".join(out)


def _flags(argv: tuple[str, ...]) -> dict[str, str]:
    """``--flag value`` (or a bare ``--flag``: "on") pairs of a command line, for a message."""
    out: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = nxt if nxt and not nxt.startswith("--") else "on"
            out[arg] = f"{out[arg]} {value}" if arg in out else value
    return out
