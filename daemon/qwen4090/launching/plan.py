"""The KV-cache plan: what fits on the GPU, worked out the way an engineer does it by hand.

    budget      = gpu_memory_utilization x usable GPU memory       (what vLLM may take)
    KV cache    = budget - weights - activation peak - non-torch   (vLLM's own arithmetic)
    KV tokens   = KV cache / (2 x layers x kv_heads x head_dim x bytes of the KV dtype)
    outside     = CUDA graphs + CUDA context, ~1.5 GiB measured ABOVE the budget

With ``vllm.tensor_parallel_size`` N > 1 every line is per GPU, for N GPUs like the one
planned for: the weights and the MLP's activations split N ways, each GPU holds the KV of
max(1, kv_heads / N) heads for every token (vLLM's own split: it replicates KV heads when N
exceeds them), and the attention heads must divide by N.  Not measured on two GPUs (issue 12).

Numbers and where they come from (vLLM 0.26 on an H200, docs/gpu-validation.md):
- usable memory is what CUDA reports as total (NVML total minus NVML's "reserved"): vLLM's
  budget is ``utilization x that`` (0.92 x 139.8 GiB = 128.62 GiB in its log).
- weights: the checkpoint's size on disk; without weight files (``--load-format dummy``) an
  estimate from the architecture.  Online quantization (``quantization = "fp8"`` on a bf16
  checkpoint) quantizes layer by layer, and vLLM counts the peak: one layer's linear weights in
  the checkpoint dtype on top (measured 15.9 GiB for Qwen3-14B where fp8 weights alone are
  15.2 GiB).
- activation peak: vLLM profiles one forward pass of max_num_batched_tokens tokens; we reserve
  ``tokens x (4 x intermediate + 8 x hidden) x activation bytes`` (1.69 GiB for Qwen3-14B at
  8192 tokens, where vLLM measured 1.61), plus 0.25 GiB non-torch memory (measured 0.22; in
  sleep mode vLLM counts it below zero, and the plan -0.15 GiB: SLEEP_NON_TORCH_BYTES).
- outside the budget: NVML saw vLLM use ~1.5 GiB more than its budget (CUDA graphs 0.9 GiB,
  the CUDA context); we plan 1.6 GiB (0.7 GiB with enforce_eager).

"auto" settings are chosen from the plan (documented in docs/gpu-validation.md and README):
- max_model_len: the model's max_position_embeddings, capped by the KV tokens that fit (rounded
  down to a multiple of 1024 when that many fit): one request of full length always fits.
- max_num_seqs: how many requests of 2048 tokens (or max_model_len, if shorter) fit in the KV
  cache at once, rounded down to a multiple of 8, from 1 to 256.
- max_num_batched_tokens: min(8192, max_model_len) with chunked prefill; max_model_len without.
Explicit settings that cannot fit are refused before launch (exit 78) with the numbers:
weights + activations above the budget, a max_model_len longer than the KV cache holds (by more
than PLAN_TOLERANCE), or a budget that leaves no room for what vLLM uses outside it.

The standby (``restart.standby``, issue 21) is a second engine of the same settings beside the
serving one.  vLLM starts only when the GPU's free memory is at least its budget, and the
serving engine's peak (budget + outside) must fit beside what the standby holds:
- "sleep": a sleeping engine keeps SLEEP_GPU_KEEP_BYTES on each GPU and pins its weights in host
  memory (PINNED_HOST_FACTOR times their size); the serving engine sleeps for each rebuild of the
  standby and keeps that memory once awake, so both engines hold it, and their processes take
  ENGINE_HOST_BYTES each.  The GPU side is judged here (pure); the host side by
  :func:`judge_host`, on :func:`host_memory`'s reading.
- "awake": a second full engine: twice the peak on each GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwen4090.settings.config import AUTO, Config, ConfigError, read_regular_file

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "int8": 1}
NON_TORCH_BYTES = int(0.25 * GIB)
# In sleep mode vLLM's profile sees the weights in its CuMemAllocator pool, outside torch's
# counters, and reports non-torch memory below zero: -0.21 GiB on the H100 (vLLM 0.26,
# Qwen3-14B fp8, 2026-12-06, docs/recovery.md), where the same engine without sleep mode said
# +0.22 GiB, and its KV cache came out 0.42 GiB larger (31,680 tokens against 28,864).  The
# plan counts -0.15 GiB there: a little less KV than vLLM gives, never more (issue 30.6).
SLEEP_NON_TORCH_BYTES = int(-0.15 * GIB)
OUTSIDE_BUDGET_BYTES = int(1.6 * GIB)  # CUDA graphs + context (measured ~1.5 GiB)
OUTSIDE_BUDGET_EAGER_BYTES = int(0.7 * GIB)  # context only
PLAN_TOLERANCE = 0.05  # the plan is an estimate: refuse only when clearly over
AUTO_SEQ_TOKENS = 2048  # "a typical request" for choosing max_num_seqs
AUTO_BATCHED_TOKENS = 8192
MAX_AUTO_SEQS = 256
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# What a sleeping engine (vLLM's sleep mode, level 1) keeps on each GPU: 0.84 GiB measured on the
# H200 (Qwen3-14B fp8, vLLM 0.26, issue 21); we plan 1.0 GiB.
SLEEP_GPU_KEEP_GIB = 1.0
SLEEP_GPU_KEEP_BYTES = int(SLEEP_GPU_KEEP_GIB * GIB)
# The host memory a sleeping engine pins, per byte of weights it backs up: measured on the H200
# (Qwen3-14B fp8, vLLM 0.26, docs/gpu-runs/2026-12-02-standby-hang/failover-rss.log) the
# EngineCore's RssShmem was 22.83 GiB for vLLM's "15.91 GiB is backed up in CPU" (1.44x).  Why:
# vLLM's CuMemAllocator.sleep backs up each weight allocation into its own
# torch.empty(..., pin_memory=True), and PyTorch's pinned host allocator rounds every block up to
# the next power of two (CachingHostAllocator: PowerOf2Ceil).  Qwen3-14B's tensors rounded so
# (fp8 qkv, o, gate_up, down per layer; bf16 embedding and lm_head) add up to 22.75 GiB, against
# the 22.83 measured; its AWQ build's (qweight, scales, zeros) to 13.74 GiB for 9.29 (1.48x).  The
# factor depends on where each tensor's size falls below a power of two (1x to 2x); we plan 1.5x
# (docs/recovery.md section 7).  An engine keeps it once woken, and the serving engine sleeps for
# each rebuild: both engines hold it.
PINNED_HOST_FACTOR = 1.5
# A vLLM engine's processes besides that (RSS, same measurement): the EngineCore 1.4-1.5 GiB of
# anonymous memory + 0.2-0.3 GiB of files, the API server 1.0 + 0.4: ~2.9 GiB; we plan 3.0 GiB.
ENGINE_HOST_BYTES = int(3.0 * GIB)


class PlanError(Exception):
    """The model directory cannot be planned for (no config.json, unknown layout)."""


# --- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_position_embeddings: int | None
    torch_dtype: str
    quant_method: str  # "" when the checkpoint is not quantized
    quant_bits: int | None
    disk_bytes: int  # weight files on disk; 0 = none (dummy weights)

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' matrices (attention + MLP)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params


def read_model(model_dir: str | os.PathLike[str]) -> ModelFacts:
    d = Path(model_dir).expanduser()
    cfg_path = d / "config.json"
    try:  # cfg: a FIFO or device as config.json is refused at once, never waited on
        raw = json.loads(read_regular_file(cfg_path, 16 << 20, what="the model's config.json"))
    except ConfigError as e:
        raise PlanError(str(e)) from None
    except FileNotFoundError:
        raise PlanError(f"{cfg_path} not found: point vllm.model (or --model) at the model's "
                        "top directory") from None
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {cfg_path}: {e}") from None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None
    c = {**raw, **(text or {})}
    try:
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"{cfg_path}: expected hidden_size, num_attention_heads and "
                        "num_hidden_layers (a decoder-only transformer)") from None
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    q = raw.get("quantization_config") or c.get("quantization_config") or {}
    bits = q.get("bits", q.get("w_bit", q.get("weight_bits")))
    return ModelFacts(
        path=str(d), architecture=",".join(c.get("architectures") or [c.get("model_type", "?")]),
        layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
        intermediate=int(c.get("intermediate_size") or 4 * hidden),
        vocab=int(c.get("vocab_size") or 0),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=int(c["max_position_embeddings"])
        if c.get("max_position_embeddings") else None,
        torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"),
        quant_method=str(q.get("quant_method", "")) if isinstance(q, dict) else "",
        quant_bits=int(bits) if isinstance(bits, (int, float)) else None,
        disk_bytes=weights_on_disk(d))


def weights_on_disk(d: Path) -> int:
    total = 0
    for p in d.iterdir():
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and "training_args" not in p.name:
            total += p.stat().st_size
    return total


# --- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int  # usable: what CUDA reports (NVML total - reserved)
    name: str = ""
    source: str = ""  # "nvml" or "--gpu-memory"
    free_bytes: int | None = None  # now, for the check against other processes


@dataclass(frozen=True)
class HostMemory:
    """The host's memory now (psutil, :func:`host_memory`)."""

    total_bytes: int  # MemTotal
    available_bytes: int  # MemAvailable
    ours_bytes: int = 0  # held now by this process's own engines (their RSS): theirs again

    @property
    def room_bytes(self) -> int:
        """What qwen4090's engines may have: what is available, and what they hold already."""
        return self.available_bytes + self.ours_bytes


