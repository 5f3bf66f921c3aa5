"""The KV-cache plan against Qwen3-14B's real architecture and what vLLM 0.26 reported on an H200
(docs/gpu-validation.md, ../shared/gpu/RESULTS.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline.cli import main
from qwen4090.launching import plan
from qwen4090.settings.config import from_dict

GIB = 1024 ** 3
H200 = plan.GpuMemory(int(139.8 * GIB), "NVIDIA H200", "test")  # CUDA's total, as vLLM saw it

QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "hidden_size": 5120, "intermediate_size": 17408, "max_position_embeddings": 40960,
    "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}


@pytest.fixture
def q14(tmp_path: Path) -> Path:
    d = tmp_path / "qwen3-14b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_14B))
    return d


def cfg_for(model: Path, **vllm: object) -> Any:
    return from_dict({"vllm": {"model": str(model), **vllm}})


def test_kv_bytes_per_token_is_the_hand_account(q14: Path) -> None:
    m = plan.read_model(q14)
    assert (m.layers, m.kv_heads, m.head_dim) == (40, 8, 128)
    assert plan.kv_bytes_per_token(m, "bfloat16") == 2 * 40 * 8 * 128 * 2 == 163_840
    assert plan.kv_bytes_per_token(m, "fp8") == 81_920


def test_head_dim_from_hidden_when_absent(tmp_path: Path) -> None:
    cfg = {k: v for k, v in QWEN3_14B.items() if k != "head_dim"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert plan.read_model(tmp_path).head_dim == 5120 // 40


def test_dummy_weights_estimated_like_vllm_loaded_them(q14: Path) -> None:
    # vLLM: "Model loading took 27.52 GiB" (bf16), "15.9 GiB" (--quantization fp8)
    m = plan.read_model(q14)
    bf16, note = plan.estimate_weights(m, "bfloat16", "")
    assert bf16 / GIB == pytest.approx(27.52, rel=0.005)
    assert "estimated from the architecture" in note
    fp8, note = plan.estimate_weights(m, "bfloat16", "fp8")
    assert fp8 / GIB == pytest.approx(15.9, rel=0.01)
    assert "quantizing on load" in note


def test_fp8_at_016_of_the_h200_predicts_what_vllm_reported(q14: Path) -> None:
    # vLLM 0.26: "Available KV cache memory: 4.6 GiB", "GPU KV cache size: 30,160 tokens",
    # "Maximum concurrency for 8,192 tokens per request: 3.68x"
    p = plan.make_plan(cfg_for(q14, quantization="fp8", gpu_memory_utilization=0.16,
                               max_model_len=8192), plan.read_model(q14), H200)
    assert p.fits
    assert p.budget_bytes / GIB == pytest.approx(22.37, abs=0.01)
    assert p.kv_tokens == pytest.approx(30_160, rel=0.02)
    assert p.full_length_seqs == pytest.approx(3.68, abs=0.1)


def test_default_bf16_at_092_predicts_what_vllm_reported(q14: Path) -> None:
    # vLLM 0.26 defaults: "Available KV cache memory: 99.27 GiB", "650,560 tokens"
    p = plan.make_plan(cfg_for(q14, gpu_memory_utilization=0.92, max_model_len=40960),
                       plan.read_model(q14), H200)
    assert p.kv_cache_bytes / GIB == pytest.approx(99.27, abs=0.5)
    assert p.kv_tokens == pytest.approx(650_560, rel=0.01)


def test_bf16_14b_cannot_fit_a_24_gib_budget(q14: Path) -> None:
    # vLLM: "Available KV cache memory: -6.98 GiB" then "No available memory for the cache blocks"
    cfg = cfg_for(q14, gpu_memory_utilization=0.16, max_model_len=8192)
    p = plan.make_plan(cfg, plan.read_model(q14), H200)
    assert not p.fits and p.kv_tokens == 0
    assert p.kv_cache_bytes / GIB == pytest.approx(-6.98, abs=0.2)
    err = plan.refusal(cfg, p)
    assert err is not None and err.key == "vllm.gpu_memory_utilization"
    assert "27.51 GiB" in str(err) and "22.37 GiB" in str(err)


def test_context_longer_than_the_kv_cache_is_refused(q14: Path) -> None:
    # vLLM refused 40960 at 0.24 ("estimated maximum model length is 31104")
    cfg = cfg_for(q14, gpu_memory_utilization=0.24, max_model_len=40960)
    p = plan.make_plan(cfg, plan.read_model(q14), H200)
    err = plan.refusal(cfg, p)
    assert err is not None and err.key == "vllm.max_model_len"
    assert "6.25 GiB" in str(err)  # what vLLM said one 40960-token request needs


def test_budget_without_room_outside_it_is_refused(q14: Path) -> None:
    cfg = cfg_for(q14, quantization="fp8", gpu_memory_utilization=0.99, max_model_len=4096)
    p = plan.make_plan(cfg, plan.read_model(q14), plan.GpuMemory(24 * GIB, "4090", "test"))
    assert any(k == "vllm.gpu_memory_utilization" and "outside" in m for k, m in p.problems)


def awq_4090(tmp_path: Path) -> Path:
    d = tmp_path / "awq"
    d.mkdir()
    cfg = dict(QWEN3_14B, quantization_config={"quant_method": "awq", "bits": 4,
                                               "group_size": 128})
    (d / "config.json").write_text(json.dumps(cfg))
    with (d / "model.safetensors").open("wb") as f:  # sparse: 9.6 GB "on disk"
        f.truncate(9_600_000_000)
    return d


def test_auto_on_a_4090_with_awq_follows_the_seed_account(tmp_path: Path) -> None:
    # SEEDS-DIGEST: 24 GB x 0.92 - 9.6 GB weights - ~1 GB: about 73,000 tokens
    d = awq_4090(tmp_path)
    cfg = cfg_for(d, gpu_memory_utilization=0.92, max_model_len="auto", max_num_seqs="auto",
                  max_num_batched_tokens="auto")
    p = plan.make_plan(cfg, plan.read_model(d), plan.GpuMemory(24 * GIB, "4090", "test"))
    assert p.weights_bytes == 9_600_000_000
    assert p.kv_tokens == pytest.approx(73_000, rel=0.03)
    assert p.max_model_len == 40960  # the model's own limit; it fits
    assert p.max_num_seqs == 32  # 73k tokens / 2048 a request, down to a multiple of 8
    assert p.max_num_batched_tokens == 8192
    r = plan.resolved(cfg, p)
    assert (r.vllm.max_model_len, r.vllm.max_num_seqs, r.vllm.max_num_batched_tokens) == \
        (40960, 32, 8192)


def test_auto_context_is_capped_by_the_kv_cache(q14: Path) -> None:
    cfg = cfg_for(q14, quantization="fp8", gpu_memory_utilization=0.16, max_model_len="auto")
    p = plan.make_plan(cfg, plan.read_model(q14), H200)
    assert p.fits and p.max_model_len <= p.kv_tokens and p.max_model_len % 1024 == 0
    assert p.max_model_len == p.kv_tokens // 1024 * 1024


def test_auto_without_chunked_prefill_batches_a_whole_context(q14: Path) -> None:
    cfg = cfg_for(q14, quantization="fp8", gpu_memory_utilization=0.16, max_model_len=8192,
                  enable_chunked_prefill=False, max_num_batched_tokens="auto")
    p = plan.make_plan(cfg, plan.read_model(q14), H200)
    assert p.max_num_batched_tokens == 8192


def test_plan_cli_json(q14: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "q.toml"
    conf.write_text(f'[vllm]\nmodel = "{q14}"\nquantization = "fp8"\n'
                    'gpu_memory_utilization = 0.16\nmax_model_len = 8192\n'
                    f'[gpu]\nstate_directory = "{tmp_path / "state"}"\n')
    assert main(["plan", "-c", str(conf), "--gpu-memory", "139.8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("kv_bytes_per_token", "kv_tokens", "weights_bytes", "max_model_len",
                "max_num_seqs"):
        assert key in out
    assert out["kv_bytes_per_token"] == 163_840 and out["max_model_len"] == 8192
    assert main(["plan", "-c", str(conf), "--gpu-memory", "139.8"]) == 0
    text = capsys.readouterr().out
    assert "KV bytes per token" in text and "163,840 B" in text and "fits" in text


def test_plan_cli_exit_78_when_it_cannot_fit(q14: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "q.toml"
    conf.write_text(f'[vllm]\nmodel = "{q14}"\ngpu_memory_utilization = 0.9\n'
                    f'[gpu]\nstate_directory = "{tmp_path / "state"}"\n')
    assert main(["plan", "-c", str(conf), "--gpu-memory", "24"]) == 78
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_plan_cli_model_flag_without_config(q14: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-c", str(tmp_path / "none.toml"), "--model", str(q14),
                 "--gpu-memory", "139.8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_tokens"] > 600_000


def test_missing_config_json_is_a_plan_error(tmp_path: Path) -> None:
    with pytest.raises(plan.PlanError, match=r"config\.json"):
        plan.read_model(tmp_path)


# --- tensor parallelism (issue 12: the account per GPU; not measured on two GPUs) -------------

RTX4090 = plan.GpuMemory(int(23.5 * GIB), "NVIDIA GeForce RTX 4090", "test")


def test_two_gpus_split_weights_kv_heads_and_mlp_activations(q14: Path) -> None:
    # bf16 Qwen3-14B (27.5 GiB) does not fit one 24 GB card; split over two it does.
    m = plan.read_model(q14)
    one = plan.make_plan(cfg_for(q14, max_model_len=8192, max_num_batched_tokens=4096),
                         m, RTX4090)
    two = plan.make_plan(cfg_for(q14, max_model_len=8192, max_num_batched_tokens=4096,
                                 tensor_parallel_size=2), m, RTX4090)
    assert not one.fits and two.fits and two.tensor_parallel_size == 2
    assert two.weights_bytes == -(-one.weights_bytes // 2)
    assert "split over 2 GPUs" in two.weights_note
    assert two.kv_bytes_per_token == 2 * 40 * 4 * 128 * 2  # 4 of the 8 KV heads on each GPU
    assert two.activation_bytes == 4096 * (4 * 17408 // 2 + 8 * 5120) * 2
    assert two.budget_bytes == one.budget_bytes  # per GPU: the same card
    kv = two.budget_bytes - two.weights_bytes - two.activation_bytes - two.non_torch_bytes
    assert two.kv_tokens == kv // two.kv_bytes_per_token // 16 * 16
    assert two.as_json()["tensor_parallel_size"] == 2
    text = plan.render(two, cfg_for(q14, tensor_parallel_size=2))
    assert "split over 2 GPUs like it" in text and "(of 8, on each of 2 GPUs)" in text


def test_more_gpus_than_kv_heads_replicate_them(q14: Path) -> None:
    m = plan.read_model(q14)
    assert plan.kv_heads_per_gpu(m, 8) == 1 and plan.kv_heads_per_gpu(m, 16) == 1
    assert plan.kv_bytes_per_token(m, "bfloat16", 16) == 2 * 40 * 1 * 128 * 2


def test_a_split_the_heads_do_not_divide_by_is_refused(q14: Path) -> None:
    p = plan.make_plan(cfg_for(q14, tensor_parallel_size=3, max_model_len=8192),
                       plan.read_model(q14), H200)
    assert not p.fits and p.problems[0][0] == "vllm.tensor_parallel_size"
    assert "40 attention heads do not divide by it" in p.problems[0][1]
    assert "expected one of 1, 2, 4, 5, 8, 10, 20, 40" in p.problems[0][1]


def test_sleep_mode_plans_the_kv_cache_vllm_gives_in_sleep_mode(q14: Path) -> None:
    # H100 80GB (CUDA's 79.18 GiB), vLLM 0.26, Qwen3-14B fp8 at 0.28 (2026-12-06): without
    # sleep mode vLLM gave 28,864 KV tokens, with it 31,680 (its profile counts non-torch
    # memory at -0.21 GiB in sleep mode).  The plan follows both, never above vLLM's.
    h100 = plan.GpuMemory(int(79.18 * GIB), "NVIDIA H100 80GB HBM3", "test")
    cfg = cfg_for(q14, quantization="fp8", gpu_memory_utilization=0.28, max_model_len=8192,
                  max_num_seqs=8, max_num_batched_tokens=8192)
    off = plan.make_plan(cfg, plan.read_model(q14), h100)
    asleep = plan.make_plan(dataclasses.replace(cfg, restart=dataclasses.replace(
        cfg.restart, standby="sleep")), plan.read_model(q14), h100)
    assert off.kv_tokens == pytest.approx(28_864, rel=0.01)
    assert asleep.kv_tokens == pytest.approx(31_680, rel=0.01)
    assert asleep.kv_tokens <= 31_680 and asleep.non_torch_bytes < 0
