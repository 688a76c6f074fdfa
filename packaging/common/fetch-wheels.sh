#!/usr/bin/env bash
# Puts the wheels of packaging/common/vendor.txt into DIR, checking each sha256; pip downloads
# only those missing or different. Prints one "FILE MODULES" line per wheel for the caller.
# Usage: packaging/common/fetch-wheels.sh DIR        Environment: PYTHON (default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=$1
python=${PYTHON:-python3}
mkdir -p "$dir"
while read -r file sha modules _; do
    case $file in '' | '#'*) continue ;; esac
    case $file in
    *-none-any.whl) ;;
    *)
        echo "fetch-wheels.sh: $file is not a pure-Python wheel" >&2
        exit 1
        ;;
    esac
    if ! echo "$sha  $dir/$file" | sha256sum --check --status 2>/dev/null; then
        name=${file%%-*}
        rest=${file#*-}
        echo "== downloading $name ${rest%%-*}" >&2
        "$python" -m pip download -q --no-deps --only-binary=:all: -d "$dir" \
            "$name==${rest%%-*}" >&2
        if ! echo "$sha  $dir/$file" | sha256sum --check --status; then
            echo "fetch-wheels.sh: $file: sha256 differs from vendor.txt" >&2
            exit 1
        fi
    fi
    echo "$file $modules"
done <packaging/common/vendor.txt
