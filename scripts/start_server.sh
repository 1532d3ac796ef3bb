#!/usr/bin/env bash
# Start a real Triton Inference Server on triton_repo/ and wait until it is ready.
#
#   scripts/start_server.sh [--grpc-port 8001] [--http-port 8000] [--metrics-port 8002]
#                           [--engine-dir DIR] [--target SRC] [--scheduler NAME] [--device DEV]
#                           [--engine-kwargs JSON] [--num-threads N]
#                           [--load-model NAME]... [--state-dir DIR] [--log-file FILE]
#                           [--timeout SECONDS] [--foreground] [-- extra tritonserver args]
#
# Every flag has an environment twin (GRPC_PORT, HTTP_PORT, METRICS_PORT, DSPARK_ENGINE_DIR,
# DSPARK_TARGET, DSPARK_SCHEDULER, DSPARK_DEVICE, DSPARK_ENGINE_KWARGS, DSPARK_NUM_THREADS,
# DSPARK_ENGINE_FACTORY, DSPARK_TOKENIZER_FACTORY, DSPARK_STATE_DIR, DSPARK_SERVER_LOG,
# DSPARK_SERVER_TIMEOUT, PYTHON, TRITONSERVER). The model parameters reach the python
# models as DSPARK_* environment variables, which override their config.pbtxt values.
# --target names the tokenizer (the engine's target) for pre/postprocessing.
#
# Which server: $TRITONSERVER if set; else a system install (/opt/tritonserver, as in the
# Triton containers); else the one bundled in the nvidia-pytriton wheel of $PYTHON, with
# the traps of running it outside a container handled here:
#   1. the python backend stub links libpython3.X: for a non-system Python (pyenv), its
#      LIBDIR goes first on LD_LIBRARY_PATH so the stub does not mix two installations;
#   2. the stub imports packages of the `python3` first on PATH: $PYTHON's bin goes first;
#   3. numpy >= 2 delivers empty tensors to that stub: refused here, with the fix;
#   4. the wheel keeps stubs per Python version outside its backend folder: a backend
#      directory with the stub matching $PYTHON is assembled under the state dir, and the
#      wheel's bundled libraries (nvidia_pytriton.libs) go on LD_LIBRARY_PATH for it.
# Writes <state-dir>/server.pid and the log file; scripts/stop_server.sh stops it.
#
# Crash recovery: the python backend's shared-memory regions get a prefix of this state dir
# (<state-dir>/shm_prefix), and before starting, what a crashed server left is reclaimed:
# orphaned stubs of this model repository (their server is gone) are killed and this
# prefix's regions that no process maps are unlinked (dspark.engine.serving.stubs). The
# models themselves exit when their server dies (a watchdog in each model's initialize).
set -euo pipefail

# whether a pid runs; a zombie (killed, not reaped yet) does not
alive() { kill -0 "$1" 2>/dev/null && ! grep -qsE '\) [ZX] ' "/proc/$1/stat"; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HTTP_PORT="${HTTP_PORT:-8000}"
GRPC_PORT="${GRPC_PORT:-8001}"
METRICS_PORT="${METRICS_PORT:-8002}"
TIMEOUT="${DSPARK_SERVER_TIMEOUT:-600}"
REPO="${DSPARK_MODEL_REPO:-$ROOT/triton_repo}"
FOREGROUND=0
MODELS=()
EXTRA=()
STATE_DIR="${DSPARK_STATE_DIR:-}"
LOG_FILE="${DSPARK_SERVER_LOG:-}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --http-port) HTTP_PORT="$2"; shift 2 ;;
    --grpc-port) GRPC_PORT="$2"; shift 2 ;;
    --metrics-port) METRICS_PORT="$2"; shift 2 ;;
    --engine-dir) export DSPARK_ENGINE_DIR="$2"; shift 2 ;;
    --target) export DSPARK_TARGET="$2"; shift 2 ;;
    --scheduler) export DSPARK_SCHEDULER="$2"; shift 2 ;;
    --device) export DSPARK_DEVICE="$2"; shift 2 ;;
    --engine-factory) export DSPARK_ENGINE_FACTORY="$2"; shift 2 ;;
    --tokenizer-factory) export DSPARK_TOKENIZER_FACTORY="$2"; shift 2 ;;
    --num-threads) export DSPARK_NUM_THREADS="$2"; shift 2 ;;
    --engine-kwargs) export DSPARK_ENGINE_KWARGS="$2"; shift 2 ;;
    --load-model) MODELS+=("$2"); shift 2 ;;
    --model-repository) REPO="$2"; shift 2 ;;
    --state-dir) STATE_DIR="$2"; shift 2 ;;
    --log-file) LOG_FILE="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --foreground) FOREGROUND=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "start_server.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
