#!/usr/bin/env bash
# Run the GPU tests (tests/gpu, marker `gpu`) on a machine with an NVIDIA GPU and vLLM 0.26
# (on the lent H200: installed by the kit in ../shared/gpu, see docs/gpu-validation.md), and pack
# the results under $OUT.  One stage per call keeps each call well inside 10 minutes:
#   bash scripts/gpu/validate.sh nvml        NVML, another process named, plan from NVML (~30 s)
#   bash scripts/gpu/validate.sh raw         raw vLLM with qwen4090's argv, no warmup (~3 min)
#   bash scripts/gpu/validate.sh supervised  qwen4090 run: READY, TTFT, a SIGSTOP hang healed (~5 min)
#   bash scripts/gpu/validate.sh oom         plan refusal; a real OOM healed by the ladder (~4 min)
#   bash scripts/gpu/validate.sh all         all of them in that order
# Env: QWEN4090_GPU_MODEL (default /tmp/vllm_lab/model: the dummy Qwen3-14B), OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-all}
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
case $stage in
  nvml) k="test_gpu_nvml" ;;
  raw) k="test_raw" ;;
  supervised) k="test_supervised" ;;
  oom) k="test_gpu_oom" ;;
  all) k="test_gpu_nvml or test_raw or test_supervised or test_gpu_oom" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
  > "$OUT/nvidia-smi-$stage.txt" 2>&1
python3 -m pytest tests/gpu -m gpu -p no:cacheprovider -q -s -rs -k "$k" 2>&1 \
  | tee "$OUT/pytest-$stage.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/results-$stage.tgz" -C "$QWEN4090_GPU_RESULTS" . 2>/dev/null
ls -l "$OUT"
exit "$rc"
