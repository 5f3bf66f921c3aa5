# Sourced by scripts/gpu/validate.sh and ownership.sh (from the repo root): what the GPU tests
# need on the lent H200 besides the kit of ../shared/gpu, and the environment they run in.
# Sets OUT and QWEN4090_GPU_RESULTS (defaults under /tmp) and PYTHONPATH.
# shellcheck shell=bash
OUT=${OUT:-/tmp/qwen4090_gpu_out}
mkdir -p "$OUT"
export QWEN4090_GPU_RESULTS=${QWEN4090_GPU_RESULTS:-/tmp/qwen4090_gpu_results}
# structlog is not in the device image: it travels as a wheel in .whl/ (carry it); psutil and
# nvidia-ml-py are in the image.
if ! python3 -c 'import structlog' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "cannot install .whl/*.whl"; exit 1; }
fi
# --quantization fp8 needs compressed-tensors and loguru (the kit carries them as fallbacks)
if ! python3 -c 'import compressed_tensors, loguru' 2>/dev/null && [ -d /tmp/vllm_lab/bundle/whl_extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    /tmp/vllm_lab/bundle/whl_extra/compressed_tensors-*.whl /tmp/vllm_lab/bundle/whl_extra/loguru-*.whl
fi
export PYTHONPATH=$PWD/daemon:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
