#!/bin/sh
# Build dist/qwen4090_<version>_all.deb from the working tree (make deb).
# The repo's top level stays as it is: this copies the sources and packaging/debian into
# build/deb/qwen4090-<version>/ and runs dpkg-buildpackage there (debhelper + pybuild).
# Needs dpkg-dev and the Build-Depends of packaging/debian/control (debhelper dh-python
# pybuild-plugin-pyproject python3-all python3-setuptools, build-essential); when some are
# missing it lists them all with the apt-get (or mk-build-deps) line and stops.
# scripts/system-test.sh installs them. Prints the path of the .deb on its last line.
#
# Versions (docs/packaging.md, "Versions"): every build gets one that orders. The top entry of
# packaging/debian/changelog is version V (pyproject.toml must say V too):
#   V                                 released entry, built at the commit that added it, clean tree
#   V+git<time>.<n>.<hash>            released entry, n commits later (a snapshot after V)
#   V~git<time>.<n>.<hash>            an UNRELEASED entry (a snapshot before V)
#   ... .d<seconds since 1970>        any of these built with uncommitted (or untracked) changes
# <time> is the commit's time (UTC, YYMMDDHHMM), <n> the number of commits since the one that
# added V's entry, <hash> the abbreviated commit. The time comes first: a shallow clone (git
# clone --depth 1) counts fewer commits, and its build must still sort after a full clone's
# build of a commit made a minute or more before (issue 31.3); <n> orders those of one minute.
# (Until then <date>.<n> with an 8-digit YYYYMMDD date: a 10-digit time still sorts after it.)
# Without git: V. (Kept short: lintian warns when qwen4090_<version>_amd64.buildinfo, adjusted
# for the architecture, passes 80 characters.)
# One version names one content: dist/qwen4090_<version>_all.deb.src-sha256 records the
# sha256 of the source tree each build was made from, and a build of a version already in
# dist/ from other sources is refused (dpkg/apt would take it for the same package).
#   sh scripts/build-deb.sh --print-version   prints the version it would build, builds nothing
set -eu
cd "$(dirname "$0")/.."
# Debian's python3 first: a pyenv/venv python3 on PATH breaks pybuild ("No module named build").
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# dpkg-dev first: its dpkg-parsechangelog gives the version, its dpkg-checkbuilddeps the rest.
command -v dpkg-checkbuilddeps >/dev/null 2>&1 || {
    echo "build-deb: dpkg-dev is not installed; run: sudo apt-get install --no-install-recommends" \
         "dpkg-dev, then make deb again (it will list the rest)" >&2; exit 1; }
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
DEBVERSION=$(dpkg-parsechangelog -l packaging/debian/changelog -S Version)
[ "$VERSION" = "$DEBVERSION" ] || {
    echo "build-deb: pyproject.toml says $VERSION but packaging/debian/changelog says $DEBVERSION;" \
         "add a changelog entry (dch -v $VERSION)" >&2; exit 1; }
DIST=$(dpkg-parsechangelog -l packaging/debian/changelog -S Distribution)
PKGVERSION=$VERSION
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && git rev-parse -q --verify HEAD >/dev/null; then
    # the commit that gave V's entry its header line as it is now (opened it, or released it:
    # dch -r turns UNRELEASED into unstable), and how far HEAD is from it
    since=$(git log -1 --format=%H -S"qwen4090 ($VERSION) $DIST;" -- packaging/debian/changelog)
    n=$(git rev-list --count ${since:+"$since"..}HEAD)
    snap="git$(TZ=UTC0 git log -1 --date=format-local:%y%m%d%H%M --format=%cd HEAD).$n.$(git rev-parse --short=7 HEAD)"
    dirty=
    [ -z "$(git status --porcelain --untracked-files=normal -- . 2>/dev/null)" ] \
        || dirty=.d$(date +%s)
    if [ "$DIST" = UNRELEASED ]; then
        PKGVERSION="$VERSION~$snap$dirty"
    elif [ -n "$since" ] && [ "$n" = 0 ] && [ -z "$dirty" ]; then
        PKGVERSION=$VERSION
    else
        PKGVERSION="$VERSION+$snap$dirty"
    fi
fi
if [ "${1:-}" = --print-version ]; then echo "$PKGVERSION"; exit 0; fi
TREE=build/deb/qwen4090-$VERSION
rm -rf build/deb
mkdir -p "$TREE" dist
# The source package is the working tree as a clone has it (tracked and not-ignored files, so
# the autopkgtest finds every file the tests read); without git, the directories that matter.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -c -o --exclude-standard | grep -z -v -e '^packaging/debian/' -e '^\.' \
        | xargs -0 sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh \
        | tar -c --null -T - | tar -x -C "$TREE"
