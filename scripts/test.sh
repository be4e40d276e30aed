#!/usr/bin/env bash
# Set up everything, then run the test suite.  Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-env.sh"
exec "$VPY" -m pytest -q "$@"
