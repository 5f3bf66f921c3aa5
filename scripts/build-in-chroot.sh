#!/usr/bin/env bash
# Build (and install) the .deb on another release, in a fresh minbase chroot made by
# mmdebstrap: `make deb` on a tree with only dpkg-dev must list the missing build
# dependencies; after installing exactly that list it must build; then `apt-get install` of
# the result must succeed (maintainer scripts without a running systemd: sysusers, tmpfiles,
# enable). No systemd boot and no vLLM: that is scripts/system-test.sh.
#   bash scripts/build-in-chroot.sh SUITE [MIRROR]     e.g. bookworm, trixie, jammy, noble
# Root only; needs mmdebstrap (and ubuntu-keyring for Ubuntu suites) and the network to MIRROR.
# Writes build/chroot-SUITE/{log.txt,*.deb}; exit 0 only when all three steps passed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8
SUITE=${1:?usage: $0 SUITE [MIRROR]}
case $SUITE in
    # Debian 12 has no ubuntu-keyring package: with its keyring file use it, else the throw-away
    # chroot trusts the archive unsigned ([trusted=yes]; nothing built there is shipped).
    jammy|noble) MIRROR=${2:-http://archive.ubuntu.com/ubuntu}
                 # shellcheck disable=SC2054  # main,universe is one debootstrap argument
                 if [ -f /usr/share/keyrings/ubuntu-archive-keyring.gpg ]; then
                     EXTRA=(--components=main,universe --keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg)
                 else
                     EXTRA=(--components=main,universe); MIRROR="deb [trusted=yes] $MIRROR $SUITE main universe"
                 fi ;;
    *) MIRROR=${2:-http://deb.debian.org/debian}; EXTRA=() ;;
esac
OUTD=$PWD/build/chroot-$SUITE
rm -rf "$OUTD"; mkdir -p "$OUTD"
SRC=$(mktemp --suffix=.tar); ROOTFS=$(mktemp -d)
trap 'rm -rf "$SRC" "$ROOTFS"' EXIT
git ls-files -z -c -o --exclude-standard | tar -c --null -T - -f "$SRC"
# Inside: 1) make deb with only dpkg-dev (must name the missing packages), 2) install exactly
# the packages it named, make deb again, 3) apt-get install the .deb.
cat >"$OUTD/inside.sh" <<'IN'
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive
cd /src
command -v apt-get >/dev/null || { echo "RESULT: no apt-get in the chroot ($(ls /usr/bin | grep -c .) files in /usr/bin)"; exit 1; }
echo "== 1. make deb on a tree with dpkg-dev only"
sh scripts/build-deb.sh >/tmp/b1 2>&1; echo "exit $?"; cat /tmp/b1
pkgs=$(sed -n 's/^build-deb: missing build dependencies: //p' /tmp/b1)
[ -n "$pkgs" ] || { echo "RESULT: no list of missing packages"; exit 1; }
echo "== 2. apt-get install exactly: $pkgs"
apt-get install -y -q --no-install-recommends $pkgs >/tmp/apt2 2>&1 || { tail -20 /tmp/apt2; echo "RESULT: apt failed"; exit 1; }
sh scripts/build-deb.sh >/tmp/b2 2>&1; rc=$?; tail -n 5 /tmp/b2
[ $rc = 0 ] || { echo "RESULT: build failed after installing the list"; exit 1; }
dpkg-deb -f dist/*.deb Depends
echo "== 3. apt-get install ./dist/*.deb (no systemd running)"
apt-get install -y -q ./dist/*.deb >/tmp/apt3 2>&1; rc=$?; tail -n 8 /tmp/apt3
[ $rc = 0 ] || { echo "RESULT: install failed"; exit 1; }
getent passwd qwen4090; ls -ld /var/lib/qwen4090 /var/lib/qwen4090/models
qwen4090 --version; qwen4090 check-config; rc=$?; echo "check-config exit $rc (78 expected: no model yet)"
[ $rc = 78 ] || { echo "RESULT: the installed command does not work"; exit 1; }
sed -n '/tmpfiles/,/fi$/p' /var/lib/dpkg/info/qwen4090.postinst
echo "RESULT: ok ($(. /etc/os-release; echo "$PRETTY_NAME"), $(dpkg-query -W -f='${Package} ${Version}, ' debhelper systemd python3))"
IN
t0=$(date +%s)
timeout 1500 mmdebstrap --variant=minbase --include=apt,dpkg-dev,git,ca-certificates "${EXTRA[@]}" \
    --customize-hook="mkdir -p \"\$1/src\" && tar -x -C \"\$1/src\" -f $SRC" \
    --customize-hook="cp $OUTD/inside.sh \"\$1/inside.sh\"" \
    --customize-hook="chroot \"\$1\" sh -c 'cd /src && git init -q . 2>/dev/null; bash /inside.sh' >$OUTD/log.txt 2>&1 || true" \
    --customize-hook="cp \"\$1\"/src/dist/qwen4090_*.deb $OUTD/ || true" \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$OUTD/mmdebstrap.log" 2>&1 || { tail -20 "$OUTD/mmdebstrap.log"; exit 1; }
echo "$SUITE: $(( $(date +%s) - t0 ))s" >>"$OUTD/log.txt"
grep '^RESULT' "$OUTD/log.txt"; tail -n1 "$OUTD/log.txt"
grep -q '^RESULT: ok' "$OUTD/log.txt"
