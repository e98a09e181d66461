#!/usr/bin/env bash
# Makes .venv with a Python >= 3.12 and installs jaxserve (editable) with the extras named in $1 (comma-separated).
# Re-running is cheap: nothing is installed again until pyproject.toml or the extras change.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"

is_new_enough() {  # true when "$1" runs and is Python >= 3.12
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
  local candidate version
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null && is_new_enough "$candidate"; then
      command -v "$candidate"; return 0
    fi
  done
  # pyenv installs versions it has not activated: look inside its root.
  if command -v pyenv >/dev/null; then
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
      candidate="$(pyenv root)/versions/${version}/bin/python"
      if is_new_enough "$candidate"; then echo "$candidate"; return 0; fi
    done
  fi
  return 1
}

# The editable install maps the top-level packages it saw, so a new package also calls for a reinstall.
packages="$(ls -d */__init__.py 2>/dev/null)"
stamp_id="$( (cat pyproject.toml; echo "$packages"; echo "$extras") | sha256sum | cut -c1-16)"
base_id="$( (cat pyproject.toml; echo "$packages"; echo "") | sha256sum | cut -c1-16)"
if [ -f ".venv/.installed-${stamp_id}" ] || { [ -z "$extras" ] && ls .venv/.installed-*"-${base_id}" >/dev/null 2>&1; }; then
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  python="$(find_python)" || { echo "bootstrap: no Python >= 3.12 found on PATH or in pyenv; install one" >&2; exit 1; }
  echo "bootstrap: creating .venv with $("$python" --version) ($python)"
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --quiet --upgrade pip
echo "bootstrap: installing jaxserve${extras:+ with extras [$extras]} (first time takes a few minutes)"
.venv/bin/python -m pip install --quiet --quiet -e "$spec"
rm -f .venv/.installed-*
touch ".venv/.installed-${stamp_id}"
# A full install also satisfies a plain one.
[ -n "$extras" ] && touch ".venv/.installed-base-${base_id}"
exit 0