@dataclass
class StandbyAccount:
    """What the standby (``restart.standby``) costs beside the serving engine, per GPU and on
    the host."""

    mode: str  # "sleep" or "awake"
    gpu_bytes: int  # what the standby holds on each GPU while the other engine serves
    gpu_note: str
    peak_bytes: int  # the serving engine's peak + the standby, on each GPU
    max_utilization: float | None = None  # the highest gpu_memory_utilization that fits, if any
    kv_tokens_at_max: int | None = None  # the serving engine's KV tokens there
    host_pinned_bytes: int = 0  # sleep: what each engine pins in host memory for its weights
    host_bytes: int = 0  # both engines' host memory: both pinned (each has slept) + processes
    host: HostMemory | None = None  # the host, once judge_host has seen it
    host_note: str = ""  # why the host was not judged

    @property
    def fits_gpu(self) -> bool:
        return self.max_utilization is None

    def as_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "gpu_bytes": self.gpu_bytes, "gpu_note": self.gpu_note,
                "peak_bytes": self.peak_bytes,
                "max_gpu_memory_utilization": self.max_utilization,
                "kv_tokens_at_max": self.kv_tokens_at_max,
                "host_pinned_bytes": self.host_pinned_bytes, "host_bytes": self.host_bytes,
                "host_total_bytes": None if self.host is None else self.host.total_bytes,
                "host_available_bytes": None if self.host is None
                else self.host.available_bytes,
                "host_ours_bytes": None if self.host is None else self.host.ours_bytes,
                "host_note": self.host_note}


