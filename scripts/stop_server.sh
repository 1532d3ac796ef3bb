#!/usr/bin/env bash
# Stop the server started by scripts/start_server.sh (by its pid file).
#
#   scripts/stop_server.sh [--grpc-port 8001 | --state-dir DIR] [--timeout 30]
#
# SIGTERM first (Triton unloads the models, which stop their engines), SIGKILL for the
# server's process group after --timeout seconds.
set -euo pipefail

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

if [[ ! -f "$PID_FILE" ]]; then
  echo "stop_server.sh: no pid file $PID_FILE; nothing to stop"
  exit 0
fi
PID="$(cat "$PID_FILE")"
if ! kill -0 "$PID" 2>/dev/null; then
  echo "stop_server.sh: pid $PID is not running"
  rm -f "$PID_FILE"
  exit 0
fi
kill -TERM "$PID" 2>/dev/null || true
for ((i = 0; i < TIMEOUT * 10; i++)); do
  kill -0 "$PID" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$PID" 2>/dev/null; then
  echo "stop_server.sh: pid $PID still running after ${TIMEOUT}s; killing its process group" >&2
  kill -KILL -- "-$PID" 2>/dev/null || kill -KILL "$PID" 2>/dev/null || true
fi
rm -f "$PID_FILE"
echo "stop_server.sh: stopped pid $PID"
