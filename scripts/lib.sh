# Shared by scripts/run.sh and scripts/test.sh.

# Debian packages that the test suite runs for real: promtool and the Prometheus server
# (prometheus), Alertmanager (prometheus-alertmanager), iostat (sysstat), lspci (pciutils),
# ip (iproute2); and for the kernel module: Debian's headers to build it, QEMU, busybox, kmod
# and cpio to boot the matching Debian kernel with it (kmod/tests/run-qemu.sh).
# htpasswd (apache2-utils), openssl and curl: bcrypt hashes, certificates and a TLS client for
# the web-config.yml tests. fuse3: libfuse 3 and fusermount3 for the kernel-semantics tier.
# groff-base, zsh and lintian: the manual pages, the zsh completion and the Debian packages are
# read by the real tools. librsvg2-bin: rsvg-convert draws the SVG pictures (job report,
# collective charts) to catch malformed output. strace: every path a demo and its hooks write,
# as the kernel saw it.
TEST_APT_PACKAGES=(prometheus prometheus-alertmanager sysstat pciutils iproute2 debootstrap rpm rpmlint slurm-wlm munge
    linux-headers-amd64 qemu-system-x86 busybox-static kmod cpio gcc make libc6-dev
    apache2-utils openssl curl fuse3 groff-base zsh lintian librsvg2-bin strace)

ensure_apt_packages() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "== installing Debian packages: ${missing[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
}

# ensure_venv DIR SPEC: create DIR if needed and (re)install SPEC into it unless what is
# installed serves SPEC (see venv_serves), so a second run starts in seconds.
ensure_venv() {
    local dir=$1 spec=$2 python=${PYTHON:-python3}
    # Debian's python3 needs python3-venv for `python3 -m venv`.
    "$python" -c 'import ensurepip, venv' 2>/dev/null || ensure_apt_packages python3-venv
    [ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
    local stamp="$dir/.nodescope-installed"
    local want have
    # The project file, the checkout the editable install points into, and the spec.
    want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd -P) $spec"
    have=$(cat "$stamp" 2>/dev/null || true)
    if ! venv_serves "$have" "$want"; then
        echo "== installing $spec into $dir"
        "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
        "$dir/bin/python" -m pip install -q -e "$spec"
        echo "$want" > "$stamp"
    fi
}

# venv_serves HAVE WANT: whether the install stamped HAVE ("hash checkout spec") serves WANT:
# the same pyproject.toml, installed from this checkout (an environment shared by two
# checkouts would otherwise run the other one's code), and every extra WANT names installed
# (the test suite's environment serves the benchmark's, which asks for fewer).
venv_serves() {
    local have=$1 want=$2
    [ -n "$have" ] && [ "${have% *}" = "${want% *}" ] || return 1
    local have_spec=${have##* } want_spec=${want##* }
    [ "${have_spec%%[*}" = "${want_spec%%[*}" ] || return 1
    local have_extras="" want_extras="" extra
    [[ $have_spec == *"["*"]" ]] && { have_extras=${have_spec#*[}; have_extras=${have_extras%]}; }
    [[ $want_spec == *"["*"]" ]] && { want_extras=${want_spec#*[}; want_extras=${want_extras%]}; }
    for extra in ${want_extras//,/ }; do
        case ",$have_extras," in *",$extra,"*) ;; *) return 1 ;; esac
    done
}