@dataclass
class Plan:
    model: ModelFacts
    gpu: GpuMemory
    dtype: str  # activations / unquantized weights
    kv_dtype: str
    gpu_memory_utilization: float
    weights_bytes: int
    weights_note: str
    kv_bytes_per_token: int
    activation_bytes: int
    non_torch_bytes: int
    budget_bytes: int
    kv_cache_bytes: int
    kv_tokens: int
    outside_budget_bytes: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1  # GPUs the model is split over: every byte above is per GPU
    chosen: dict[str, str] = field(default_factory=dict)  # key -> why (for "auto" values)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (config key, message)
    warnings: list[str] = field(default_factory=list)
    standby: StandbyAccount | None = None  # restart.standby not "off"

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def full_length_seqs(self) -> float:
        return self.kv_tokens / self.max_model_len if self.max_model_len else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model.path, "architecture": self.model.architecture,
            "gpu": self.gpu.name, "gpu_memory_bytes": self.gpu.total_bytes,
            "gpu_memory_source": self.gpu.source,
            "dtype": self.dtype, "kv_cache_dtype": self.kv_dtype,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "params": self.model.params,
            "weights_bytes": self.weights_bytes, "weights_note": self.weights_note,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "activation_bytes": self.activation_bytes, "non_torch_bytes": self.non_torch_bytes,
            "budget_bytes": self.budget_bytes, "kv_cache_bytes": self.kv_cache_bytes,
            "kv_tokens": self.kv_tokens, "outside_budget_bytes": self.outside_budget_bytes,
            "peak_bytes": self.budget_bytes + self.outside_budget_bytes,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
            "full_length_seqs": round(self.full_length_seqs, 2),
            "chosen": self.chosen, "fits": self.fits,
            "problems": [{"key": k, "message": m} for k, m in self.problems],
            "warnings": self.warnings,
            "standby": None if self.standby is None else self.standby.as_json(),
        }


def run_dtype(cfg_dtype: str, model: ModelFacts) -> str:
    if cfg_dtype in ("auto", ""):
        d = model.torch_dtype
        # vLLM runs float32 checkpoints in bfloat16/float16 on GPUs unless told otherwise.
        return "bfloat16" if d in ("float32", "float") else d
    return {"half": "float16", "float": "float32"}.get(cfg_dtype, cfg_dtype)


