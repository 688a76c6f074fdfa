#!/usr/bin/env bash
# Builds the Debian packages from this working tree, with plain dpkg-deb from staging trees:
#   nodescope_<version>-<rev>_all.deb       the daemon and CLI, unit, tmpfiles, config, hooks
#   nodescope-dkms_<version>-<rev>_all.deb  nvlink_counter's source for DKMS
#
# Usage: packaging/deb/build.sh [OUTDIR]        (default: build/packages)
# Environment: PYTHON (default python3; it needs pip), DEB_REVISION (default 1),
#              SOURCE_DATE_EPOCH (default: the last commit's time) for the files' mtimes.
# Needs dpkg-deb and python3 with pip; the network only when build/packaging/wheels lacks a
# wheel of packaging/common/vendor.txt or pip's cache lacks the build backend.
# The layout (a private tree under /usr/lib/nodescope, Debian's packages for the compiled
# dependencies) is argued in docs/install.md, "Package layout".
set -euo pipefail
umask 022
cd "$(dirname "$0")/../.."
repo=$PWD
out=${1:-$repo/build/packages}
work=$repo/build/packaging
python=${PYTHON:-python3}

die() {
    echo "build.sh: $*" >&2
    exit 1
}

version=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
init_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' daemon/nodescope/__init__.py)
[ "$version" = "$init_version" ] ||
    die "pyproject.toml says $version, daemon/nodescope/__init__.py says $init_version"
kmod_version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"$/\1/p' kmod/dkms.conf)
[ -n "$kmod_version" ] || die "kmod/dkms.conf has no PACKAGE_VERSION"
deb_version=$version-${DEB_REVISION:-1}
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

mkdir -p "$work" "$out"

# --- vendored pure-Python wheels (hash-checked; downloaded only when missing) -----------------
wheels=$work/wheels
PYTHON=$python packaging/common/fetch-wheels.sh "$wheels" >"$work/wheels.list"
vendor_entries=()
while read -r file modules; do
    vendor_entries+=("$file:$modules")
