#!/usr/bin/env bash
# The wheels a GPU machine without a package index lacks to run nodescope from this tree, into
# .whl/ (kept out of git by .git/info/exclude), for device-check.sh to install there.
#
#     bash scripts/gpu/wheels.sh          # here, where PyPI answers; then carry .whl
#
# That machine's image has Python 3.12 with torch, nvidia-ml-py, psutil and PyYAML; the daemon
# also needs cffi (with pycparser: the nvlink_counter ABI's layout) and pyudev. The
# versions are the ones this tree's virtual environment holds (TARGET_PYTHON picks another
# Python version for the binary wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
TARGET=${TARGET_PYTHON:-3.12}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
for pkg in cffi pycparser pyudev; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$pkg==$version"
done
ls -1 .whl
