#!/bin/sh
# Boot a Debian tree with systemd as PID 1 (systemd-nspawn --boot, works on a host whose own
# PID 1 is not systemd), run one command inside it through nsenter, power it off.
# Usage: nspawn-run.sh ROOTFS [--bind-ro=SRC:DST ...] -- COMMAND [ARGS...]
# The tree itself is never changed (--ephemeral boots a throw-away copy). Exit status: COMMAND's,
# or 90 when the guest did not boot. Every wait is bounded. Root only.
set -eu
ROOT=$1; shift
BINDS=
while [ $# -gt 0 ] && [ "$1" != "--" ]; do BINDS="$BINDS $1"; shift; done
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: $0 ROOTFS [--bind-ro=SRC:DST ...] -- COMMAND" >&2; exit 2; }
LOG=${NSPAWN_LOG:-$(mktemp /tmp/nspawn-log.XXXXXX)}

# --register=no --keep-unit: no host systemd/machined to talk to. --private-network: the guest's
# ports (vLLM's 8000) do not clash with the host's. --console=passive: no tty needed.
# shellcheck disable=SC2086
systemd-nspawn --boot -D "$ROOT" --machine="qwen4090-ci-$$" --register=no --keep-unit \
    --console=passive --ephemeral --private-network $BINDS >"$LOG" 2>&1 &
NSPAWN=$!
LEADER=
stop_guest() {
    if [ -n "$LEADER" ] && kill -0 "$NSPAWN" 2>/dev/null; then
        nsenter -t "$LEADER" -a systemctl poweroff >/dev/null 2>&1 || true
        i=0; while kill -0 "$NSPAWN" 2>/dev/null && [ $i -lt 150 ]; do sleep 0.2; i=$((i+1)); done
    fi
    if kill -0 "$NSPAWN" 2>/dev/null; then
        kill "$NSPAWN" 2>/dev/null || true; sleep 2
        kill -0 "$NSPAWN" 2>/dev/null && kill -9 "$NSPAWN" 2>/dev/null || true
    fi
    wait "$NSPAWN" 2>/dev/null || true
}
trap stop_guest EXIT
trap 'exit 130' INT TERM

i=0   # the guest's systemd is nspawn's child
while [ -z "$LEADER" ] && [ $i -lt 150 ]; do
    LEADER=$(pgrep -P "$NSPAWN" 2>/dev/null | head -n1 || true)
    [ -n "$LEADER" ] || { kill -0 "$NSPAWN" 2>/dev/null || break; sleep 0.2; }
    i=$((i+1))
done
[ -n "$LEADER" ] || { echo "nspawn-run: guest did not start:" >&2; tail -20 "$LOG" >&2; exit 90; }
# The first try can fail with "Failed to connect to bus" while the guest's dbus comes up.
i=0; state=
while [ $i -lt 60 ]; do
    state=$(timeout 120 nsenter -t "$LEADER" -a systemctl is-system-running --wait 2>/dev/null || true)
    case $state in running|degraded) break ;; esac
    sleep 1; i=$((i+1))
done
case $state in running|degraded) ;; *)
    echo "nspawn-run: guest did not boot (state '$state'):" >&2; tail -20 "$LOG" >&2; exit 90 ;;
esac
rc=0
nsenter -t "$LEADER" -a env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 TERM=dumb "$@" || rc=$?
exit $rc