done <"$work/wheels.list"
[ ${#vendor_entries[@]} -gt 0 ] || die "no vendored wheels"

# --- nodescope's own wheel, from a copy of the working tree -----------------------------------
# The copy keeps setuptools' build/ and egg-info out of the checkout and resolves the symlinked
# uapi header (daemon/nodescope/data/nvlink_counter.h) into a file.
src=$work/src
rm -rf "$src" "$work/dist"
mkdir -p "$src/exporters"
cp pyproject.toml README.md "$src/"
cp -rL daemon "$src/"
cp -rL exporters/nodescope_exporters "$src/exporters/"
rm -rf "$src"/daemon/*.egg-info
find "$src" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "== building the nodescope $version wheel"
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$src"
wheel=$work/dist/nodescope-$version-py3-none-any.whl
[ -f "$wheel" ] || die "pip wheel made no $wheel"

unzip_to() { "$python" -m zipfile -e "$1" "$2"; }

# changelog ROOT NAME: Debian's changelog of the package, one entry for this version, dated
# by the commit (a binary package built without a source package still carries one).
changelog() {
    local root=$1 name=$2
    local when maintainer
    when=$(LC_ALL=C date -u -R -d "@$epoch")
    maintainer=$(sed -n 's/^Maintainer: //p' "packaging/deb/$name/control.in")
    {
        echo "$name ($deb_version) unstable; urgency=medium"
        echo
        echo "  * nodescope $version."
        echo
        echo " -- $maintainer  $when"
    } | gzip -9n >"$root/usr/share/doc/$name/changelog.Debian.gz"
}

# finish ROOT NAME: md5sums, Installed-Size, mtimes, permissions, then dpkg-deb.
finish() {
    local root=$1 name=$2
    find "$root" -name __pycache__ -type d -prune -exec rm -rf {} +
    find "$root" -type d -exec chmod 755 {} +
    find "$root" -type f ! -perm -u+x -exec chmod 644 {} +
    find "$root" -type f -perm -u+x -exec chmod 755 {} +
    (cd "$root" && find . -path ./DEBIAN -prune -o -path ./etc -prune -o -type f -printf '%P\0' |
        LC_ALL=C sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
    chmod 644 "$root/DEBIAN/md5sums"
    local size
    size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
    sed -i "s/@INSTALLED_SIZE@/$size/" "$root/DEBIAN/control"
    find "$root" -exec touch -h -d "@$epoch" {} +
    local deb=$out/${name}_${deb_version}_all.deb
    dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
    echo "== $deb"
}

# control_from TEMPLATE DEST: the template with the versions filled in.
control_from() {
    sed -e "s/@VERSION@/$deb_version/g" -e "s/@KMOD_VERSION@/$kmod_version/g" "$1" >"$2"
}

# --- nodescope --------------------------------------------------------------------------------
root=$work/root-nodescope
rm -rf "$root"
install -d "$root/DEBIAN" "$root/usr/bin" "$root/usr/lib/nodescope/python" \
    "$root/usr/lib/nodescope/vendor" "$root/usr/lib/nodescope/slurm" "$root/etc/nodescope" \
    "$root/usr/lib/systemd/system" "$root/usr/lib/tmpfiles.d" \
    "$root/usr/share/nodescope/prometheus" "$root/usr/share/nodescope/grafana" \
    "$root/usr/share/doc/nodescope" "$root/usr/share/python3/runtime.d"
unzip_to "$wheel" "$root/usr/lib/nodescope/python"
for entry in "${vendor_entries[@]}"; do
    file=${entry%%:*}
    tmp=$work/unpack
    rm -rf "$tmp"
    unzip_to "$wheels/$file" "$tmp"
    IFS=, read -r -a names <<<"${entry#*:}"
    for module in "${names[@]}"; do
        [ -e "$tmp/$module" ] || die "$file has no $module"
        mv "$tmp/$module" "$root/usr/lib/nodescope/vendor/"
    done
    mv "$tmp"/*.dist-info "$root/usr/lib/nodescope/vendor/"
    rm -rf "$tmp"
done
install -m 755 packaging/common/nodescope "$root/usr/bin/nodescope"
install -m 644 systemd/nodescope.toml "$root/etc/nodescope/nodescope.toml"
install -m 644 systemd/nodescoped.service "$root/usr/lib/systemd/system/nodescoped.service"
install -m 644 systemd/nodescope.tmpfiles.conf "$root/usr/lib/tmpfiles.d/nodescope.conf"
# The Slurm hooks' own installer writes the absolute paths of /usr/bin/nodescope and
# /etc/nodescope/slurm.env into them (slurmd gives hooks no PATH).
if [ -f packaging/slurm/install.sh ]; then
    sh packaging/slurm/install.sh "$root/usr/lib/nodescope/slurm" /usr/bin/nodescope \
        /etc/nodescope/slurm.env
fi
install -m 644 exporters/prometheus/alerts.yml exporters/prometheus/records.yml \
    exporters/prometheus/jobs.yml exporters/prometheus/dcgm-compat.rules.yml \
    exporters/prometheus/scrape.yml \
    exporters/alertmanager/alertmanager.yml \
    "$root/usr/share/nodescope/prometheus/"
install -m 644 exporters/grafana/nodescope.json "$root/usr/share/nodescope/grafana/"
install -m 644 packaging/deb/nodescope/copyright "$root/usr/share/doc/nodescope/copyright"
changelog "$root" nodescope
# Manual pages and shell completion, generated from the parser (python -m nodescope.clidocs).
install -d "$root/usr/share/man/man1" "$root/usr/share/bash-completion/completions" \
    "$root/usr/share/zsh/vendor-completions"
for page in packaging/common/man/*.1; do
    gzip -9n <"$page" >"$root/usr/share/man/man1/$(basename "$page").gz"
done
install -m 644 packaging/common/completion/nodescope.bash \
    "$root/usr/share/bash-completion/completions/nodescope"
install -m 644 packaging/common/completion/_nodescope "$root/usr/share/zsh/vendor-completions/"
install -m 755 packaging/deb/nodescope/rtupdate \
    "$root/usr/share/python3/runtime.d/nodescope.rtupdate"
control_from packaging/deb/nodescope/control.in "$root/DEBIAN/control"
install -m 644 packaging/deb/nodescope/conffiles "$root/DEBIAN/conffiles"
for script in postinst prerm postrm; do
    install -m 755 "packaging/deb/nodescope/$script" "$root/DEBIAN/$script"
done
finish "$root" nodescope

# --- nodescope-dkms ---------------------------------------------------------------------------
root=$work/root-nodescope-dkms
rm -rf "$root"
kmod_dest=$root/usr/src/nvlink_counter-$kmod_version
install -d "$root/DEBIAN" "$kmod_dest" "$root/usr/share/doc/nodescope-dkms" \
    "$root/usr/share/nodescope/examples/modules-load.d"
# The module's sources only: no build products of a local `make` (*.mod.c, *.o) and no tests.
for file in kmod/Kbuild kmod/Makefile kmod/dkms.conf kmod/*.c kmod/*.h; do
    case $file in *.mod.c) continue ;; esac
    install -m 644 "$file" "$kmod_dest/"
done
cp -rL kmod/include "$kmod_dest/"
install -m 644 systemd/modules-load.d/nvlink_counter.conf \
    "$root/usr/share/nodescope/examples/modules-load.d/"
install -m 644 packaging/deb/nodescope-dkms/copyright "$root/usr/share/doc/nodescope-dkms/"
changelog "$root" nodescope-dkms
control_from packaging/deb/nodescope-dkms/control.in "$root/DEBIAN/control"
for script in postinst prerm; do
    control_from "packaging/deb/nodescope-dkms/$script" "$root/DEBIAN/$script"
    chmod 755 "$root/DEBIAN/$script"
done
finish "$root" nodescope-dkms
