#!/usr/bin/env bash
# The drafters trained at GPU scale: DSpark, DFlash and Eagle3 on the same records with online target
# features in bf16, an equal training time each (`dspark bench-train`, engine/train_compare.py), then
# evaluated; results and checkpoints packed into $OUT within the device runner's limits
# (scripts/gpu_train.py says what comes back). Needs python3 with torch and transformers; no network,
# no install of this package (scripts/source_tree_path.sh).
#
# On the lent H200, two `run` calls back to back (docs/gpu.md, "Training the drafters on the H200"):
#   bash scripts/gpu_train.sh stage          # call 1 (carry .gpu_train/a): the first half of the target to /tmp
#   bash scripts/gpu_train.sh carried [ARGS] # call 2 (carry .gpu_train/b): assemble the target, train, pack
# ARGS go to `scripts/gpu_train.py run` (--budget S per drafter, --device, --eval-samples, overrides...).
# Without `carried` the target is the installed embedded one (or target.source=...): on the CPU,
#   bash scripts/gpu_train.sh --device cpu --budget 5 --out /tmp/gt   # the same code path, tiny
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
CARRY=.gpu_train
STAGE=/tmp/dspark_gpu_train
export PYTHONUNBUFFERED=1
log() { echo "[gpu_train $(date +%H:%M:%S)] $*"; }

if [ "${1:-}" = "stage" ]; then
  mkdir -p "$STAGE" && cp "$CARRY/a/target.gguf.part_a" "$STAGE/" || { log "no $CARRY/a/target.gguf.part_a carried"; exit 2; }
  ls -l "$STAGE"
  exit 0
fi

OUT_DIR=${OUT:-$ROOT/runs/gpu_train_out}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_train.log") 2>&1
extra=()
if [ "${1:-}" = "carried" ]; then
  shift
  [ -f "$CARRY/b/carry.json" ] || { log "no $CARRY/b/carry.json carried (scripts/gpu_train.py prepare makes it)"; exit 2; }
  log "assembling the target from the two halves"
  read -r name sum wheel < <("$PY" -c "import json;m=json.load(open('$CARRY/b/carry.json'));print(m['target_gguf'],m['target_sha256'],m['gguf_wheel'])")
  [ -f "$STAGE/target.gguf.part_a" ] || { log "$STAGE/target.gguf.part_a is missing: run 'bash scripts/gpu_train.sh stage' (call 1) first, on the same machine"; exit 2; }
  mkdir -p "$STAGE/target"
  cat "$STAGE/target.gguf.part_a" "$CARRY/b/target.gguf.part_b" > "$STAGE/target/$name"
  echo "$sum  $STAGE/target/$name" | sha256sum -c --quiet || { log "the assembled target does not match its sha256"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STAGE/site" "$CARRY/b/$wheel" \
    || { log "gguf wheel install FAILED"; exit 2; }
  export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
  extra+=(--target-source "$STAGE/target/$name" --runs "$STAGE/runs")
  [ -f "$CARRY/b/records.jsonl.gz" ] && extra+=(--records "$CARRY/b/records.jsonl.gz")
fi
. scripts/source_tree_path.sh
dspark_source_tree_path "$ROOT" "$PY"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
log "train + evaluate + pack (scripts/gpu_train.py run)"
"$PY" scripts/gpu_train.py run --out "$OUT_DIR" "${extra[@]}" "$@"
status=$?
ls -l "$OUT_DIR"
log "done (status $status)"
exit "$status"