else
    # shellcheck disable=SC2046  # the ls lists those of the two files that exist: split on purpose
    tar -c --exclude=__pycache__ --exclude='*.egg-info' --exclude='*.pyc' --exclude=packaging/debian \
        pyproject.toml daemon etc tests packaging docs scripts $(ls README.md LICENSE 2>/dev/null) \
        | tar -x -C "$TREE"
fi
cp -r packaging/debian "$TREE/debian"
# setuptools < 61 (Ubuntu 22.04) reads no [project] table: give it the same metadata.
if python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) >= 61)' 2>/dev/null; then
    sed "s/@VERSION@/$VERSION/" packaging/legacy-setup.cfg >"$TREE/setup.cfg"
fi
# README.md is pyproject's readme (setuptools needs it); keep the build going without one.
[ -f "$TREE/README.md" ] || echo "qwen4090: see docs/packaging.md" >"$TREE/README.md"
[ -f "$TREE/docs/packaging.md" ] || { mkdir -p "$TREE/docs"; echo "see qwen4090(8)" >"$TREE/docs/packaging.md"; }
# The shipped config is generated from the code's defaults (a unit test keeps etc/ in sync).
if [ ! -f "$TREE/etc/qwen4090/qwen4090.toml" ]; then
    mkdir -p "$TREE/etc/qwen4090"
    PYTHONPATH=daemon python3 -c 'from qwen4090.settings.config import render_toml; print(render_toml(), end="")' \
        >"$TREE/etc/qwen4090/qwen4090.toml"
fi
# One version, one content: the sources this build is made from, against what dist/ has.
SRCSUM=$(cd "$TREE" && find . -type f -print0 | LC_ALL=C sort -z \
    | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
OUTDEB=dist/qwen4090_${PKGVERSION}_all.deb
if [ -e "$OUTDEB" ]; then
    had=$(cat "$OUTDEB.src-sha256" 2>/dev/null || echo "(no record)")
    [ "$had" = "$SRCSUM" ] || {
        echo "build-deb: $OUTDEB was already built from other sources (sha256 $had, now $SRCSUM):" \
             "a version must name one content. Commit the change (the next commit is a new" \
             "snapshot version) or add a changelog entry (dch -v NEXT), or remove the old .deb" >&2
        exit 1; }
fi
# A snapshot: its own changelog entry on top, dated like its commit (reproducible rebuilds).
if [ "$PKGVERSION" != "$VERSION" ]; then
    when=$(git log -1 --format=%cD HEAD)
    { printf 'qwen4090 (%s) UNRELEASED; urgency=medium\n\n' "$PKGVERSION"
      printf '  * Snapshot of %s at commit %s%s.\n\n' "$VERSION" "$(git rev-parse --short=12 HEAD)" \
          "${dirty:+, with uncommitted changes}"
      printf ' -- %s  %s\n\n' "$(dpkg-parsechangelog -l packaging/debian/changelog -S Maintainer)" "$when"
      cat packaging/debian/changelog; } >"$TREE/debian/changelog"
fi
# Say at once everything that is missing (a fresh Debian 12 lacks most of it), not one tool
# per failed run.
if ! unmet=$(dpkg-checkbuilddeps packaging/debian/control 2>&1); then
    pkgs=$(echo "$unmet" | sed -n 's/.*[Uu]nmet build dependencies: //p' | sed -e 's/([^)]*)//g' \
        -e 's/:native//g' -e 's/|[^ ]*//g' -e 's/debhelper-compat/debhelper/' | tr -s ' ')
    echo "build-deb: missing build dependencies: $pkgs" >&2
    echo "build-deb: install them with:  sudo apt-get install --no-install-recommends $pkgs" >&2
    echo "build-deb: (or: sudo apt-get install devscripts equivs && sudo mk-build-deps -i -r -t" \
         "'apt-get -y --no-install-recommends' packaging/debian/control)" >&2
    exit 1
fi
(cd "$TREE" && dpkg-buildpackage -us -uc -b) >build/deb/build.log 2>&1 || {
    tail -40 build/deb/build.log >&2; echo "build-deb: dpkg-buildpackage failed, log: build/deb/build.log" >&2; exit 1; }
cp "build/deb/qwen4090_${PKGVERSION}_all.deb" dist/
echo "$SRCSUM" >"$OUTDEB.src-sha256"
echo "$OUTDEB"
