#!/usr/bin/env bash
# Fault -> READY on the H200, phase by phase (issue 10), with bench/recovery.py and the kit of
# ../shared/gpu (vLLM 0.26 installed, dummy Qwen3-14B at /tmp/vllm_lab/model; the config is
# tests/gpu/lab.py's: fp8, gpu_memory_utilization 0.16, max_model_len 8192). One stage per
# device call, each well under 9 minutes (estimates from RESULTS.md: cold start ~120 s, warm
# ~60-75 s). Run the stages in this order while the machine stays warm (the compile cache in
# $CACHE is shared between them):
#   bash scripts/gpu/recovery.sh cold      cold start (empty cache), then a warm one   (~4 min)
#   bash scripts/gpu/recovery.sh crash     SIGKILL EngineCore; SIGKILL API server      (~5 min)
#   bash scripts/gpu/recovery.sh hang      SIGSTOP of the EngineCore under load        (~3 min)
#   bash scripts/gpu/recovery.sh kvbudget  restart.fixed_kv_budget: start, kill, restart (~3 min)
#   bash scripts/gpu/recovery.sh env       warm start + tok/s: default, in-process engine
#                                          (VLLM_ENABLE_V1_MULTIPROCESSING=0), fork     (~6 min)
# The fourth sitting's two stages (after the forked EngineCore and restart.preimport):
#   bash scripts/gpu/recovery.sh fast      kill-engine (its first start cold), kill-api, hang,
#                                          all with restart.preimport = true          (~7 min)
#   bash scripts/gpu/recovery.sh compare   kill-engine with vLLM's spawned EngineCore (the old
#                                          default), forked without preimport, and the fixed KV
#                                          budget with preimport                      (~7 min)
# The fifth sitting's two stages (after the deadline-driven loop and the fixed KV budget on by
# default), both with restart.preimport = true:
#   bash scripts/gpu/recovery.sh fifth-a   kill-engine, each from an empty compile cache: with
#                                          VLLM_USE_MEGA_AOT_ARTIFACT=1 (vLLM's default only from
#                                          torch 2.12; the image has 2.11) and without; writes
#                                          which loads faster to /tmp/qwen4090_fifth_choice (~7 min)
#   bash scripts/gpu/recovery.sh fifth-b   kill-engine, kill-api, hang in the faster one's warm
#                                          cache, restart.stable_after = 10 s: each fault comes
#                                          after a healthy period, as a fault after the default
#                                          300 s would in the field                     (~6 min)
#   bash scripts/gpu/recovery.sh fifth-c   kill-engine from an empty cache with no --set/--env:
#                                          the mega artifact as child.DEFAULT_ENV sets it (~4 min)
# Results: $OUT/recovery-<stage>.json (+ .log); docs/recovery.md says how to read them.
# Env: OUT, QWEN4090_GPU_MODEL, CACHE (VLLM_CACHE_ROOT, default /tmp/qwen4090_recovery_cache).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
stage=${1:?usage: recovery.sh cold|crash|hang|kvbudget|env|fast|compare|fifth-a|fifth-b|fifth-c}
OUT=${OUT:-/tmp/qwen4090_gpu_out}
CACHE=${CACHE:-/tmp/qwen4090_recovery_cache}
mkdir -p "$OUT"
export QWEN4090_KEEP_LOGS=${QWEN4090_KEEP_LOGS:-/tmp/qwen4090_daemon_logs/$stage}
KEEP=$QWEN4090_KEEP_LOGS
mkdir -p "$KEEP"
# The bench's daemon runs with PYTHONPATH=daemon only, so structlog (and prometheus_client, if
# the image lacks it) go into the interpreter itself; they travel as wheels in .whl/ (carry it).
for mod in structlog prometheus_client; do
  python3 -c "import $mod" 2>/dev/null && continue
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/${mod}-*.whl \
    || python3 -m pip install -q --no-index --no-deps --no-compile --user .whl/${mod}-*.whl \
    || { echo "cannot install .whl/${mod}-*.whl"; exit 1; }