def estimate_weights(model: ModelFacts, dtype: str, quantization: str) -> tuple[int, str]:
    """Bytes vLLM counts as weights, and how we know."""
    act = DTYPE_BYTES.get(dtype, 2)
    ckpt = DTYPE_BYTES.get(model.torch_dtype, 2)
    online = bool(quantization) and not model.quant_method and quantization not in (
        "awq", "awq_marlin", "gptq", "gptq_marlin")
    if model.disk_bytes and not online:
        if model.quant_method:
            return model.disk_bytes, "size of the weight files on disk (pre-quantized " \
                                     f"{model.quant_method})"
        scaled = model.disk_bytes * act // ckpt
        note = "size of the weight files on disk"
        return scaled, note + (f", scaled {model.torch_dtype} -> {dtype}" if act != ckpt else "")
    # Estimate from the architecture (dummy weights, or quantized on load).
    method = quantization or model.quant_method
    if method in ("fp8", "fbgemm_fp8", "modelopt", "compressed-tensors") or method.startswith(
            "fp8"):
        linear_bytes = 1.0
    elif method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "bitsandbytes") or (
            model.quant_bits is not None and model.quant_bits <= 4):
        bits = model.quant_bits or 4
        linear_bytes = bits / 8 * 1.03  # + scales and zeros of 128-wide groups
    else:
        linear_bytes = float(act)
    weights = int(model.linear_params * linear_bytes) + model.embedding_params * act
    note = f"estimated from the architecture ({model.params / 1e9:.2f} B parameters"
    if method:
        note += f", {method} matrices, embeddings in {dtype}"
    if online:
        layer = model.linear_params // max(model.layers, 1)
        weights += layer * ckpt
        note += f", + one layer in {model.torch_dtype} while quantizing on load"
    return weights, note + ")"


