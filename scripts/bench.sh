#!/usr/bin/env bash
# The main job: set up everything, then run the benchmark suite (quick by
# default).  Extra arguments go to `python -m memscale.benchmarks`, e.g.
#   bash scripts/bench.sh --json out.json --plot out.png
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-env.sh"
exec "$VPY" -m memscale.benchmarks "$@"
