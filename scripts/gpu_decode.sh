#!/usr/bin/env bash
# The decode benchmark on a CUDA host (an H200 here) with the real target: profiles the
# SPS table there (CUDA-graph steps), checks graph replay against eager on the GPU, then
# runs `dspark bench` (target-only, spec fixed/scheduled, transformers generate() and
# prompt lookup) side by side. Needs python3 with torch (CUDA) and transformers; no install
# of this package. Run scripts/gpu_check.sh first (or let ops build the extension here).
#
#   bash scripts/gpu_decode.sh TARGET DRAFTER [STS_JSON]
#     TARGET   Hugging Face directory of the target (or a .gguf, needs the gguf package)
#     DRAFTER  drafter checkpoint directory (model.safetensors + drafter.json)
#     STS_JSON STS temperatures from `dspark calibrate` (optional)
#   env: DATA_ROOT (folder with eval/; default the kit's data/), BATCHES (1,4,16,64),
#        DEVICE (cuda; cpu for a dry run), MAX_TOKENS (64), NAME (decode_h200), RESULTS (folder for results and logs; docs/benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
TARGET=${1:?usage: gpu_decode.sh TARGET DRAFTER [STS_JSON]}
DRAFTER=${2:?usage: gpu_decode.sh TARGET DRAFTER [STS_JSON]}
STS=${3:-}
NAME=${NAME:-decode_h200}
RESULTS=${RESULTS:-docs/benchmarks}
export PYTHONUNBUFFERED=1
log() { echo "[gpu_decode $(date +%H:%M:%S)] $*"; }
. scripts/source_tree_path.sh
dspark_source_tree_path "$ROOT" "$PY"
mkdir -p "$RESULTS"
common=(-c quickstart "target.source=$TARGET")
[ -n "${DATA_ROOT:-}" ] && common+=("data.data_root=$DATA_ROOT")
status=0

log "CUDA-graph decode steps against eager on this GPU (tiny target)"
static=auto
timeout 120 "$PY" -m pytest tests/gpu/test_static_target_gpu.py -m gpu -q -p no:cacheprovider \
  --rootdir "$ROOT" 2>&1 | tee "$RESULTS/${NAME}_graphs_test.log"
case "${PIPESTATUS[0]}" in
  0) ;;
  5) log "the graph check did not run (no CUDA device?)" ;;
  *) log "graph replay check FAILED: benchmarking with eager steps (--static-steps off)"; static=off; status=1 ;;
esac

log "SPS table of the target on this GPU (dspark profile)"
timeout 240 "$PY" -m dspark.cli profile "${common[@]}" --device "${DEVICE:-cuda}" --static-steps "$static" \
  --checkpoint "$DRAFTER" --output "$RESULTS/sps_h200.json" 2>&1 | tee "$RESULTS/sps_h200.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "profile FAILED"; status=1; }

log "decode benchmark (dspark bench)"
sched=()
[ -f "$RESULTS/sps_h200.json" ] && sched+=(--sps "$RESULTS/sps_h200.json")
[ -n "$STS" ] && sched+=(--sts "$STS")
timeout 420 "$PY" -m dspark.cli bench "${common[@]}" --device "${DEVICE:-cuda}" --static-steps "$static" \
  --checkpoint "$DRAFTER" "${sched[@]}" --batches "${BATCHES:-1,4,16,64}" --max-tokens "${MAX_TOKENS:-64}" \
  --name "$NAME" --output-dir "$RESULTS" 2>&1 | tee "$RESULTS/${NAME}.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "benchmark FAILED"; status=1; }

log "done (status $status)"
exit "$status"
