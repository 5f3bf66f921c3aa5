"""``restart.standby = "auto"`` (issue 30.1, the default): a sleeping standby where the plan
says this machine holds it, else none; pure, on the facts launch.resolve has.

The rules, in order (the first that says "off" decides, and its sentence is the why):

1. the front: a standby takes over behind it (``front.enabled = false``: off), on
   ``front.engine_port + 1`` (a port clash: off; "sleep" or "awake" are refused instead);
2. a GPU: sleep mode is CUDA's (no GPU known, or ``gpu.enabled = "off"``: off; CPU vLLM may
   set "awake");
3. a plan: the model must be planned for, and fit without a standby;
4. the GPU: the serving engine's peak and the ~1 GiB a sleeping engine keeps
   (plan.SLEEP_GPU_KEEP_BYTES) must fit.  Where they do not and no file set
   ``vllm.gpu_memory_utilization``, its default is lowered to the highest that fits, provided
   that keeps at least 1 - MAX_KV_COST of the KV tokens and the context length; a
   utilization a file set is never changed (off, and the why names the one that would fit);
5. the host: both engines pin their weights once they have slept, and each has its
   processes (plan.StandbyAccount.host_bytes, measured on the H200): at most HOST_SHARE of
   MemTotal, and at most what is free now (MemAvailable and what our own engines hold).

The choice is made at each launch of a serving engine (a standby is resolved on the host
facts of the engine it stands by: Launch.host); the journal says it once (standby_auto) and
again only when it changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qwen4090.launching import plan
from qwen4090.launching.plan import GIB, GpuMemory, HostMemory, ModelFacts
from qwen4090.settings.config import Config, standby_port_clash

# The share of MemTotal that both engines' pinned weights and processes may take.  Pinned
# memory cannot be swapped or reclaimed, so what is left must hold the OS, the supervisor and
# its pre-imported interpreter (~1 GiB), sshd and the like, and a page cache worth having: each
# start reads the weight files again (restart.readahead puts them there first).  A quarter of
# the RAM is that headroom: 8 GiB of a 32 GB box, 16 of a 64 GB one.
HOST_SHARE = 0.75
# The share of the KV tokens auto gives up for a sleeping standby by lowering a default
# gpu_memory_utilization: a failover in under a second is worth that much of the KV cache,
# not more (beyond it the sysadmin chooses: restart.standby = "sleep" and a utilization).
MAX_KV_COST = 0.15
UTIL_KEY = "vllm.gpu_memory_utilization"
LOWERED_WHY = "room for a sleeping standby (restart.standby = auto)"


@dataclass(frozen=True)
class Choice:
    """What auto resolved to: the mode, why (one line), and the gpu_memory_utilization it
    lowered the default to (None: as it was)."""

    mode: str  # "sleep" or "off"
    why: str
    utilization: float | None = None


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def choose(cfg: Config, gpu: GpuMemory | str, model: ModelFacts | str,
           host: HostMemory | str) -> Choice:
    """The mode ``restart.standby = "auto"`` resolves to for ``cfg`` (its limits as the
    launch has them so far: configured, learned) on these facts."""
    if not cfg.front.enabled:
        return Choice("off", "front.enabled = false: no front to hold clients during a "
                             "takeover")
    if clash := standby_port_clash(cfg):
        return Choice("off", f"{clash}: no port for a standby")
    if cfg.gpu.enabled == "off" or isinstance(gpu, str):
        reason = "gpu.enabled = off" if cfg.gpu.enabled == "off" else gpu
        return Choice("off", f"no GPU ({reason}): sleep mode needs CUDA; on CPU vLLM set "
                             "\"awake\" for a standby")
    if isinstance(model, str):
        return Choice("off", f"no plan: {model}")
    alone = plan.make_plan(_with(cfg, standby="off"), model, gpu)
    if not alone.fits:
        key, _ = alone.problems[0]
        return Choice("off", f"the settings do not fit the GPU even without a standby ({key}; "
                             "qwen4090 plan shows the account)")
    util: float | None = None
    sleeping = plan.make_plan(_with(cfg, standby="sleep"), model, gpu)
    acc = sleeping.standby
    assert acc is not None
    if not acc.fits_gpu:
        most, tokens = acc.max_utilization, acc.kv_tokens_at_max
        if tokens is None or most is None:
            return Choice("off", f"a sleeping standby's ~{gib(acc.gpu_bytes)} does not fit "
                                 "beside the serving engine at any gpu_memory_utilization "
                                 "that leaves these settings their KV cache")
        at = (f"a sleeping standby fits only at gpu_memory_utilization {most:.2f}, with "
              f"{tokens:,} KV tokens instead of {alone.kv_tokens:,}")
        cost = 1 - tokens / alone.kv_tokens if alone.kv_tokens else 1.0
        if UTIL_KEY in cfg.given:
            return Choice("off", f"{at}; vllm.gpu_memory_utilization = "
                                 f"{cfg.vllm.gpu_memory_utilization:g} is set in the config")
        if cost > MAX_KV_COST:
            return Choice("off", f"{at} ({cost:.0%} fewer; auto gives up at most "
                                 f"{MAX_KV_COST:.0%})")
        if tokens < alone.max_model_len:
            return Choice("off", f"{at}, fewer than max_model_len {alone.max_model_len:,}")
        util = most
        sleeping = plan.make_plan(_with(cfg, standby="sleep", utilization=most), model, gpu)
        acc = sleeping.standby
        assert acc is not None and acc.fits_gpu
    need = acc.host_bytes
    if isinstance(host, str):
        return Choice("off", f"host memory not known ({host}): a sleeping standby pins "
                             f"~{gib(need)} of it")
    if need > HOST_SHARE * host.total_bytes:
        return Choice("off", f"a sleeping standby needs ~{gib(need)} of host memory (both "
                             "engines' pinned weights and processes), more than "
                             f"{HOST_SHARE:.0%} of this machine's {gib(host.total_bytes)}")
    if need > host.room_bytes:
        return Choice("off", f"a sleeping standby needs ~{gib(need)} of host memory; "
                             f"{gib(host.room_bytes)} of {gib(host.total_bytes)} is available "
                             "now")
    lowered = (f" at gpu_memory_utilization {util:.2f} (from {cfg.vllm.gpu_memory_utilization:g}"
               f", {sleeping.kv_tokens:,} KV tokens instead of {alone.kv_tokens:,})"
               if util is not None else "")
    return Choice("sleep", f"sleeping standby: {gib(acc.gpu_bytes)} on the GPU{lowered}, "
                           f"~{gib(need)} of host memory of {gib(host.total_bytes)} "
                           f"({gib(host.room_bytes)} available)", util)


def applied(cfg: Config, choice: Choice) -> Config:
    """``cfg`` with restart.standby the chosen mode (and the lowered utilization): what the
    launch is made of from here on (launch.with_sleep_mode, the plan, the argv)."""
    return _with(cfg, standby=choice.mode, utilization=choice.utilization)


def _with(cfg: Config, standby: str, utilization: float | None = None) -> Config:
    out = dataclasses.replace(cfg, restart=dataclasses.replace(cfg.restart, standby=standby))
    if utilization is not None:
        out = dataclasses.replace(out, vllm=dataclasses.replace(
            out.vllm, gpu_memory_utilization=utilization))
    return out
