#!/usr/bin/env bash
# Issue 30.6 on the lent GPU (the kit of ../shared/gpu installed): the plain restart, no standby,
# with the shipped [watch], [restart] and [stop] defaults over the lab config (tests/gpu/lab.py:
# model, fp8, gpu_memory_utilization 0.16, dummy weights): EngineCore SIGKILL and SIGSTOP x2,
# 2 clients.  Results: $OUT/failover-defaults.{json,txt}, $OUT/failover-defaults-daemon.log.gz.
# Usage (repo root, carry .whl): bash scripts/gpu/defaults.sh   (~8 minutes)
set -u
cd "$(dirname "$0")/../.." || exit 1
. scripts/gpu/kit.sh
D=/tmp/qwen4090_defaults; mkdir -p $D
extra=()  # SETS: more --set SECTION.KEY=JSON, space-separated (on an H100: vllm.gpu_memory_utilization=0.28)
for s in ${SETS:-}; do extra+=(--set "$s"); done
timeout 530 python3 bench/failover.py --base gpu --standby off --faults kill-engine,hang --repeat 2 \
  --clients 2 --budget 330 --set 'restart.standby="off"' \
  --set watch.poll_interval=5 --set watch.hang_timeout=60 --set watch.canary_interval=30 \
  --set watch.canary_timeout=30 --set watch.unhealthy_timeout=30 \
  --set restart.backoff_initial=2 --set restart.budget_failures=5 \
  --set stop.drain_timeout=30 --set stop.term_timeout=15 "${extra[@]}" \
  --log $D/daemon.log --out $OUT/failover-defaults.json > $OUT/failover-defaults.txt 2>&1
echo "rc=$?" >> $OUT/failover-defaults.txt
gzip -c $D/daemon.log > $OUT/failover-defaults-daemon.log.gz
tail -15 $OUT/failover-defaults.txt