STATE_DIR="${STATE_DIR:-/tmp/dspark-triton-$GRPC_PORT}"
LOG_FILE="${LOG_FILE:-$STATE_DIR/server.log}"
PID_FILE="$STATE_DIR/server.pid"
mkdir -p "$STATE_DIR" "$(dirname "$LOG_FILE")"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
# one prefix per state dir, so that reclaiming never touches another server's regions
SHM_PREFIX="dspark_$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1)_"
echo "$SHM_PREFIX" > "$STATE_DIR/shm_prefix"
echo "$REPO" > "$STATE_DIR/model_repository"   # for stop_server.sh's reclaim

if [[ -f "$PID_FILE" ]] && alive "$(cat "$PID_FILE")"; then
  echo "start_server.sh: a server is already running (pid $(cat "$PID_FILE"), $PID_FILE); scripts/stop_server.sh --state-dir $STATE_DIR" >&2
  exit 1
fi
if [[ -f "$PID_FILE" ]]; then
  echo "start_server.sh: the server of $PID_FILE (pid $(cat "$PID_FILE")) is gone; reclaiming what it left"
  rm -f "$PID_FILE"
fi

# --- Python for the python backend models -------------------------------------------
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
PY_BIN="$(dirname "$PYTHON")"
export PATH="$PY_BIN:$PATH"                                   # trap 2
read -r PY_VER PY_LIBDIR PY_SYSTEM NUMPY_VER <<<"$("$PYTHON" - <<'EOF'
import sys, sysconfig
try:
    import numpy; nv = numpy.__version__
except ImportError:
    nv = "missing"
libdir = sysconfig.get_config_var("LIBDIR") or "-"
# a system Python's libpython is the one the dynamic linker finds anyway
system = libdir.startswith(("/usr/lib", "/lib")) or sys.base_prefix == "/usr"
print(f"{sys.version_info[0]}.{sys.version_info[1]}", libdir, int(system), nv)
EOF
)"
if [[ "$NUMPY_VER" == missing || "${NUMPY_VER%%.*}" -ge 2 ]]; then   # trap 3
  echo "start_server.sh: $PYTHON has numpy $NUMPY_VER; the python backend stub needs numpy<2: $PYTHON -m pip install 'numpy>=1.26,<2'" >&2
  exit 1
fi
if ! "$PYTHON" -c "import dspark.engine.serving" 2>/dev/null; then
  echo "start_server.sh: $PYTHON cannot import dspark.engine.serving: $PYTHON -m pip install -e '$ROOT[serve]'" >&2
  exit 1
fi

echo "start_server.sh: reclaim: $("$PYTHON" -m dspark.engine.serving.stubs reclaim --repo "$REPO" --shm-prefix "$SHM_PREFIX")"

# --- which tritonserver ----------------------------------------------------------------
BACKEND_DIR=""
if [[ -z "${TRITONSERVER:-}" && -x /opt/tritonserver/bin/tritonserver ]]; then
  TRITONSERVER=/opt/tritonserver/bin/tritonserver           # Triton container
  BACKEND_DIR=/opt/tritonserver/backends
