"""The OOM ladder and the learned settings: vLLM's real error texts (vLLM 0.26 on an H200)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qwen4090.base.vllmfacts import OomKind
from qwen4090.commandline.cli import main
from qwen4090.launching import ladder, learned
from qwen4090.launching.ladder import Floors, Limits, next_rung, read_oom
from qwen4090.settings.config import from_dict

PFX = "(EngineCore pid=4242) ERROR 11-30 17:16:14 [core.py:1010] "
CONTEXT = PFX + ("ValueError: To serve at least one request with the model's max seq len "
                 "(40960), (6.25 GiB KV cache is needed, which is larger than the available KV "
                 "cache memory (4.75 GiB). Based on the available memory, the estimated maximum "
                 "model length is 31104. Try increasing `gpu_memory_utilization` or decreasing "
                 "`max_model_len` when initializing the engine.")
NO_BLOCKS = PFX + ("ValueError: No available memory for the cache blocks. Try increasing "
                   "`gpu_memory_utilization` when initializing the engine.")
OTHERS = PFX + ("ValueError: Free memory on device cuda:0 (78.77/139.8 GiB) on startup is less "
                "than desired GPU memory utilization (0.92, 128.62 GiB). Decrease GPU memory "
                "utilization or reduce GPU memory used by other processes.")
CUDA = PFX + ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
              "has a total capacity of 23.55 GiB of which 1.02 GiB is free.")
FINAL = "RuntimeError: Engine core initialization failed. See root cause above."

LIM = Limits(max_model_len=40960, max_num_seqs=32, max_num_batched_tokens=8192,
             gpu_memory_utilization=0.92)


def test_reads_what_ran_out() -> None:
    f = read_oom(["noise", CONTEXT, FINAL])
    assert f is not None and f.kind is OomKind.CONTEXT_TOO_LONG and f.estimated_max_len == 31104
    f = read_oom([OTHERS, FINAL])
    assert f is not None and f.kind is OomKind.OTHERS_HOLD_MEMORY
    assert (f.free_gib, f.total_gib) == (78.77, 139.8)
    assert read_oom([NO_BLOCKS, FINAL]).kind is OomKind.NO_CACHE_BLOCKS  # type: ignore[union-attr]
    assert read_oom([CUDA]).kind is OomKind.CUDA_OOM  # type: ignore[union-attr]
    assert read_oom(["all fine"]) is None


def test_context_too_long_goes_to_vllms_estimate() -> None:
    r = next_rung(read_oom([CONTEXT]), LIM)
    assert r is not None and (r.key, r.old, r.new) == ("max_model_len", 40960, 30976)
    assert r.describe().startswith("max_model_len 40960 -> 30976")


def test_context_without_estimate_halves_down_to_the_floor() -> None:
    facts = ladder.OomFacts(OomKind.CONTEXT_TOO_LONG, "x")
    r = next_rung(facts, Limits(3000, 8, 2048, 0.9), Floors(min_len=2048))
    assert r is not None and r.new == 2048
    assert next_rung(facts, Limits(2048, 8, 2048, 0.9), Floors(min_len=2048)) is None


def test_others_holding_memory_lowers_the_share_to_what_is_free() -> None:
    r = next_rung(read_oom([OTHERS]), LIM)
    assert r is not None and r.key == "gpu_memory_utilization"
    assert r.new == pytest.approx(0.54)  # 78.77/139.8 = 0.563, minus one 0.02 step
    assert next_rung(read_oom([OTHERS]), LIM, Floors(min_util=0.6)) is None


def test_no_cache_blocks_only_a_smaller_batch_helps() -> None:
    r = next_rung(read_oom([NO_BLOCKS]), LIM)
    assert r is not None and (r.key, r.new) == ("max_num_batched_tokens", 4096)
    assert next_rung(read_oom([NO_BLOCKS]), Limits(8192, 32, 2048, 0.9)) is None


def test_cuda_oom_walks_seqs_then_share_then_context() -> None:
    lim = LIM
    seen = []
    for _ in range(40):
        r = next_rung(read_oom([CUDA]), lim, Floors(util_step=0.02, min_util=0.86,
                                                    min_len=8192))
        if r is None:
            break
        seen.append((r.key, r.new))
        lim = Limits(**{**lim.__dict__, r.key: r.new})
    assert seen == [("max_num_seqs", 16), ("max_num_seqs", 8), ("max_num_seqs", 4),
                    ("max_num_seqs", 2), ("max_num_seqs", 1),
                    ("gpu_memory_utilization", 0.9), ("gpu_memory_utilization", 0.88),
                    ("gpu_memory_utilization", 0.86),
                    ("max_model_len", 20480), ("max_model_len", 10240),
                    ("max_model_len", 8192)]


def learned_cfg(tmp_path: Path, **vllm: object) -> Any:
    return from_dict({"vllm": {"model": "/m", **vllm},
                      "gpu": {"state_directory": str(tmp_path)}})


def test_learned_settings_are_ceilings_for_one_model_and_gpu(tmp_path: Path) -> None:
    cfg = learned_cfg(tmp_path, max_model_len=40960, max_num_seqs="auto")
    store = learned.LearnedStore(learned.state_dir(cfg))
    fp = learned.fingerprint(cfg, "NVIDIA H200", 150 * 1024 ** 3)
    store.record("max_model_len", 30976, fp, "context_too_long")
    store.record("max_num_seqs", 16, fp, "cuda_oom")
    applied, notes = store.apply(cfg, fp)
    assert applied.vllm.max_model_len == 30976 and applied.vllm.max_num_seqs == 16
    assert notes == ["max_model_len 40960 -> 30976", "max_num_seqs auto -> 16"]
    # never raises an explicit setting
    low = learned_cfg(tmp_path, max_model_len=8192)
    assert store.apply(low, learned.fingerprint(low, "NVIDIA H200", 150 * 1024 ** 3)
                       )[0].vllm.max_model_len == 8192
    # another GPU: ignored, and said so
    other, notes = store.apply(cfg, learned.fingerprint(cfg, "RTX 4090", 24 * 1024 ** 3))
    assert other == cfg and notes[0].startswith("ignored")
    data = json.loads(store.path.read_text())
    assert data["settings"] == {"max_model_len": 30976, "max_num_seqs": 16}
    assert len(data["history"]) == 2


def test_state_directory_from_systemd(tmp_path: Path) -> None:
    cfg = from_dict({})
    assert learned.state_dir(cfg, {"STATE_DIRECTORY": f"{tmp_path}:/other"}) == tmp_path
    assert str(learned.state_dir(cfg, {})) == "/var/lib/qwen4090"


def test_torn_file_counts_as_nothing_learned(tmp_path: Path) -> None:
    (tmp_path / "learned.json").write_text("{not json")
    cfg = learned_cfg(tmp_path)
    assert learned.LearnedStore(tmp_path).apply(cfg, {})[0] == cfg


def test_reset_learned_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "q.toml"
    conf.write_text(f'[gpu]\nstate_directory = "{tmp_path}"\n')
    cfg = learned_cfg(tmp_path)
    learned.LearnedStore(tmp_path).record("max_num_seqs", 8, learned.fingerprint(cfg, "", 0),
                                          "x")
    assert main(["reset-learned", "-c", str(conf)]) == 0
    assert "forgot max_num_seqs" in capsys.readouterr().out
    assert not (tmp_path / "learned.json").exists()
    assert main(["reset-learned", "-c", str(conf)]) == 0
    assert "nothing learned" in capsys.readouterr().out
