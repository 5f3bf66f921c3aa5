#!/bin/sh
# Build dist/qwen4090_<version>_all.deb from the working tree (make deb).
# The repo's top level stays as it is: this copies the sources and packaging/debian into
# build/deb/qwen4090-<version>/ and runs dpkg-buildpackage there (debhelper + pybuild).
# Needs dpkg-dev and the Build-Depends of packaging/debian/control (debhelper dh-python
# pybuild-plugin-pyproject python3-all python3-setuptools, build-essential); when some are
# missing it lists them all with the apt-get (or mk-build-deps) line and stops.
# scripts/system-test.sh installs them. Prints the path of the .deb on its last line.
set -eu
cd "$(dirname "$0")/.."
# Debian's python3 first: a pyenv/venv python3 on PATH breaks pybuild ("No module named build").
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# Say at once everything that is missing (a fresh Debian 12 lacks most of it), not one tool
# per failed run.
command -v dpkg-checkbuilddeps >/dev/null 2>&1 || {
    echo "build-deb: dpkg-dev is not installed; run: sudo apt-get install --no-install-recommends" \
         "dpkg-dev, then make deb again (it will list the rest)" >&2; exit 1; }
if ! unmet=$(dpkg-checkbuilddeps packaging/debian/control 2>&1); then
    pkgs=$(echo "$unmet" | sed -n 's/.*[Uu]nmet build dependencies: //p' | sed -e 's/([^)]*)//g' \
        -e 's/:native//g' -e 's/|[^ ]*//g' -e 's/debhelper-compat/debhelper/' | tr -s ' ')
    echo "build-deb: missing build dependencies: $pkgs" >&2
    echo "build-deb: install them with:  sudo apt-get install --no-install-recommends $pkgs" >&2
    echo "build-deb: (or: sudo apt-get install devscripts equivs && sudo mk-build-deps -i -r -t" \
         "'apt-get -y --no-install-recommends' packaging/debian/control)" >&2
    exit 1
fi
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
DEBVERSION=$(dpkg-parsechangelog -l packaging/debian/changelog -S Version)
[ "$VERSION" = "$DEBVERSION" ] || {
    echo "build-deb: pyproject.toml says $VERSION but packaging/debian/changelog says $DEBVERSION;" \
         "add a changelog entry (dch -v $VERSION)" >&2; exit 1; }
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
    PYTHONPATH=daemon python3 -c 'from qwen4090.config import render_toml; print(render_toml(), end="")' \
        >"$TREE/etc/qwen4090/qwen4090.toml"
fi
(cd "$TREE" && dpkg-buildpackage -us -uc -b) >build/deb/build.log 2>&1 || {
    tail -40 build/deb/build.log >&2; echo "build-deb: dpkg-buildpackage failed, log: build/deb/build.log" >&2; exit 1; }
cp "build/deb/qwen4090_${VERSION}_all.deb" dist/
echo "dist/qwen4090_${VERSION}_all.deb"
