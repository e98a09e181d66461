#!/usr/bin/env bash
# Fills .whl/ with the wheels a GPU host with JAX lacks to run `make gpu-check` (scripts/gpu_wheel_list.py names
# them, at the versions .venv holds): CPython 3.12, x86-64 Linux, each without its dependencies (the list already
# holds them). Run it where the package index is reachable; the GPU host then installs from .whl/ alone.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || { echo "gpu_wheels: no $python; run 'make test' once (it makes .venv with the test extras)" >&2; exit 1; }
wanted="$("$python" scripts/gpu_wheel_list.py)"

# pip matches a manylinux tag's glibc version exactly: name every one from manylinux2014 (2.17) to 2.39.
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done

# Into a fresh folder first: a wheel left from an older list would be a second version, and stop the install.
fresh="$(mktemp -d "${TMPDIR:-/tmp}/jaxserve-wheels.XXXXXX")"
trap 'rm -rf "$fresh"' EXIT
# shellcheck disable=SC2086  # one requirement per word
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --dest "$fresh" $wanted
rm -rf .whl
mv "$fresh" .whl
trap - EXIT
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
