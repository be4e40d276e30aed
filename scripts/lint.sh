#!/usr/bin/env bash
# Style and type checks, as CI runs them: ruff (lint + format), mypy with the
# project's configuration, stubtest of the C extension's stubs, and
# clang-format on csrc/.  Needs the venv of scripts/setup-env.sh (built
# extension included: stubtest imports it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="${VPY:-$ROOT/.venv/bin/python}"
BIN="$(dirname "$VPY")"
"$BIN/ruff" check memscale tests scripts
"$BIN/ruff" format --check memscale tests scripts
"$VPY" -m mypy
"$VPY" -m mypy.stubtest memscale._core
"$BIN/clang-format" --dry-run -Werror csrc/*.c csrc/*.h
echo "lint: ruff, mypy, stubtest and clang-format clean"
