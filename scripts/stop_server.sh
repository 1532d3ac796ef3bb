#!/usr/bin/env bash
# Stop the server started by scripts/start_server.sh (by its pid file).
#
#   scripts/stop_server.sh [--grpc-port 8001 | --state-dir DIR] [--timeout 30]
#
# SIGTERM first (Triton unloads the models, which stop their engines), SIGKILL for the
# server's process group after --timeout seconds. Then, and also when the server is already
# gone (crashed), what it left is reclaimed: its orphaned python backend stubs and its
# shared-memory regions (<state-dir>/shm_prefix; dspark.engine.serving.stubs).
set -euo pipefail

# whether a pid runs; a zombie (killed, not reaped yet) does not
alive() { kill -0 "$1" 2>/dev/null && ! grep -qsE '\) [ZX] ' "/proc/$1/stat"; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi

GRPC_PORT="${GRPC_PORT:-8001}"
STATE_DIR="${DSPARK_STATE_DIR:-}"
TIMEOUT=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    --grpc-port) GRPC_PORT="$2"; shift 2 ;;
    --state-dir) STATE_DIR="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "stop_server.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
STATE_DIR="${STATE_DIR:-/tmp/dspark-triton-$GRPC_PORT}"
PID_FILE="$STATE_DIR/server.pid"

reclaim() {
  [[ -f "$STATE_DIR/shm_prefix" ]] || return 0
  echo "stop_server.sh: reclaim: $("$PYTHON" -m dspark.engine.serving.stubs reclaim \
    --repo "$(cat "$STATE_DIR/model_repository" 2>/dev/null || echo "$ROOT/triton_repo")" --shm-prefix "$(cat "$STATE_DIR/shm_prefix")" 2>&1 | tail -n 1)"
}

if [[ ! -f "$PID_FILE" ]]; then
  echo "stop_server.sh: no pid file $PID_FILE; nothing to stop"
  reclaim
  exit 0
fi
PID="$(cat "$PID_FILE")"
if ! alive "$PID"; then
  echo "stop_server.sh: pid $PID is not running"
  rm -f "$PID_FILE"
  reclaim
  exit 0
fi
kill -TERM "$PID" 2>/dev/null || true
for ((i = 0; i < TIMEOUT * 10; i++)); do
  alive "$PID" || break
  sleep 0.1
done
if alive "$PID"; then
  echo "stop_server.sh: pid $PID still running after ${TIMEOUT}s; killing its process group" >&2
  kill -KILL -- "-$PID" 2>/dev/null || kill -KILL "$PID" 2>/dev/null || true
fi
rm -f "$PID_FILE"
echo "stop_server.sh: stopped pid $PID"
reclaim
