#!/usr/bin/env bash
# The test command (README; .ci/run runs it): set up, lint, type-check, then every test tier
# that this machine can run.  Fresh Debian 12 machine as root, no GPU: about 10-20 minutes.
#   unit         no processes, fake clock (seconds)
#   integration  the real supervisor + the real CPU vLLM with the tiny model (a few minutes)
#   system       the .deb under a real systemd in systemd-nspawn (scripts/system-test.sh)
#   gpu          skipped here: run scripts/gpu/validate.sh on a GPU machine
# QWEN4090_SKIP_SYSTEM=1 leaves the system tier out (e.g. on a machine that is not root).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { printf '\n== %s (%ss)\n' "$*" "$(( $(date +%s) - start ))"; }

step "setup"
scripts/setup-runtime.sh
# headless Chromium renders the status page in tests/integration/test_operability.py;
# the shell linter (shellcheck) runs below; HAProxy and nginx balance two qwen4090 instances in
# tests/integration/test_balancer.py (nginx's postinst starts it on port 80 only where
# policy-rc.d allows and the port is free; the tests never use port 80).  All are installed
# (as root, from apt) only where missing.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v nginx >/dev/null 2>&1 || missing+=(nginx)
if [ "$(id -u)" = 0 ] && [ ${#missing[@]} -gt 0 ]; then
  (timeout 300 apt-get update -q >/dev/null && timeout 600 apt-get install -y -q \
     --no-install-recommends "${missing[@]}" >/dev/null) || echo "${missing[*]} could not be installed"
fi

step "lint and types"
.venv/bin/ruff check daemon tests bench
.venv/bin/mypy
# every shell script of the tree (by name or by #! line); warnings and errors fail, style
# notes do not (a check that is wrong for one line is disabled there, with the reason)
mapfile -t shell_scripts < <(git ls-files | while read -r f; do
  case $f in *.sh) echo "$f" ;; *) head -c 64 "$f" 2>/dev/null | grep -qE '^#!.*\b(ba)?sh\b' && echo "$f" ;; esac
done)
shellcheck -S warning -x "${shell_scripts[@]}"

step "unit + integration tests"
rc=0
# --durations: the slowest tests in the log (CI must stay well under 60 minutes on 2 cores)
.venv/bin/pytest tests -m "not gpu and not system" -p no:cacheprovider --durations=25 || rc=$?

if [ "${QWEN4090_SKIP_SYSTEM:-0}" != 1 ] && [ -f scripts/system-test.sh ]; then
  step "system test (.deb under systemd-nspawn)"
  bash scripts/system-test.sh || rc=$?
fi
step "done, exit $rc"
exit $rc
