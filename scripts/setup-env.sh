#!/usr/bin/env bash
# Creates .venv (once), installs the pinned dev requirements and builds
# memscale's C extension in place.  Sourced by scripts/bench.sh and
# scripts/test.sh; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
"$VPY" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
# The extension builds against the CPython C API only (no torch headers);
# --no-build-isolation uses the setuptools just installed.  MEMSCALE_DEV=1:
# a development build, warnings are errors (setup.py).
export MEMSCALE_DEV=1
"$VPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
export VPY
