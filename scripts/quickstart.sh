#!/usr/bin/env bash
# Set up, then the main job on the embedded SmolLM2 target: self-distilled data ->
# train a DSpark drafter -> acceptance evaluation (batch 1) per task. 6-13 min on 2 cores.
# Extra arguments are config overrides, e.g.  scripts/quickstart.sh train.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dspark quickstart -c quickstart "$@"
