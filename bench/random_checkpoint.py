#!/usr/bin/env python3
"""Random-valued Qwen3 weights in safetensors, sharded, for a model directory that has only
config.json and a tokenizer (issue 21): vLLM's real loader then reads a checkpoint from disk
(what a standby engine and a restart do in the field) instead of ``--load-format dummy``.

The tensors are those vLLM 0.26's Qwen3ForCausalLM loads (models/qwen3.py, qwen2.py's
Qwen2Model and AutoWeightsLoader): model.embed_tokens, per layer q/k/v/o_proj, q_norm and k_norm
(head_dim), gate/up/down_proj, input_layernorm and post_attention_layernorm, model.norm, and
lm_head unless tie_word_embeddings.  Matrices are normal(0, 0.02), norms ones; bf16, seeded,
generated on CUDA when there is one (the CPU takes minutes for 14B).  The shards are written by
hand (an 8-byte header length, the JSON header, the raw bytes: the safetensors format), one
tensor at a time, while the next one is generated, so memory stays at about two tensors; then
model.safetensors.index.json.  Shards are written as ``*.partial`` and renamed when all are
complete; earlier ``*.safetensors`` and the index in the directory are removed first.

    python3 bench/random_checkpoint.py /tmp/vllm_lab/model              # Qwen3-14B: ~27.5 GiB
    python3 bench/random_checkpoint.py DIR --shard-gib 0.0001 --device cpu   # a tiny model

Prints one JSON line: tensors, shards, bytes, seconds (generate + write, fsync), disk free.
Needs torch (any build); no safetensors package (the headers are checked by reading them back).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
STD = 0.02


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix" (normal * 0.02) or "norm" (ones)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def tensor_specs(config: dict[str, Any]) -> list[Spec]:
    """The checkpoint's tensors for a Qwen3ForCausalLM config.json, in the order written."""
    cfg = config.get("text_config") or config
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    vocab, layers = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    specs = [Spec("model.embed_tokens.weight", (vocab, h), "matrix")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            Spec(p + "self_attn.q_proj.weight", (heads * hd, h), "matrix"),
            Spec(p + "self_attn.k_proj.weight", (kv_heads * hd, h), "matrix"),
            Spec(p + "self_attn.v_proj.weight", (kv_heads * hd, h), "matrix"),
            Spec(p + "self_attn.o_proj.weight", (h, heads * hd), "matrix"),
            Spec(p + "self_attn.q_norm.weight", (hd,), "norm"),
            Spec(p + "self_attn.k_norm.weight", (hd,), "norm"),
            Spec(p + "mlp.gate_proj.weight", (inter, h), "matrix"),
            Spec(p + "mlp.up_proj.weight", (inter, h), "matrix"),
            Spec(p + "mlp.down_proj.weight", (h, inter), "matrix"),
            Spec(p + "input_layernorm.weight", (h,), "norm"),
            Spec(p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs.append(Spec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(Spec("lm_head.weight", (vocab, h), "matrix"))
    return specs


def plan_shards(specs: list[Spec], shard_bytes: int, itemsize: int) -> list[list[Spec]]:
    """Tensors in order, a new shard whenever the next one would pass ``shard_bytes`` (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        n = s.numel() * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    return shards


def header(specs: list[Spec], dtype: str, itemsize: int) -> bytes:
    """The safetensors header of one shard: JSON, padded with spaces to a multiple of 8, after
    its little-endian u64 length."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        n = s.numel() * itemsize
        meta[s.name] = {"dtype": dtype, "shape": list(s.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(n)))


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# --- writing --------------------------------------------------------------------------------


def generate(specs: list[Spec], dtype: str, seed: int, device: str,
             out: queue.Queue[Any]) -> None:
    """Put (spec, CPU tensor) on ``out`` in order, then None; an exception is put as is."""
    try:
        import torch

        tdt = getattr(torch, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        for s in specs:
            if s.kind == "norm":
                t = torch.ones(s.shape, dtype=tdt)
            else:
                t = torch.empty(s.shape, dtype=tdt, device=device).normal_(0.0, STD,
                                                                          generator=gen)
                t = t.cpu().contiguous()
            out.put((s, t))
        out.put(None)
    except BaseException as e:  # handed to the writer, which raises it
        out.put(e)


def tensor_bytes(t: Any) -> Any:
    """The tensor's bytes without a copy (``t`` must stay alive while they are used)."""
    return (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())


def write(model_dir: Path, shard_bytes: int, seed: int, device: str, dtype: str = "bfloat16",
          fsync: bool = True) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    specs = tensor_specs(config)
    tag, itemsize = DTYPES[dtype]
    shards = plan_shards(specs, shard_bytes, itemsize)
    total = sum(s.numel() for s in specs) * itemsize
    old = [p for p in model_dir.iterdir()
           if p.name.endswith((".safetensors", ".safetensors.partial")) or p.name == INDEX]
    free_before = shutil.disk_usage(model_dir).free
    reclaim = sum(p.stat().st_size for p in old)
    if free_before + reclaim < total + (1 << 30):
        raise SystemExit(f"not enough disk in {model_dir}: {total / 2**30:.1f} GiB to write, "
                         f"{(free_before + reclaim) / 2**30:.1f} GiB free (1 GiB kept free)")
    for p in old:
        p.unlink()

    q: queue.Queue[Any] = queue.Queue(maxsize=2)
    threading.Thread(target=generate, args=(specs, dtype, seed, device, q), daemon=True).start()
    t0 = time.monotonic()
    fsync_s = 0.0
    weight_map: dict[str, str] = {}
    paths = []
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        path = model_dir / (name + ".partial")
        with path.open("wb") as f:
            f.write(header(shard, tag, itemsize))
            for want in shard:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                s, t = item
                assert s == want, (s, want)
                f.write(tensor_bytes(t))
                weight_map[s.name] = name
                del t, item
            if fsync:
                f.flush()
                t_sync = time.monotonic()
                os.fsync(f.fileno())
                fsync_s += time.monotonic() - t_sync
        paths.append((path, model_dir / name))
    seconds = time.monotonic() - t0
    for part, final in paths:
        part.rename(final)
    (model_dir / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    check(model_dir, shards, tag, itemsize)
    return {"dir": str(model_dir), "tensors": len(specs), "shards": len(shards),
            "params": sum(s.numel() for s in specs), "bytes": total,
            "gib": round(total / 2**30, 2), "dtype": dtype, "device": device, "seed": seed,
            "seconds": round(seconds, 1), "fsync_seconds": round(fsync_s, 1),
            "gib_per_s": round(total / 2**30 / max(seconds, 1e-9), 2),
            "disk_free_before_gib": round(free_before / 2**30, 1),
            "disk_free_after_gib": round(shutil.disk_usage(model_dir).free / 2**30, 1)}


def check(model_dir: Path, shards: list[list[Spec]], tag: str, itemsize: int) -> None:
    """Each shard's header and size read back from disk against the plan."""
    for i, shard in enumerate(shards):
        path = model_dir / shard_name(i, len(shards))
        meta = read_header(path)
        meta.pop("__metadata__", None)
        want = {s.name: list(s.shape) for s in shard}
        got = {k: v["shape"] for k, v in meta.items()}
        if got != want or any(v["dtype"] != tag for v in meta.values()):
            raise SystemExit(f"{path}: header does not match the plan")
        data = sum(s.numel() for s in shard) * itemsize
        hlen = path.stat().st_size - data - 8
        if hlen < 0 or hlen % 8 or hlen != len(header(shard, tag, itemsize)) - 8:
            raise SystemExit(f"{path}: {path.stat().st_size} bytes, expected a header + {data}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="has config.json (Qwen3ForCausalLM)")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--no-fsync", action="store_true", help="leave the shards in the page cache")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    res = write(args.model_dir, max(1, int(args.shard_gib * 2**30)), args.seed, device,
                args.dtype, fsync=not args.no_fsync)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
