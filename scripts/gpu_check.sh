#!/usr/bin/env bash
# One call on a CUDA host (an H200 here): build the verify-step extension, run tests/gpu,
# and run the kernel micro-benchmark. Needs python3 with torch (CUDA), pytest, scipy, ninja;
# no network, no install of this package (scripts/source_tree_path.sh makes `dspark` importable).
#
#   bash scripts/gpu_check.sh            # about 3 minutes on an H200, at most 8.5
#   BENCH_BUDGET_S=40 bash scripts/gpu_check.sh   # a shorter micro-benchmark
#
# Writes docs/benchmarks/verify_kernel.{json,md}; when $OUT is set (the device runner's
# folder that comes back) the results and logs are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
WORK=$(mktemp -d /tmp/dspark_gpu.XXXXXX)
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

. scripts/source_tree_path.sh
dspark_source_tree_path "$ROOT" "$PY"
"$PY" - <<'EOF' || { echo "gpu_check: python/torch/CUDA not usable"; exit 2; }
import torch, dspark.plugins.ops as ops
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
EOF

status=0
log "building the extension (torch.utils.cpp_extension.load)"
timeout 200 "$PY" - <<'EOF' 2>&1 | tee "$WORK/build.log"
import time
from dspark.plugins import ops
t = time.time()
ok = ops.load_extension(verbose=True)
print(f"extension loaded: {ok} in {time.time() - t:.1f} s", flush=True)
raise SystemExit(0 if ok else 1)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "extension build FAILED"; status=1; }

if [ "$status" -eq 0 ]; then
  log "tests/gpu"
  timeout 150 "$PY" -m pytest tests/gpu -m gpu -q --maxfail=5 --noconftest -p no:cacheprovider \
    --rootdir "$ROOT" 2>&1 | tee "$WORK/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { log "tests/gpu FAILED"; status=1; }

  log "micro-benchmark"
  timeout 150 "$PY" scripts/bench_verify_kernel.py --out docs/benchmarks --budget-s "${BENCH_BUDGET_S:-110}" 2>&1 | tee "$WORK/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { log "benchmark FAILED"; status=1; }
  [ -f docs/benchmarks/verify_kernel.md ] && cat docs/benchmarks/verify_kernel.md
fi

if [ -n "$OUT_DIR" ]; then
  cp "$WORK"/*.log "$OUT_DIR"/ 2>/dev/null || true
  cp docs/benchmarks/verify_kernel.json docs/benchmarks/verify_kernel.md "$OUT_DIR"/ 2>/dev/null || true
fi
log "done (status $status)"
exit "$status"
