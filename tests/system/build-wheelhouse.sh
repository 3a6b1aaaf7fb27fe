#!/usr/bin/env bash
# Builds the wheelhouse the appliance role installs from inside the container (no network there):
# the runtime dependencies + the engine and guided extras with the CPU torch wheel, cached outside the
# repository by a hash of pyproject.toml, and a fresh wheel of this package in a per-run directory. Prints the directory.
# usage: build-wheelhouse.sh OUTDIR   (OUTDIR gets the package wheel and hard links/copies of the cached deps)
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$1"
cache="${APPLIANCE_CI_CACHE:-/var/cache/appliance-ci}"
pip=".venv/bin/pip"
# The container runs Debian's Python 3.11.2, this venv may be newer: requirements with markers for older
# Pythons (redis needs async-timeout below 3.11.3) are added by hand.
extra=("async-timeout>=4.0.3")
extras="engine,guided"
key=$( (cat pyproject.toml; echo torch==2.13.0 "$extras" "${extra[@]}") | sha256sum | cut -c1-12)
deps="$cache/wheelhouse-$key"
if [ ! -f "$deps/.complete" ]; then
  tmp="$cache/.wheelhouse-$key-$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  # CPU torch first (the local wheel), so the engine extra does not pull a CUDA build.
  "$pip" wheel -q -w "$tmp" "torch==2.13.0" >&2
  "$pip" wheel -q -w "$tmp" --find-links "$tmp" "torch==2.13.0" ".[$extras]" "${extra[@]}" >&2
  rm -f "$tmp"/llm_appliance-*.whl
  touch "$tmp/.complete"
  rm -rf "$deps"
  mv "$tmp" "$deps"
fi
rm -rf "$out"
mkdir -p "$out"
cp -l "$deps"/*.whl "$out"/ 2>/dev/null || cp "$deps"/*.whl "$out"/
"$pip" wheel -q --no-deps --no-build-isolation -w "$out" . >&2
echo "$out"
