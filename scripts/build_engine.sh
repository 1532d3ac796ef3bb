#!/usr/bin/env bash
# Build an engine directory from a trained drafter checkpoint: a thin wrapper over `dspark build`.
#
#   scripts/build_engine.sh --drafter runs/quickstart/checkpoints/last --output engines/smollm2 \
#       [--target smollm2-135m] [--target-source /models/Qwen3-4B | file.gguf] [--dtype float32|float16|bfloat16] \
#       [--max-batch 64] [--max-context 2048] [--block-size 7] [--what onnx,hf,trtllm,trt] \
#       [--sps sps.json] [--sts sts.json] [--plugin-lib libdspark_trt_plugin.so] [--trtllm-version main|1.4] [--force] \
#       [--proposers neural|suffix|neural+suffix] [--suffix-max-drafts 3] [--suffix-scope shared|request] \
#       [--suffix-max-depth 16] [--suffix-shared-max-outputs 256] [--suffix-shared-max-tokens 65536]
# --proposers / --suffix-*: the engine's default drafting methods (engine.json "proposers", "suffix"),
# read by load_engine and the Triton model (its "proposers" parameter overrides them).
#
# Output: engine.json (runtime keys + manifest with sha256 of every file), drafter/, onnx/, hf/ (the
# DSpark layout vLLM / TensorRT-LLM load, or EAGLE-3 for an eagle3 drafter), trtllm/ (and trt/ with --what ...,trt on a TensorRT host). Exit 2 on a bad argument or input,
# 3 when trt was asked for and TensorRT is missing (everything else is still built).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=".venv/bin/python"
[ -x "$PY" ] || PY="python3"
exec "$PY" -m dspark.cli build "$@"
