#!/usr/bin/env bash
# Issue 21 on the H200 (the standby engine), with the kit of ../shared/gpu installed (vLLM 0.26,
# the Qwen3-14B model directory at /tmp/vllm_lab/model: config + tokenizer) and tests/gpu/lab.py's
# config (fp8, gpu_memory_utilization 0.16, max_model_len 8192, torch.compile and CUDA graphs
# on). One stage per device call (carry .whl), each under ~9 minutes, in this order while the
# machine stays warm:
#   bash scripts/gpu/standby.sh checkpoint  random bf16 weights of Qwen3-14B's shapes (27.5 GiB,
#                                           4 GiB shards) into the model directory, so that vLLM's
#                                           real loader reads a checkpoint (no --load-format
#                                           dummy); disk free before/after              (~2 min)
#   bash scripts/gpu/standby.sh probe       raw vLLM, no qwen4090: --enable-sleep-mode, sleep
#                                           level 1, wake, twice: GPU memory kept, host RSS,
#                                           seconds per call, the same greedy answer  (~4 min)
#   bash scripts/gpu/standby.sh faults      bench/failover.py in the background (restart.standby
#                                           = sleep, the real loader, hang_timeout 15 s, 2 clients,
#                                           kill-engine x5 then hang x5), then waits for it up to
#                                           WAIT s (500); call it again until it says "done": each
#                                           call copies the JSON so far and the logs to $OUT
#                                           (~15-20 min in all: 2-3 calls)
#   bash scripts/gpu/standby.sh stop        stop a faults run (the bench, then its daemon)
# Env: SHIPPED=1 (faults: the shipped defaults, restart.standby = "auto", instead of the lab's
# sleep + hang_timeout 15), OUT, QWEN4090_GPU_MODEL (the model directory), LOAD (checkpoint; dummy: the lab's
# --load-format dummy, no checkpoint stage), REPEAT (5), FAULTS (kill-engine,hang),
# SETS (more --set SECTION.KEY=JSON for the daemon, space-separated), WAIT (500 s), BUDGET
# (seconds for the faults: no repeat starts that would likely pass it; 0 = none). Each repeat
# is ~1.5 min on the H200 (failover, restart.standby_quiet 10 s, a standby's start with real
# weights, its sleep): REPEAT=5 is ~15 min of faults after a ~4 min start; REPEAT=3 fits a
# 30-minute device session beside the kit's install, checkpoint and probe.
# Results: $OUT/checkpoint.json, $OUT/sleep-probe.json (+ .log), $OUT/failover-h200.json,
# $OUT/failover-bench.txt, $OUT/failover-daemon.log.gz, $OUT/failover-rss.log (host RSS > 1 GiB, 20 s).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
stage=${1:?usage: standby.sh checkpoint|probe|faults|stop}
# shellcheck source=scripts/gpu/kit.sh
. scripts/gpu/kit.sh
MODEL=${QWEN4090_GPU_MODEL:-/tmp/vllm_lab/model}
MODEL_NAME=qwen3-14b-dummy
W=/tmp/qwen4090_standby
mkdir -p "$W"
REPEAT=${REPEAT:-5}
FAULTS=${FAULTS:-kill-engine,hang}
WAIT=${WAIT:-500}
BUDGET=${BUDGET:-0}

running() { [ -f "$W/bench.pid" ] && kill -0 "$(cat "$W/bench.pid")" 2>/dev/null; }
gpu() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>&1 | head -1; }
collect() {  # what the faults run has so far, into this call's $OUT
  cp "$W/bench.out" "$OUT/failover-bench.txt" 2>/dev/null
  cp "$W/failover-h200.json" "$OUT/" 2>/dev/null
  cp "$W/rss.log" "$OUT/failover-rss.log" 2>/dev/null
  [ -f "$W/daemon.log" ] && gzip -c "$W/daemon.log" > "$OUT/failover-daemon.log.gz"
}
if running && [ "$stage" != faults ] && [ "$stage" != stop ]; then
  echo "a faults run is going (pid $(cat "$W/bench.pid")): standby.sh faults to wait, stop to end it"
  exit 1
fi

case $stage in
checkpoint)
  [ -f "$MODEL/config.json" ] || { echo "no $MODEL/config.json (the kit's dev_install.sh writes it)"; exit 1; }
  echo "disk before: $(df -h --output=avail,size "$MODEL" | tail -1)"
  timeout 540 python3 bench/random_checkpoint.py "$MODEL" --shard-gib 4 | tee "$OUT/checkpoint.json"
  rc=${PIPESTATUS[0]}
  echo "disk after:  $(df -h --output=avail,size "$MODEL" | tail -1)"
  ls -la "$MODEL"
  free -g | head -2
  exit "$rc"
  ;;
probe)
  load=()
  [ -f "$MODEL/model.safetensors.index.json" ] || { load=(--load-format dummy); echo "no checkpoint in $MODEL: --load-format dummy"; }
  echo "GPU before: $(gpu)"
  timeout 540 python3 bench/sleep_probe.py --model "$MODEL" --name "$MODEL_NAME" --cycles 2 \
    --start-timeout 420 --out "$OUT/sleep-probe.json" -- --quantization fp8 \
    --gpu-memory-utilization 0.16 --max-model-len 8192 --max-num-seqs 8 \
    --max-num-batched-tokens 8192 "${load[@]}"
  rc=$?
  echo "GPU after: $(gpu)"
  grep -E "sleep|wake|KV cache size|Loading weights took|Model loading took" "$OUT/sleep-probe.log" 2>/dev/null | cut -c1-300 | tail -20
  exit "$rc"
  ;;