fi
if [[ -z "${TRITONSERVER:-}" ]]; then
  PYTRITON="$("$PYTHON" -c 'import os, pytriton; print(os.path.dirname(pytriton.__file__))' 2>/dev/null || true)"
  if [[ -z "$PYTRITON" || ! -x "$PYTRITON/tritonserver/bin/tritonserver" ]]; then
    echo "start_server.sh: no tritonserver: run in a Triton container, set TRITONSERVER, or $PYTHON -m pip install nvidia-pytriton==0.7.0" >&2
    exit 1
  fi
  TRITONSERVER="$PYTRITON/tritonserver/bin/tritonserver"
  STUB="$PYTRITON/tritonserver/python_backend_stubs/$PY_VER/triton_python_backend_stub"
  if [[ ! -x "$STUB" ]]; then
    echo "start_server.sh: nvidia-pytriton has no python backend stub for Python $PY_VER ($STUB)" >&2
    exit 1
  fi
  BACKEND_DIR="$STATE_DIR/backends"                          # trap 4
  mkdir -p "$BACKEND_DIR/python"
  ln -sf "$PYTRITON/tritonserver/backends/python/libtriton_python.so" \
         "$PYTRITON/tritonserver/backends/python/triton_python_backend_utils.py" "$STUB" "$BACKEND_DIR/python/"
  # the stub and backend find the wheel's bundled libraries relative to their own folder
  LIBS="$(cd "$PYTRITON/.." && pwd)/nvidia_pytriton.libs"
  export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [[ "$PY_SYSTEM" != 1 && "$PY_LIBDIR" != - ]]; then      # trap 1
    export LD_LIBRARY_PATH="$PY_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  if ldd "$BACKEND_DIR/python/triton_python_backend_stub" | grep -q "not found"; then
    echo "start_server.sh: the python backend stub misses libraries:" >&2
    ldd "$BACKEND_DIR/python/triton_python_backend_stub" | grep "not found" >&2
    echo "  (install libpython$PY_VER, or use a Python built with --enable-shared)" >&2
    exit 1
  fi
fi

ARGS=(--model-repository "$REPO" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT"
      --metrics-port "$METRICS_PORT" --allow-metrics true --log-info true
      --backend-config "python,shm-region-prefix-name=$SHM_PREFIX")
[[ -n "$BACKEND_DIR" ]] && ARGS+=(--backend-directory "$BACKEND_DIR")
if [[ ${#MODELS[@]} -gt 0 ]]; then
  ARGS+=(--model-control-mode explicit)
  for m in "${MODELS[@]}"; do ARGS+=(--load-model "$m"); done
fi
ARGS+=("${EXTRA[@]}")

echo "start_server.sh: $TRITONSERVER ${ARGS[*]}" | tee "$LOG_FILE"
echo "start_server.sh: python $PYTHON ($PY_VER, numpy $NUMPY_VER); log $LOG_FILE" | tee -a "$LOG_FILE"
if [[ "$FOREGROUND" == 1 ]]; then
  echo $$ > "$PID_FILE"
  exec "$TRITONSERVER" "${ARGS[@]}"
fi

# setsid: the server gets its own session, so a terminal's or test runner's signals do not
# reach it and stop_server.sh can stop it with its python stubs.
setsid "$TRITONSERVER" "${ARGS[@]}" >>"$LOG_FILE" 2>&1 < /dev/null &
PID=$!
echo "$PID" > "$PID_FILE"

deadline=$((SECONDS + TIMEOUT))
until "$PYTHON" - "$HTTP_PORT" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=2).read()
EOF
do
  if ! alive "$PID"; then
    echo "start_server.sh: tritonserver exited during startup; errors in $LOG_FILE:" >&2
    grep -E '^E[0-9]|failed to load|UNAVAILABLE' "$LOG_FILE" | cut -c1-600 | head -n 20 >&2 || true
    echo "--- last lines:" >&2
    tail -n 15 "$LOG_FILE" >&2
    rm -f "$PID_FILE"
    exit 1
  fi
  if (( SECONDS >= deadline )); then
    echo "start_server.sh: not ready after ${TIMEOUT}s; last lines of $LOG_FILE:" >&2
    tail -n 40 "$LOG_FILE" >&2
    "$ROOT/scripts/stop_server.sh" --state-dir "$STATE_DIR" >&2 || true
    exit 1
  fi
  sleep 1
done
echo "start_server.sh: ready (pid $PID) grpc=localhost:$GRPC_PORT http=localhost:$HTTP_PORT metrics=localhost:$METRICS_PORT/metrics"
