#!/usr/bin/env bash
# The main job on a machine without a GPU: set up, then serve the tiny model on the CPU vLLM
# under the supervisor, in the foreground (Ctrl-C stops it cleanly).
#   scripts/demo.sh [PORT]      then: curl localhost:PORT/v1/completions ...
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-runtime.sh
mkdir -p .runtime
scripts/demo-config.sh "${1:-8000}" > .runtime/demo.toml
.venv/bin/qwen4090 check-config --config .runtime/demo.toml
exec .venv/bin/qwen4090 run --config .runtime/demo.toml
