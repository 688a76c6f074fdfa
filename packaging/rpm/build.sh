#!/usr/bin/env bash
# Builds the rpm packages (nodescope, nodescope-dkms) from this working tree with rpmbuild,
# then runs rpmlint on the spec and the packages. Works on Debian too (packages rpm, rpmlint):
# there rpmbuild runs with --nodeps, since Debian's rpm database knows no BuildRequires.
# Usage: packaging/rpm/build.sh [OUTDIR]        (default: build/packages)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-$PWD/build/packages}
top=$PWD/build/packaging/rpm
spec=packaging/rpm/nodescope.spec

version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
spec_version=$(sed -n 's/^Version: *//p' "$spec")
[ "$version" = "$spec_version" ] || {
    echo "rpm/build.sh: pyproject.toml says $version, $spec says $spec_version" >&2
    exit 1
}
rm -rf "$top"
mkdir -p "$top/SOURCES" "$top/SPECS" "$out"
# Every vendored wheel of vendor.txt must be a Source of the spec, and none other.
wheels=$PWD/build/packaging/wheels
packaging/common/fetch-wheels.sh "$wheels" >"$top/wheels.list"
while read -r file _; do cp "$wheels/$file" "$top/SOURCES/"; done <"$top/wheels.list"
diff <(cut -d' ' -f1 "$top/wheels.list" | sort) \
    <(sed -n 's/^Source[1-9][0-9]*: *//p' "$spec" | sort) || {
    echo "rpm/build.sh: the spec's wheel Sources differ from packaging/common/vendor.txt" >&2
    exit 1
}

# Source0: the files the spec installs, under nodescope-VERSION/.
paths=(pyproject.toml README.md daemon/nodescope exporters kmod systemd packaging/common
    docs/install.md docs/kmod.md)
[ -d packaging/slurm ] && paths+=(packaging/slurm)
tar --create --gzip --file "$top/SOURCES/nodescope-$version.tar.gz" \
    --transform "s,^,nodescope-$version/,S" --owner=0 --group=0 \
    --exclude=__pycache__ --exclude='*.egg-info' --exclude='kmod/tests' \
    --exclude='*.o' --exclude='*.ko' --exclude='*.mod' --exclude='*.mod.c' \
    --exclude='.*.cmd' --exclude=Module.symvers --exclude=modules.order \
    "${paths[@]}"
cp "$spec" "$top/SPECS/"

nodeps=()
[ -r /etc/debian_version ] && nodeps=(--nodeps)
rpmbuild -bb "${nodeps[@]}" --define "_topdir $top" "$top/SPECS/nodescope.spec" \
    >"$top/rpmbuild.log" 2>&1 || {
    tail -30 "$top/rpmbuild.log" >&2
    exit 1
}
find "$top/RPMS" -name '*.rpm' -exec cp {} "$out/" \;
ls "$out"/*.rpm

if command -v rpmlint >/dev/null; then
    echo "== rpmlint"
    rpmlint -c packaging/rpm/rpmlint.toml "$spec" "$out"/nodescope-*"$version"*.rpm
fi
