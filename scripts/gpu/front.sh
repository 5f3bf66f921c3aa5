#!/usr/bin/env bash
# Issue 20 on the H200, with the kit of ../shared/gpu installed (vLLM 0.26, dummy Qwen3-14B at
# /tmp/vllm_lab/model; tests/gpu/lab.py's config: fp8, CUDA graphs and torch.compile on). One
# stage per device call, in this order while the machine stays warm:
#   bash scripts/gpu/front.sh start    qwen4090 run (front on) in a session of its own, to READY
#                                      (max_num_seqs 32, gpu_memory_utilization 0.3)   (~3 min)
#   bash scripts/gpu/front.sh cost     bench/front_cost.py at c=1, then c=32: vLLM direct (:18000)
#                                      vs the front (:8000, CPU of the supervisor process alone)
#                                      vs vLLM again (the noise floor), 3 ABBA rounds  (~4 min)
#   bash scripts/gpu/front.sh faults   SIGTERM the daemon; bench/front_faults.py: EngineCore
#                                      SIGKILL, SIGSTOP (hang_timeout 15 s) and a [vllm] reload
#                                      under 16 clients + 4 long streams              (~6 min)
# Results: $OUT/front-*.json and the daemon logs; docs/benchmarks.md and docs/recovery.md say
# what they showed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
stage=${1:?usage: front.sh start|cost|faults}
# shellcheck source=scripts/gpu/kit.sh
. scripts/gpu/kit.sh
W=/tmp/qwen4090_front
mkdir -p "$W"
MODEL_NAME=qwen3-14b-dummy
bench() {  # c, requests per round
  python3 bench/front_cost.py --engine http://127.0.0.1:18000 --model "$MODEL_NAME" \
    --proxy qwen4090-front http://127.0.0.1:8000 "=$(cat "$W/pid")" --control \
    --concurrency "$1" --requests "$2" --rounds 3 --prompt-len 1024 --max-tokens 128 \
    --out "$OUT/front-cost-c$1.json" 2>&1 | tee "$OUT/front-cost-c$1.txt"
}
case $stage in
start)
  python3 - "$W/qwen4090.toml" <<'EOF'
import sys
from pathlib import Path
sys.path[:0] = ["tests/gpu", "."]
import lab
lab.write_config(Path(sys.argv[1]), vllm={"max_num_seqs": 32, "gpu_memory_utilization": 0.3},
                 status={"enabled": False}, front={"enabled": True})
EOF
  RUNTIME_DIRECTORY=$W setsid python3 -m qwen4090 run --config "$W/qwen4090.toml" \
    > "$W/daemon.log" 2>&1 < /dev/null &
  echo $! > "$W/pid"
  for _ in $(seq 480); do
    grep -q '"to": *"ready"' "$W/daemon.log" && break
    kill -0 "$(cat "$W/pid")" 2>/dev/null || break
    sleep 1
  done
  cp "$W/daemon.log" "$OUT/front-daemon-start.log"
  grep -q '"to": *"ready"' "$W/daemon.log" || { echo "not READY"; tail -30 "$W/daemon.log"; exit 1; }
  grep -E '"event": *"(front_listening|child_spawned|ready_notified|warmup_finished)"' "$W/daemon.log" | cut -c1-400
  ;;
cost) bench 1 8; bench 32 96 ;;
faults)
  if [ -f "$W/pid" ]; then
    kill -TERM "$(cat "$W/pid")" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$(cat "$W/pid")" 2>/dev/null || break; sleep 1; done
    cp "$W/daemon.log" "$OUT/front-daemon-cost.log"
  fi
  python3 bench/front_faults.py --base gpu --clients 16 --streams 4 \
    --set 'watch.hang_timeout=15' --set 'vllm.max_num_seqs=32' \
    --set 'vllm.gpu_memory_utilization=0.3' --out "$OUT/front-faults-h200.json" \
    2>&1 | tail -20
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
