"""What vLLM is launched with, and why: the one resolver of the launch settings.

The daemon's preflight (gpu.py) and ``qwen4090 plan`` both call :func:`read_facts` and then
:func:`resolve`, so on the same inputs they see the same GPU under the same name, one
fingerprint and the same argv.  Each step works on the result of the one before:

1. the configured values;
2. the OOM limits learned from earlier restarts (learned.json), for this model and GPU only;
3. the standby's mode: ``restart.standby = "auto"`` (the default) resolved by autostandby.py
   on the GPU, the plan and the host's memory (``sleep``, with a default
   gpu_memory_utilization perhaps lowered to make room, or ``off``); from here on the config
   holds the concrete mode, and the Launch why (:attr:`Launch.standby_why`);
4. "auto" limits chosen by the KV-cache plan (plan.py), when the GPU and the model are known
   and ``gpu.enabled`` is not "off" (with it off the plan is only shown, never applied);
5. sleep mode (``restart.standby = "sleep"``): every engine may sleep (the standby, and the
   serving engine while a new standby starts);
6. the fixed KV budget of the last good start (``restart.fixed_kv_budget``, kvbudget.py);
7. the engine's address (:attr:`Launch.engine`, launchvalue.engine_endpoint): with the front
   off, the client address (``vllm.host:vllm.port``); behind the front, one of the two
   loopback engine ports (``front.engine_port`` and the one above it), the one no other engine
   listens on.

The config in a Launch keeps the client address: only the Launch's ``engine`` and its argv say
where vLLM listens, and the probes, the port checks and the child record read it there.

:func:`resolve` is pure (facts in, a :class:`Launch` out); :func:`read_facts` does the I/O.
The value it makes (Launch, Endpoint, where engines may listen, what a relaunch changes) is
launchvalue.py's, apart from this resolver so that what only holds a Launch (the supervisor,
its runs, the parts' contracts) loads none of learned, kvbudget and runtime.  The commands
that show and reset what a launch gets, ``plan`` and ``reset-learned``, are plancmd.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwen4090.launching import autostandby, kvbudget, learned, plan, runtime
from qwen4090.launching.launchvalue import Endpoint, Launch, Origin, Setting, engine_endpoint
from qwen4090.launching.plan import GpuMemory, HostMemory, ModelFacts
from qwen4090.settings.config import AUTO, Config, VllmConfig

# The limits a launch may get from somewhere other than the config.
LIMIT_KEYS = learned.KEYS
KV_KEY = "kv_cache_memory_bytes"


@dataclass(frozen=True)
class Facts:
    """What the launch depends on besides the config (read by :func:`read_facts`)."""

    gpu: GpuMemory | str  # the one GPU description; a str says why there is none
    model: ModelFacts | str = "no GPU to plan for"  # a str says why there is no plan
    learned: Mapping[str, Any] = field(default_factory=dict)  # learned.json
    kv_budget: Mapping[str, Any] = field(default_factory=dict)  # kv_budget.json
    runtime: str = ""  # "vllm 0.26.0" of vllm.command's venv (the KV budget belongs to it)
    runtime_dir: str = ""  # that venv's real directory (runtime.runtime_dir)
    # the host's memory (plan.host_memory): restart.standby = "auto" and a sleeping standby's
    # account; a str says why it is not known
    host: HostMemory | str = "no host facts"


def fingerprint(cfg: Config, gpu: GpuMemory | str) -> dict[str, Any]:
    """What learned settings belong to: the model's memory settings and the GPU; no GPU when
    gpu.enabled = "off" or none is known (the ladder runs on vLLM's error texts alone)."""
    if cfg.gpu.enabled == "off" or isinstance(gpu, str):
        return learned.fingerprint(cfg, "", 0)
    return learned.fingerprint(cfg, gpu.name, gpu.total_bytes)


def read_facts(cfg: Config, env: Mapping[str, str], gpu: GpuMemory | str | None = None,
               model: ModelFacts | str | None = None,
               host: HostMemory | str | None = None) -> Facts:
    """The GPU (gpu.memory_gib, else NVML with the binding of vllm.command's venv; `gpu` when
    the caller has it, as `plan --gpu-memory`), the model (only when the GPU is known), the
    learned limits and the KV budget on disk (in learned.state_dir), and the host's memory
    (plan.host_memory; `host` when the caller has it: a standby is resolved on the facts of
    the engine it stands by)."""
    if gpu is None:
        gpu = plan.gpu_memory(cfg) if cfg.gpu.enabled != "off" else "gpu.enabled = off"
    if model is None:
        model = read_model(cfg) if isinstance(gpu, GpuMemory) else "no GPU to plan for"
    if host is None:
        host = plan.host_memory()
    state = learned.state_dir(cfg, env)
    kv = kvbudget.KvBudget(state).read() if cfg.restart.fixed_kv_budget else {}
    return Facts(gpu, model, learned.LearnedStore(state).read(), kv, runtime_of(cfg),
                 runtime_dir=runtime.runtime_dir(cfg.vllm.command), host=host)


def runtime_of(cfg: Config) -> str:
    """vLLM's package and version in vllm.command's venv ("" when unknown): another vLLM may
    profile another KV size, so a budget is kept per version (an upgrade profiles again)."""
    venv = runtime.venv_of(cfg.vllm.command)
    found = runtime.runtime_version(venv) if venv is not None else None
    return " ".join(found) if found else ""


def read_model(cfg: Config) -> ModelFacts | str:
    d = Path(cfg.vllm.model).expanduser()
    if not (d / "config.json").is_file():
        return f"{d} is not a local model directory"
    try:
        return plan.read_model(d)
    except plan.PlanError as e:
        return str(e)


def configured(cfg: Config, beside: Endpoint | None = None) -> Launch:
    """The launch as configured, nothing learned, planned or remembered (no GPU part; so
    restart.standby = "auto" is off until a launch is resolved on the facts)."""
    return resolve(cfg, Facts("no GPU part", "no GPU part", host="no host facts"), beside)


def resolve(cfg: Config, facts: Facts, beside: Endpoint | None = None) -> Launch:
    """The launch for this config on these facts, and where each limit came from; the engine
    listens on :func:`engine_endpoint` (``beside``: the endpoint another engine holds)."""
    fp = fingerprint(cfg, facts.gpu)
    settings = {k: Setting(getattr(cfg.vllm, k), Origin.CONFIGURED) for k in LIMIT_KEYS}
    taught, notes = learned.applied(cfg, facts.learned, fp)
    for k in _changed(cfg, taught):
        why = next((n for n in notes if n.startswith(k + " ")), "")
        settings[k] = Setting(getattr(taught.vllm, k), Origin.LEARNED, why)
    standby_why = ""
    if cfg.restart.standby == AUTO:  # from here on the launch has the concrete mode
        choice = autostandby.choose(taught, facts.gpu, facts.model, facts.host)
        taught, standby_why = autostandby.applied(taught, choice), choice.why
        if choice.utilization is not None:
            settings["gpu_memory_utilization"] = Setting(choice.utilization, Origin.PLAN,
                                                         autostandby.LOWERED_WHY)
    chosen, the_plan, no_plan = taught, None, ""
    if isinstance(facts.gpu, GpuMemory):
        if isinstance(facts.model, ModelFacts):
            the_plan = plan.make_plan(taught, facts.model, facts.gpu)
            if cfg.gpu.enabled != "off":
                chosen = plan.resolved(taught, the_plan)
        else:
            no_plan = facts.model
    for k in _changed(taught, chosen):
        assert the_plan is not None
        settings[k] = Setting(getattr(chosen.vllm, k), Origin.PLAN, the_plan.chosen.get(k, ""))
    # sleep mode first: the budget is recorded with the flags the engine ran with (a budget
    # looked up without the flag missed: the H200's standby profiled its own KV cache)
    chosen = with_sleep_mode(chosen)
    kv_base = {**fp, "runtime": facts.runtime}
    n, kv_note = kvbudget.budget(chosen, facts.kv_budget, kv_base)
    if n is not None:
        settings[KV_KEY] = Setting(n, Origin.KV_BUDGET, kv_note or "")
        chosen = kvbudget.with_budget(chosen, n)
    engine = engine_endpoint(chosen, beside)
    argv = tuple(render_argv(chosen.vllm, (engine.host, engine.port)))
    return Launch(config=chosen, argv=argv, engine=engine, settings=settings, gpu=facts.gpu,
                  fingerprint=fp, kv_base=kv_base, plan=the_plan, no_plan=no_plan,
                  learned=tuple(notes), kv_budget=n, kv_note=kv_note, runtime=facts.runtime,
                  runtime_dir=facts.runtime_dir, host=facts.host,
                  standby_configured=cfg.restart.standby, standby_why=standby_why)


SLEEP_FLAG = "--enable-sleep-mode"
# vLLM serves /sleep, /wake_up and /is_sleeping only in its development mode; the front never
# passes those paths on (front.ENGINE_ONLY), so only the supervisor reaches them.
DEV_MODE = "VLLM_SERVER_DEV_MODE"


def with_sleep_mode(cfg: Config) -> Config:
    """With ``restart.standby = "sleep"`` every engine is started able to sleep: the standby
    sleeps until a failover, and the serving engine sleeps while a new standby starts."""
    if cfg.restart.standby != "sleep" or SLEEP_FLAG in cfg.vllm.extra_args:
        return cfg
    return dataclasses.replace(cfg, vllm=dataclasses.replace(
        cfg.vllm, extra_args=[*cfg.vllm.extra_args, SLEEP_FLAG],
        env={**cfg.vllm.env, DEV_MODE: "1"}))


def render_argv(v: VllmConfig, at: tuple[str, int] | None = None) -> list[str]:
    """The vLLM command line for a config: a list, never a shell string, never a secret.
    ``at``: where this engine listens (Launch.engine), when not ``v``'s own address
    (behind the front, a loopback port of the engines' own)."""
    host, port = at if at is not None else (v.host, v.port)
    argv = [*v.command, "--model", v.model, "--served-model-name", v.served_model_name,
            "--host", host, "--port", str(port), "--dtype", v.dtype]
    if v.quantization:
        argv += ["--quantization", v.quantization]
    for flag, value in (("--max-model-len", v.max_model_len),
                        ("--max-num-seqs", v.max_num_seqs),
                        ("--max-num-batched-tokens", v.max_num_batched_tokens),
                        ("--block-size", v.block_size)):
        if value != AUTO:
            argv += [flag, str(value)]
    argv += ["--gpu-memory-utilization", f"{v.gpu_memory_utilization:g}",
             "--kv-cache-dtype", v.kv_cache_dtype,
             "--enable-prefix-caching" if v.enable_prefix_caching
             else "--no-enable-prefix-caching",
             "--enable-chunked-prefill" if v.enable_chunked_prefill
             else "--no-enable-chunked-prefill"]
    if v.enforce_eager:
        argv.append("--enforce-eager")
    if v.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(v.tensor_parallel_size)]
    return argv + list(v.extra_args)


def _changed(before: Config, after: Config) -> list[str]:
    if before is after:
        return []
    return [k for k in LIMIT_KEYS if getattr(before.vllm, k) != getattr(after.vllm, k)]
