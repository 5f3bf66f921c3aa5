#!/usr/bin/env bash
# Print a config for the CPU vLLM + tiny model built by scripts/setup-runtime.sh (the tests'
# CPU runtime config, tests/support/runtime.py, with the shipped timers).
# Usage: scripts/demo-config.sh [PORT] > FILE
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
exec python3 "$root/tests/support/runtime.py" demo --port "${1:-8000}" --root "$root"
