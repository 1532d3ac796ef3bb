#!/usr/bin/env bash
# Set up and run the test suite (everything except GPU tests; those run on a CUDA host
# through scripts/gpu_check.sh). Fast tests only: scripts/test.sh -m "not slow and not gpu".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- -m "not gpu"; fi
exec .venv/bin/python -m pytest "$@"
