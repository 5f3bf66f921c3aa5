#!/usr/bin/env bash
# Issue 8.5 on the GPU (tests/gpu/test_gpu_ownership.py): SIGKILL the supervisor of a READY
# vLLM, check the orphan still serves and holds GPU memory, start a second supervisor on the same
# config: it must stop the orphan (orphan_found/orphan_stopped), see the memory released, and
# reach READY.  Same machine and environment as scripts/gpu/validate.sh (the kit of
# ../shared/gpu installed, .whl/ carried); about 2 supervised starts (~5 min on the H200).
#   bash scripts/gpu/ownership.sh            results: $OUT/results-ownership.tgz
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=scripts/gpu/kit.sh
. scripts/gpu/kit.sh
python3 -m pytest tests/gpu/test_gpu_ownership.py -m gpu -p no:cacheprovider -q -s -rs 2>&1 \
  | tee "$OUT/pytest-ownership.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/results-ownership.tgz" -C "$QWEN4090_GPU_RESULTS" . 2>/dev/null
ls -l "$OUT"
exit "$rc"
