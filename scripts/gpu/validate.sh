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
cd "$(dirname "$0")/../.." || exit 1
stage=${1:-all}
# shellcheck source=scripts/gpu/kit.sh
. scripts/gpu/kit.sh
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