done
if ! python3 -c 'import compressed_tensors, loguru' 2>/dev/null && [ -d /tmp/vllm_lab/bundle/whl_extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    /tmp/vllm_lab/bundle/whl_extra/compressed_tensors-*.whl /tmp/vllm_lab/bundle/whl_extra/loguru-*.whl
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
  > "$OUT/nvidia-smi-recovery-$stage.txt" 2>&1
# What a snapshot restore would need (docs/recovery.md, item 4): is any of it in the image?
{ for t in criu cuda-checkpoint nvidia-smi sudo; do printf '%s: %s\n' "$t" "$(command -v $t || echo missing)"; done
  id; uname -r; cat /proc/sys/kernel/io_uring_disabled 2>/dev/null || echo "io_uring_disabled: n/a"
  grep -E '^Cap(Eff|Bnd)' /proc/self/status; } > "$OUT/snapshot-prereqs.txt" 2>&1

# Triton builds its CUDA stub with $CC at the first kernel; the image's linker may fail on
# glibc's libc.so script (third sitting, scripts/gpu/installed.sh): then vLLM gets a CC that
# links with a relative copy of it.
CCENV=()
echo 'int f(void){return 1;}' >/tmp/qwen4090-cc.c
if ! "${CC:-gcc}" -shared -fPIC /tmp/qwen4090-cc.c -o /tmp/qwen4090-cc.so 2>"$OUT/cc-probe.txt"; then
  mkdir -p /usr/local/lib/qwen4090-ldfix
  printf 'OUTPUT_FORMAT(elf64-x86-64)\nGROUP ( libc.so.6 libc_nonshared.a AS_NEEDED ( ld-linux-x86-64.so.2 ) )\n' \
    >/usr/local/lib/qwen4090-ldfix/libc.so
  printf '#!/bin/sh\nexec %s "$@" -L/usr/local/lib/qwen4090-ldfix -L/lib/x86_64-linux-gnu -L/usr/lib/x86_64-linux-gnu -L/lib64\n' \
    "$(command -v "${CC:-gcc}")" >/usr/local/bin/qwen4090-cc
  chmod 755 /usr/local/bin/qwen4090-cc
  /usr/local/bin/qwen4090-cc -shared -fPIC /tmp/qwen4090-cc.c -o /tmp/qwen4090-cc.so 2>>"$OUT/cc-probe.txt" \
    && CCENV=(--env CC=/usr/local/bin/qwen4090-cc)
fi
echo "cc: ${CCENV[*]:-the default links}" | tee -a "$OUT/cc-probe.txt"

bench() {  # bench NAME ARGS...: one bench run, its JSON and log under $OUT ($T: its time limit)
  local name=$1; shift
  timeout "${T:-520}" python3 bench/recovery.py --base gpu --cache "$CACHE" --label "$name" \
    --out "$OUT/recovery-$name.json" "${CCENV[@]}" "$@" 2>&1 | tee "$OUT/recovery-$name.log" | tail -12
}

case $stage in
  cold) bench cold --scenarios cold,warm ;;
  crash) bench crash --scenarios kill-engine,kill-api ;;
  hang) bench hang --scenarios hang ;;
  kvbudget) bench kvbudget --scenarios kill-engine --set restart.fixed_kv_budget=true ;;
  env)
    export QWEN4090_BENCH_CONCURRENCY=32 T=170  # three runs in one call: 3 x 170 s < 9 min
    bench env-default --scenarios serve
    bench env-inproc --scenarios serve --env VLLM_ENABLE_V1_MULTIPROCESSING=0
    bench env-fork --scenarios serve --env VLLM_WORKER_MULTIPROC_METHOD=fork ;;
  fast) T=560 bench fast --scenarios kill-engine,kill-api,hang --set restart.preimport=true ;;
  compare)
    T=250 bench spawn --scenarios kill-engine --env VLLM_WORKER_MULTIPROC_METHOD=spawn
    T=150 bench fork --scenarios kill-engine
    T=150 bench kvbudget-pre --scenarios kill-engine --set restart.fixed_kv_budget=true \
      --set restart.preimport=true ;;
  fifth-a)
    CACHE=/tmp/qwen4090_cache_mega T=270 bench mega --scenarios kill-engine \
      --set restart.preimport=true --env VLLM_USE_MEGA_AOT_ARTIFACT=1
    CACHE=/tmp/qwen4090_cache_plain T=270 bench plain --scenarios kill-engine \
      --set restart.preimport=true
    python3 - "$OUT" <<'PY' | tee /tmp/qwen4090_fifth_choice.txt
import json, sys
def load(name):
    try:
        r = json.load(open(f"{sys.argv[1]}/recovery-{name}.json"))["results"][0]
        t = r["restart_startup_timeline"]
        return t["took"]["compiled"] if t.get("compile_cache") == "hit" else None, r
    except (OSError, KeyError, IndexError, ValueError, TypeError):
        return None, None
mega, plain = load("mega")[0], load("plain")[0]
pick = "mega" if mega is not None and (plain is None or mega < plain - 1.0) else "plain"
print(f"compile on the warm restart: mega {mega} s, plain {plain} s -> {pick}")
open("/tmp/qwen4090_fifth_choice", "w").write(pick)
PY
    ;;
  fifth-b)
    pick=$(cat /tmp/qwen4090_fifth_choice 2>/dev/null || echo plain)
    extra=(); [ "$pick" = mega ] && extra=(--env VLLM_USE_MEGA_AOT_ARTIFACT=1)
    echo "fifth-b: the $pick cache and env"
    CACHE=/tmp/qwen4090_cache_$pick T=560 bench fifth --scenarios kill-engine,kill-api,hang \
      --set restart.preimport=true --set restart.stable_after=10 "${extra[@]}" ;;
  fifth-c)  # the product's defaults alone (mega artifact from child.DEFAULT_ENV), cold cache
    CACHE=/tmp/qwen4090_cache_default T=300 bench default --scenarios kill-engine ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
# At most 8 files come back from $OUT: the JSON results stay, the logs go into one archive
# (with each daemon's whole log, kept by tests/support/daemon.py's QWEN4090_KEEP_LOGS).
(cd "$OUT" && tar czf "logs-$stage.tgz" ./*.log ./*.txt -C "$KEEP" . && rm -f ./*.log ./*.txt)
ls -l "$OUT"
