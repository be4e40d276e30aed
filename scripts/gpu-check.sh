#!/usr/bin/env bash
# The CUDA check, one command on a GPU machine (docs/gpu.md): builds the
# extension in place with the Python there, runs tests/gpu and the
# benchmark suite's quick models with --device cuda, and writes the results
# to --out DIR (default: $OUT, else gpu-check-out/).  Installs nothing.
#   bash scripts/gpu-check.sh             # on a GPU machine (5-8 minutes on one H100)
#   bash scripts/gpu-check.sh --dry-run   # anywhere: build, collection, flags
# The interpreter: $PYTHON, else python3, else python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    PY="$(command -v python3 || command -v python || true)"
fi
if [ -z "$PY" ]; then
    echo "gpu-check: no python3 or python on PATH; set PYTHON=/path/to/python" >&2
    exit 2
fi
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
