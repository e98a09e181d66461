#!/usr/bin/env bash
# `make gpu-check`: runs benchmarks/gpu_check.py on a GPU host's own Python (which has JAX with CUDA), with the
# wheels scripts/gpu_wheels.sh put in .whl/ installed beside it and jaxserve taken from this source tree. Needs no
# package index and no .venv. Usage: scripts/gpu_check.sh OUT_DIR [gpu_check.py arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_check.sh OUT_DIR [ARGS...]}"
shift
python="${PYTHON:-python3}"
site="${GPU_CHECK_SITE:-/tmp/jaxserve-gpu-site}"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || {
    echo "gpu_check: the wheels in .whl/ are for CPython 3.12; $python is $("$python" --version 2>&1) (set PYTHON)" >&2
    exit 1
  }
  # Installed again only when the wheel set changes.
  stamp="$site/.installed-$(ls .whl | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    rm -rf "$site"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
    touch "$stamp"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The source tree first: jaxserve runs from it, never from an installed copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" benchmarks/gpu_check.py --out "$out" "$@"
