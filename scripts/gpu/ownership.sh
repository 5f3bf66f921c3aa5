#!/usr/bin/env bash
# Issue 8.5 on the GPU (tests/gpu/test_gpu_ownership.py): SIGKILL the supervisor of a READY
# vLLM, check the orphan still serves and holds GPU memory, start a second supervisor on the same
# config: it must stop the orphan (orphan_found/orphan_stopped), see the memory released, and
# reach READY.  Same machine and environment as scripts/gpu/validate.sh (the kit of
# ../shared/gpu installed, .whl/ carried); about 2 supervised starts (~5 min on the H200).
#   bash scripts/gpu/ownership.sh            results: $OUT/results-ownership.tgz
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/qwen4090_gpu_out}
mkdir -p "$OUT"
export QWEN4090_GPU_RESULTS=${QWEN4090_GPU_RESULTS:-/tmp/qwen4090_gpu_results}
if ! python3 -c 'import structlog' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "cannot install .whl/*.whl"; exit 1; }
fi
if ! python3 -c 'import compressed_tensors, loguru' 2>/dev/null && [ -d /tmp/vllm_lab/bundle/whl_extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    /tmp/vllm_lab/bundle/whl_extra/compressed_tensors-*.whl /tmp/vllm_lab/bundle/whl_extra/loguru-*.whl
fi
export PYTHONPATH=$PWD/daemon:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m pytest tests/gpu/test_gpu_ownership.py -m gpu -p no:cacheprovider -q -s -rs 2>&1 \
  | tee "$OUT/pytest-ownership.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/results-ownership.tgz" -C "$QWEN4090_GPU_RESULTS" . 2>/dev/null
ls -l "$OUT"
exit "$rc"
