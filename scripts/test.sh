#!/usr/bin/env bash
# Set up everything, then run the test suite.  Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-env.sh"
# Two pytest-xdist workers: the whole suite took 13 min 54 s so on the
# 2-core development machine with three benchmark sweeps beside it
# (2026-11-27), 20 to 50 min serially.  "-n 0" (extra arguments come
# after) runs it in one process.
exec "$VPY" -m pytest -q -n 2 "$@"