def kv_heads_per_gpu(model: ModelFacts, tp: int = 1) -> int:
    """vLLM splits the KV heads over the GPUs, and replicates them when there are fewer."""
    return max(1, model.kv_heads // tp)


def kv_bytes_per_token(model: ModelFacts, kv_dtype: str, tp: int = 1) -> int:
    """Per GPU: 2 (K and V) x layers x its KV heads x head_dim x bytes."""
    return 2 * model.layers * kv_heads_per_gpu(model, tp) * model.head_dim \
        * DTYPE_BYTES.get(kv_dtype, 2)


def activation_bytes(model: ModelFacts, batched_tokens: int, dtype: str, tp: int = 1) -> int:
    """Per GPU: the MLP's intermediate activations are split over the GPUs, the hidden ones not."""
    return batched_tokens * (4 * model.intermediate // tp + 8 * model.hidden) \
        * DTYPE_BYTES.get(dtype, 2)


def make_plan(cfg: Config, model: ModelFacts, gpu: GpuMemory) -> Plan:
    """The account for this config on this GPU, with every "auto" value chosen."""
    v = cfg.vllm
    dtype = run_dtype(v.dtype, model)
    kv_dtype = dtype if v.kv_cache_dtype == "auto" else v.kv_cache_dtype
    if kv_dtype in ("float32",):
        kv_dtype = "float32"
    tp = v.tensor_parallel_size
    weights, note = estimate_weights(model, dtype, v.quantization)
    if tp > 1:
        weights, note = -(-weights // tp), f"{note}, split over {tp} GPUs"
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    block = v.block_size if isinstance(v.block_size, int) else 16
    budget = int(v.gpu_memory_utilization * gpu.total_bytes)
    chunked = v.enable_chunked_prefill
    sleep = cfg.restart.standby == "sleep" or "--enable-sleep-mode" in v.extra_args
    non_torch = SLEEP_NON_TORCH_BYTES if sleep else NON_TORCH_BYTES
    explicit_len = v.max_model_len if isinstance(v.max_model_len, int) else None
    model_max = model.max_position_embeddings
    chosen: dict[str, str] = {}

    def batched_for(length: int | None) -> int:
        if isinstance(v.max_num_batched_tokens, int):
            return v.max_num_batched_tokens
        if not chunked and length:
            return length
        return min(AUTO_BATCHED_TOKENS, length) if length else AUTO_BATCHED_TOKENS

    # A fixed point: without chunked prefill the batch is one whole context, and the
    # context depends on the KV cache left after that batch's activations.
    length = explicit_len or model_max
    for _ in range(4):
        batched = batched_for(length)
        act = activation_bytes(model, batched, dtype, tp)
        kv_cache = budget - weights - act - non_torch
        kv_tokens = max(0, kv_cache // per_token // block * block)
        new_len = explicit_len or _auto_len(model_max, kv_tokens, block)
        if new_len == length:
            break
        length = new_len
    assert length is not None or kv_tokens == 0
    max_len = length or 0
    if explicit_len is None:
        chosen["max_model_len"] = (
            f"the model's {model_max} capped by the {kv_tokens} KV tokens that fit"
            if model_max else f"the {kv_tokens} KV tokens that fit")
    if isinstance(v.max_num_seqs, int):
        seqs = v.max_num_seqs
    else:
        per_seq = min(max_len, AUTO_SEQ_TOKENS) or 1
        n = kv_tokens // per_seq
        seqs = max(1, min(MAX_AUTO_SEQS, n // 8 * 8 if n >= 8 else n))
        chosen["max_num_seqs"] = f"{kv_tokens} KV tokens / {per_seq} tokens a request, " \
                                 f"down to a multiple of 8 (1..{MAX_AUTO_SEQS})"
    if not isinstance(v.max_num_batched_tokens, int):
        batched = max(batched, seqs) if max_len else batched
        chosen["max_num_batched_tokens"] = ("min(8192, max_model_len): chunked prefill"
                                            if chunked else "max_model_len: no chunked prefill")
    outside = OUTSIDE_BUDGET_EAGER_BYTES if v.enforce_eager else OUTSIDE_BUDGET_BYTES
    plan = Plan(model=model, gpu=gpu, dtype=dtype, kv_dtype=kv_dtype,
                gpu_memory_utilization=v.gpu_memory_utilization, weights_bytes=weights,
                weights_note=note, kv_bytes_per_token=per_token, activation_bytes=act,
                non_torch_bytes=non_torch, budget_bytes=budget,
                kv_cache_bytes=kv_cache, kv_tokens=kv_tokens, outside_budget_bytes=outside,
                block_size=block, max_model_len=max_len, max_num_seqs=seqs,
                max_num_batched_tokens=batched, tensor_parallel_size=tp, chosen=chosen)
    _judge(plan, cfg)
    _judge_standby(plan, cfg)
    return plan


def _auto_len(model_max: int | None, kv_tokens: int, block: int) -> int:
    fit = kv_tokens // 1024 * 1024 if kv_tokens >= 1024 else kv_tokens // block * block
    return min(model_max, fit) if model_max else fit


def _judge(plan: Plan, cfg: Config) -> None:
    v = cfg.vllm
    g = gib
    tp, heads = plan.tensor_parallel_size, plan.model.heads
    if tp > 1 and heads % tp:
        plan.problems.append((
            "vllm.tensor_parallel_size",
            f"found {tp}, but the model's {heads} attention heads do not divide by it (vLLM "
            f"refuses that); expected one of "
            f"{', '.join(str(n) for n in range(1, min(heads, 64) + 1) if heads % n == 0)}"))
    if plan.kv_cache_bytes <= 0:
        need = (plan.weights_bytes + plan.activation_bytes + plan.non_torch_bytes) \
            / plan.gpu.total_bytes
        plan.problems.append((
            "vllm.gpu_memory_utilization",
            f"weights {g(plan.weights_bytes)} + activations {g(plan.activation_bytes)} + "
            f"non-torch {g(plan.non_torch_bytes)} exceed the budget {g(plan.budget_bytes)} "
            f"({v.gpu_memory_utilization:g} x {g(plan.gpu.total_bytes)}): no room for a KV "
            f"cache; it would need gpu_memory_utilization > {need:.2f}, a quantized model "
            "(vllm.quantization) or a larger GPU"))
        return
    if isinstance(v.max_model_len, int) and \
            v.max_model_len > plan.kv_tokens * (1 + PLAN_TOLERANCE):
        plan.problems.append((
            "vllm.max_model_len",
            f"found {v.max_model_len}, but one request of that length needs "
            f"{g(v.max_model_len * plan.kv_bytes_per_token)} of KV cache and the plan has "
            f"{g(plan.kv_cache_bytes)} ({plan.kv_tokens} tokens at "
            f"{plan.kv_bytes_per_token} B/token); expected at most {plan.kv_tokens}, \"auto\", "
            "or more memory (gpu_memory_utilization, kv_cache_dtype = \"fp8\")"))
    elif isinstance(v.max_model_len, int) and v.max_model_len > plan.kv_tokens:
        plan.warnings.append(f"max_model_len {v.max_model_len} is within "
                             f"{PLAN_TOLERANCE:.0%} of the {plan.kv_tokens} KV tokens the plan "
                             "expects: vLLM may refuse it (the OOM ladder would step it down)")
    peak = plan.budget_bytes + plan.outside_budget_bytes
    total = plan.gpu.total_bytes
    if peak > total:
        most = math.floor((total - plan.outside_budget_bytes) / total * 100) / 100
        plan.problems.append((
            "vllm.gpu_memory_utilization",
            f"found {v.gpu_memory_utilization:g}: the budget {g(plan.budget_bytes)} plus "
            f"~{g(plan.outside_budget_bytes)} vLLM uses outside it (CUDA graphs, context) is "
            f"{g(peak)}, more than the GPU's {g(plan.gpu.total_bytes)}; expected at most "
            f"{most:.2f}"))
    mpe = plan.model.max_position_embeddings
    if mpe and plan.max_model_len > mpe:
        plan.warnings.append(f"max_model_len {plan.max_model_len} is above the model's "
                             f"max_position_embeddings {mpe}: vLLM refuses that without rope "
                             "scaling")
    if plan.max_model_len and plan.max_num_seqs * plan.max_model_len > plan.kv_tokens:
        plan.warnings.append(
            f"{plan.max_num_seqs} sequences x {plan.max_model_len} tokens = "
            f"{plan.max_num_seqs * plan.max_model_len} > {plan.kv_tokens} KV tokens: at full "
            f"length only {plan.full_length_seqs:.1f} run at once, the rest wait (max_num_seqs "
            "is a queue limit, the KV cache the real one)")


def _judge_standby(plan: Plan, cfg: Config) -> None:
    """restart.standby beside the serving engine, on each GPU (the host: :func:`judge_host`).

    vLLM refuses to start unless the GPU's free memory is at least its budget, and it uses more
    outside it: the serving engine's peak and what the standby holds meanwhile must fit."""
    mode = cfg.restart.standby
    if mode not in ("sleep", "awake"):
        return
    g = gib
    total = plan.gpu.total_bytes
    outside = plan.outside_budget_bytes
    peak = plan.budget_bytes + outside
    if mode == "sleep":
        held = SLEEP_GPU_KEEP_BYTES
        note = "a sleeping engine keeps it on each GPU (0.84 GiB measured: H200, Qwen3-14B fp8)"
        most = (total - outside - held) / total
        pinned = int(plan.weights_bytes * plan.tensor_parallel_size * PINNED_HOST_FACTOR)
        acc = StandbyAccount(mode, held, note, peak + held, host_pinned_bytes=pinned,
                             host_bytes=2 * (pinned + ENGINE_HOST_BYTES))
    else:
        held = peak
        note = "an awake engine: a second budget and what vLLM uses outside it"
        most = (total / 2 - outside) / total
        acc = StandbyAccount(mode, held, note, peak + held)
        plan.warnings.append('restart.standby = "awake" on a GPU takes a whole second engine; '
                             '"sleep" keeps ~1 GiB of it there (awake is meant for CPU vLLM)')
    plan.standby = acc
    if peak + held <= total:
        return
    most = math.floor(most * 100) / 100
    at = None
    if most > 0:
        # the same mode (sleep mode's KV account), at a utilization whose peak leaves the
        # standby its share: that plan's own standby check passes at once, no deeper
        lower = dataclasses.replace(
            cfg, vllm=dataclasses.replace(cfg.vllm, gpu_memory_utilization=most))
        at = make_plan(lower, plan.model, plan.gpu)
    if at is not None and at.fits and at.kv_tokens > 0:
        acc.max_utilization, acc.kv_tokens_at_max = most, at.kv_tokens
        fix = (f"expected vllm.gpu_memory_utilization at most {most:.2f} ({at.kv_tokens:,} KV "
               f"tokens instead of {plan.kv_tokens:,}) or restart.standby = \"off\"")
    else:
        acc.max_utilization = max(most, 0.0)
        fix = ("no gpu_memory_utilization leaves this model a KV cache beside it: expected "
               "restart.standby = \"off\"" + (' or "sleep"' if mode == "awake" else "")
               + " (or a larger GPU)")
    what = (f"and the ~{g(held)} a sleeping standby keeps" if mode == "sleep"
            else "twice (an awake standby is a second engine)")
    plan.problems.append((
        "restart.standby",
        f"found \"{mode}\": the serving engine's peak {g(peak)} (budget {g(plan.budget_bytes)} "
        f"at gpu_memory_utilization {plan.gpu_memory_utilization:g} + ~{g(outside)} outside "
        f"it) {what} make {g(peak + held)}, more than the GPU's {g(total)}; {fix}"))


def judge_host(plan: Plan, host: HostMemory | str) -> None:
    """The host's side of a sleeping standby.  Both engines' host memory (each one's pinned
    weights: the serving engine sleeps for each rebuild and keeps them, measured on the H200;
    + each engine's processes) above the machine's RAM is a problem: it can never fit.  Above
    what is available now, a warning: memory may come back, and the standby is not what serves.
    What this process's own engines hold counts as available: they are the ones.  Once per
    plan."""
    acc = plan.standby
    if acc is None or acc.mode != "sleep" or acc.host is not None or acc.host_note:
        return
    if isinstance(host, str):
        acc.host_note = host
        plan.warnings.append(f"restart.standby: host memory not checked: {host}")
        return
    acc.host = host
    g = gib
    need = acc.host_bytes
    what = (f"{g(acc.host_pinned_bytes)} pinned for its weights by each engine once it has "
            f"slept + ~{g(ENGINE_HOST_BYTES)} for each engine's processes")
    if need > host.total_bytes:
        plan.problems.append((
            "restart.standby",
            f"found \"sleep\": the two engines need about {g(need)} of host memory ({what}), "
            f"more than this machine's {g(host.total_bytes)}; expected restart.standby = "
            "\"off\" (or more RAM)"))
    elif need > host.room_bytes:
        ours = f" (with {g(host.ours_bytes)} qwen4090's engines hold)" if host.ours_bytes else ""
        plan.warnings.append(
            f"restart.standby = \"sleep\": the two engines need about {g(need)} of host "
            f"memory ({what}); {g(host.room_bytes)} is available now{ours}: a standby may fail "
            "to sleep, or the host swap")


def host_memory() -> HostMemory | str:
    """The host's memory now: MemTotal, MemAvailable, and the RSS of this process's children
    (a daemon's vLLM engines: what they hold is theirs again at a relaunch); a str says why
    not."""
    import psutil

    try:
        vm = psutil.virtual_memory()
        ours = 0
        for child in psutil.Process().children(recursive=True):
            try:
                ours += child.memory_info().rss
            except psutil.Error:
                continue  # gone meanwhile
    except (psutil.Error, OSError) as e:
        return f"cannot read the host's memory: {e}"
    return HostMemory(int(vm.total), int(vm.available), ours)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def resolved(cfg: Config, plan: Plan) -> Config:
    """The config with every "auto" limit replaced by the plan's choice."""
    v = cfg.vllm
    changes: dict[str, Any] = {}
    if v.max_model_len == AUTO and plan.max_model_len:
        changes["max_model_len"] = plan.max_model_len
    if v.max_num_seqs == AUTO:
        changes["max_num_seqs"] = plan.max_num_seqs
    if v.max_num_batched_tokens == AUTO:
        changes["max_num_batched_tokens"] = plan.max_num_batched_tokens
    if not changes:
        return cfg
    return dataclasses.replace(cfg, vllm=dataclasses.replace(v, **changes))


def refusal(cfg: Config, plan: Plan) -> ConfigError | None:
    """The first problem as the ConfigError a sysadmin sees (exit 78), or None."""
    if not plan.problems:
        return None
    key, msg = plan.problems[0]
    return ConfigError(cfg.sources[0] if cfg.sources else None, key, "the KV-cache plan says "
                       f"this cannot fit: {msg} (qwen4090 plan shows the account; "
                       "gpu.plan_check = \"warn\" lets vLLM try)")


# --- the account, printed ---------------------------------------------------------------------


def render(plan: Plan, cfg: Config) -> str:
    m, g = plan.model, gib
    v = cfg.vllm
    tp = plan.tensor_parallel_size
    lines = [f"model     {m.path} ({m.architecture}): {m.layers} layers, {m.heads} heads, "
             f"{m.kv_heads} KV heads x {m.head_dim}, {m.params / 1e9:.2f} B parameters",
             f"GPU       {plan.gpu.name or 'unknown'}: {g(plan.gpu.total_bytes)} usable "
             f"({plan.gpu.source})"
             + (f"; split over {tp} GPUs like it (tensor_parallel_size): every line is per "
                "GPU" if tp > 1 else ""), ""]

    def row(label: str, value: str, note: str = "") -> None:
        lines.append(f"  {label:<26}{value:>14}  {note}".rstrip())

    row("budget", g(plan.budget_bytes),
        f"gpu_memory_utilization {plan.gpu_memory_utilization:g} x {g(plan.gpu.total_bytes)}")
    row("- weights", g(plan.weights_bytes), plan.weights_note)
    row("- activation peak", g(plan.activation_bytes),
        f"{plan.max_num_batched_tokens} batched tokens x (4 x {m.intermediate}"
        f"{f' / {tp}' if tp > 1 else ''} + 8 x {m.hidden}) x {DTYPE_BYTES.get(plan.dtype, 2)} B")
    row("- non-torch", g(plan.non_torch_bytes),
        "NCCL/cuBLAS buffers (measured 0.22 GiB)" if plan.non_torch_bytes >= 0 else
        "sleep mode: vLLM's profile counts it below zero (measured -0.21 GiB)")
    row("= KV cache", g(plan.kv_cache_bytes))
    row("KV bytes per token", f"{plan.kv_bytes_per_token:,} B",
        f"2 x {m.layers} layers x {kv_heads_per_gpu(m, tp)} KV heads"
        f"{f' (of {m.kv_heads}, on each of {tp} GPUs)' if tp > 1 else ''} x {m.head_dim} x "
        f"{DTYPE_BYTES.get(plan.kv_dtype, 2)} B ({plan.kv_dtype})")
    row("KV tokens", f"{plan.kv_tokens:,}", f"in blocks of {plan.block_size}")
    row("outside the budget", g(plan.outside_budget_bytes),
        "CUDA graphs + context: peak " + g(plan.budget_bytes + plan.outside_budget_bytes))
    lines.append("")

    def setting(key: str, value: int) -> None:
        why = plan.chosen.get(key)
        src = f"auto: {why}" if why else "config"
        row(key, f"{value:,}", src)

    setting("max_model_len", plan.max_model_len)
    setting("max_num_seqs", plan.max_num_seqs)
    setting("max_num_batched_tokens", plan.max_num_batched_tokens)
    if plan.max_model_len:
        short = min(plan.max_model_len, AUTO_SEQ_TOKENS)
        lines.append(f"  => {plan.kv_tokens:,} tokens hold {plan.full_length_seqs:.1f} requests "
                     f"of the full {plan.max_model_len:,} at once, or "
                     f"{plan.kv_tokens // short} of {short} tokens")
    lines.append("")
    if plan.standby is not None:
        _render_standby(plan, plan.standby, row, lines)
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    for key, msg in plan.problems:
        lines.append(f"DOES NOT FIT: {key}: {msg}")
    if plan.fits:
        lines.append(f"fits: vLLM should report about {plan.kv_tokens:,} KV tokens"
                     f"{' (' + v.served_model_name + ')' if v.served_model_name else ''}")
    return "\n".join(lines)


def _render_standby(plan: Plan, acc: StandbyAccount, row: Any, lines: list[str]) -> None:
    g = gib
    lines.append(f"standby   restart.standby = \"{acc.mode}\": a second engine beside this one")
    row("+ sleeping standby" if acc.mode == "sleep" else "+ awake standby",
        g(acc.gpu_bytes), acc.gpu_note)
    if acc.fits_gpu:
        verdict = "fits"
    elif acc.kv_tokens_at_max:
        verdict = (f"DOES NOT FIT: gpu_memory_utilization at most {acc.max_utilization:.2f} "
                   f"({acc.kv_tokens_at_max:,} KV tokens)")
    else:
        verdict = "DOES NOT FIT at any gpu_memory_utilization"
    row("= peak with the standby", g(acc.peak_bytes),
        f"of the GPU's {g(plan.gpu.total_bytes)}: {verdict}")
    if acc.mode == "sleep":
        row("host: pinned, each engine", g(acc.host_pinned_bytes),
            f"its weights ({g(plan.weights_bytes * plan.tensor_parallel_size)}) in pinned "
            f"blocks, ~{PINNED_HOST_FACTOR:g}x: kept once it has slept")
        h = acc.host
        now = (f"; {g(h.total_bytes)} of RAM, {g(h.room_bytes)} available now"
               + (f" (with {g(h.ours_bytes)} qwen4090's engines hold)" if h.ours_bytes else "")
               if h is not None else f"; host not read: {acc.host_note}" if acc.host_note
               else "")
        row("host: both engines", g(acc.host_bytes),
            f"both pinned + ~{g(ENGINE_HOST_BYTES)} each for their processes{now}")
    lines.append("")


# --- the GPU the plan is for --------------------------------------------------------------------


def manual_gpu(gib: float, source: str) -> GpuMemory:
    """A GPU given by its size (gpu.memory_gib, --gpu-memory): named by the size alone, so the
    same size from either place is the same GPU for the learned settings."""
    return GpuMemory(int(gib * GIB), f"{gib:g} GiB card", source)


def gpu_memory(cfg: Config) -> GpuMemory | str:
    """The GPU that the plan and the learned settings are for: gpu.memory_gib, else NVML (with
    the binding of vllm.command's venv); a str says why there is none.

    The daemon's preflight and `qwen4090 plan` both get it through launch.read_facts, so both
    see the same GPU under the same name and launch.fingerprint agrees between them.
    """
    if cfg.gpu.memory_gib:
        return manual_gpu(cfg.gpu.memory_gib, "gpu.memory_gib")
    from qwen4090.probes import nvml

    nvml.bind(cfg.vllm.command)
    mem = nvml.memory(cfg.gpu.device)
    if isinstance(mem, str):
        return mem
    return GpuMemory(mem.usable, mem.name, "NVML total - reserved", mem.free)


def gpu_memory_from(args_gib: float | None, cfg: Config) -> GpuMemory | str:
    """The GPU's usable memory: --gpu-memory, else :func:`gpu_memory`; a str says why not."""
    if args_gib:
        return manual_gpu(args_gib, "--gpu-memory")
    mem = gpu_memory(cfg)
    if isinstance(mem, str):
        return f"no GPU memory size: {mem}; or pass --gpu-memory GIB (e.g. 24 for an RTX 4090)"
    return mem
