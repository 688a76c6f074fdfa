#!/bin/sh
# Install the Slurm hook wrappers: install.sh DESTDIR [NODESCOPE [ENV_FILE]]
#
# Copies prolog, epilog and health (the HealthCheckProgram) into DESTDIR (mode 0755) with the absolute path of the nodescope
# command (default /usr/bin/nodescope) and of the optional env file (default
# /etc/nodescope/slurm.env) written into them: slurmd gives hooks no PATH and no environment
# of ours, so both are fixed at installation. Packages install to /usr/lib/nodescope/slurm.
set -eu
if [ $# -lt 1 ] || [ $# -gt 3 ]; then
    echo "usage: $0 DESTDIR [NODESCOPE [ENV_FILE]]" >&2
    exit 2
fi
dest=$1
nodescope=${2:-/usr/bin/nodescope}
env_file=${3:-/etc/nodescope/slurm.env}
for value in "$nodescope" "$env_file"; do
    case $value in
        /*) ;;
        *) echo "$0: $value is not an absolute path" >&2; exit 2 ;;
    esac
    case $value in
        *[!A-Za-z0-9/._+-]*) echo "$0: $value: only letters, digits and /._+- please" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest"
for hook in prolog epilog health; do
    tmp="$dest/.$hook.tmp"
    sed -e "s|^NODESCOPE=.*|NODESCOPE=$nodescope|" \
        -e "s|^NODESCOPE_ENV=.*|NODESCOPE_ENV=$env_file|" "$here/$hook" > "$tmp"
    chmod 0755 "$tmp"
    mv -f "$tmp" "$dest/$hook"
done