faults)
  if ! running; then
    mode="sleep"
    sets=(--set 'restart.standby="sleep"' --set 'watch.hang_timeout=15')
    if [ "${SHIPPED:-0}" = 1 ]; then  # issue 30: the shipped defaults over the lab's model
      # settings (restart.standby = "auto", the whole [watch], [restart] and [stop]), except
      # restart.budget_failures: ten injected faults in 15 minutes would spend the shipped 5
      mode="auto"
      sets=(--set 'restart.standby="auto"' --set watch.poll_interval=5 --set watch.hang_timeout=60
            --set watch.hang_floor=1.5 --set watch.canary_interval=30 --set watch.canary_timeout=30
            --set watch.unhealthy_timeout=30 --set watch.health_timeout=5
            --set restart.backoff_initial=2 --set restart.budget_failures=12
            --set stop.drain_timeout=30 --set stop.term_timeout=15)
      echo "SHIPPED=1: the shipped defaults, restart.standby = auto (budget_failures 12)"
    fi
    if [ "${LOAD:-checkpoint}" = dummy ]; then  # the lab's --load-format dummy: no checkpoint stage
      echo "LOAD=dummy: weights by --load-format dummy"
    else
      [ -f "$MODEL/model.safetensors.index.json" ] || { echo "no checkpoint in $MODEL: run the checkpoint stage first (or LOAD=dummy)"; exit 1; }
      sets+=(--set 'vllm.extra_args=[]')
    fi
    rm -f "$W/bench.rc" "$W/failover-h200.json" "$W/daemon.log" "$W/rss.log"
    for s in ${SETS:-}; do sets+=(--set "$s"); done
    rm -f "$W/bench.pid"
    {  # the bench's own pid in bench.pid (stop signals it: it stops its daemon), its rc after
      printf 'cd %q\n' "$PWD"
      printf '%q ' python3 bench/failover.py --base gpu --standby "$mode" --faults "$FAULTS" \
        --repeat "$REPEAT" --clients 2 --budget "$BUDGET" "${sets[@]}" --log "$W/daemon.log" \
        --pidfile "$W/daemon.pid" --out "$W/failover-h200.json"
      printf '&\necho $! > %q\nwait $!\necho $? > %q\n' "$W/bench.pid" "$W/bench.rc"
    } > "$W/run.sh"
    echo "starting: $(sed -n 2p "$W/run.sh")"
    setsid bash "$W/run.sh" > "$W/bench.out" 2>&1 < /dev/null &
    for _ in $(seq 20); do [ -s "$W/bench.pid" ] && break; sleep 0.5; done
  fi
  seen=0
  for i in $(seq "$WAIT"); do
    running || break
    # host memory of both engines (the sleeping one holds its weights pinned): every 20 s
    if [ $((i % 20)) = 1 ]; then
      { date +%T
        for p in $(ps -eo pid=,rss= | awk '$2 > 1048576 {print $1}'); do  # anon vs file: the
          # real loader's mmap of the checkpoint counts in RSS too
          printf '%s pgid=%s %s %s\n' "$p" "$(ps -o pgid= -p "$p" | tr -d ' ')" \
            "$(grep -E '^(RssAnon|RssFile|RssShmem|VmPin)' "/proc/$p/status" 2>/dev/null | tr -s ' \t\n' ' ')" \
            "$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-80)"
        done; } >> "$W/rss.log"
    fi
    n=$(wc -l < "$W/bench.out")
    if [ "$n" -gt "$seen" ]; then  # collected at once: a call cut short keeps what was seen
      sed -n "$((seen + 1)),${n}p" "$W/bench.out" | cut -c1-400; seen=$n; collect
    fi
    sleep 1
  done
  collect
  if running; then
    echo "still running after ${WAIT}s (GPU $(gpu)): call 'standby.sh faults' again to keep waiting"
    exit 0
  fi
  tail -n +"$((seen + 1))" "$W/bench.out" | cut -c1-400
  echo "done: rc=$(cat "$W/bench.rc" 2>/dev/null || echo '?')"
  grep -E '"event": *"(failover_[a-z]+|standby_[a-z]+)"' "$W/daemon.log" 2>/dev/null | cut -c1-300 | tail -30
  ;;
stop)
  if running; then
    kill -TERM "$(cat "$W/bench.pid")" 2>/dev/null
    for _ in $(seq 60); do running || break; sleep 1; done
  fi
  if [ -f "$W/daemon.pid" ] && kill -0 "$(cat "$W/daemon.pid")" 2>/dev/null; then
    kill -TERM "$(cat "$W/daemon.pid")"
    for _ in $(seq 60); do kill -0 "$(cat "$W/daemon.pid")" 2>/dev/null || break; sleep 1; done
  fi
  collect
  echo "stopped; GPU $(gpu)"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
