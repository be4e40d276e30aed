#!/usr/bin/env bash
# Runs the quick tier against another torch release than the pinned one,
# in a venv of its own (the GPU machine has torch 2.11; users have every
# release from 2.4):
#
#     bash scripts/other-torch.sh 2.11.0 [pytest arguments...]
#
# The venv is made once under ${OTHER_TORCH_DIR:-/tmp/memscale-torch-VERSION}
# with that torch (from PyPI: a CUDA build, about 5 GB with its libraries,
# which runs on the CPU too) and the other pinned dev requirements; the C
# extension is the one built in place (it uses the CPython API only, so one
# build serves every torch).  Without pytest arguments it runs
# `-m "not slow" -n 2`.
set -euo pipefail
VERSION="${1:?usage: bash scripts/other-torch.sh TORCH_VERSION [pytest arguments...]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OTHER_TORCH_DIR:-/tmp/memscale-torch-$VERSION}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# Every pinned requirement but torch and the linters, then that torch.
grep -vE '^(torch|ruff|mypy|clang-format)==' "$ROOT/requirements-dev.txt" >"$VENV/requirements.txt"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "torch==$VERSION" -r "$VENV/requirements.txt"
ls "$ROOT"/memscale/_core*.so >/dev/null 2>&1 || {
    echo "build the extension first: MEMSCALE_DEV=1 .venv/bin/python setup.py build_ext --inplace" >&2
    exit 1
}
cd "$ROOT"
if [ "$#" -eq 0 ]; then
    set -- -m "not slow" -n 2
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
OMP_NUM_THREADS=1 PYTHONPATH=. "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
