"""Engine vs vLLM on one CPU, token for token: the side-by-side harness with this comparison's defaults.

    .venv-vllm/bin/python scripts/bench_vs_vllm.py            # vLLM's venv has the kit too (scripts/setup_vllm.sh)
    .venv/bin/python scripts/bench_vs_vllm.py                 # without vLLM: says so, runs the rest

Systems by default: ``ours_target_only``, ``ours_spec`` (with ``--engine-dir``), ``hf_generate``,
``vllm_target_only``, ``vllm_ngram``; one request at a time (3 x 256 new tokens) and 16 and 64
in flight (x 128); 3 rounds in rotating order, each system in its own process. Writes
``docs/benchmarks/engine_vs_vllm.{json,md,png}``; the ``results`` entries carry the keys
``system, batch, new_tokens, tokens_per_s, x_vllm_target_only, p50_ms_per_token, ttft_p50_ms,
identical_to_vllm_fp32`` (and more). Every option of ``python -m dspark.engine.sidebyside --help``
applies (``--systems``, ``--batches``, ``--temperatures``, ``--name decode`` ...): the harness,
its systems and its arithmetic live in ``engine/sidebyside.py`` and ``engine/sidebyside_report.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dspark.engine.sidebyside import main

DEFAULTS = {"systems": "ours_target_only,ours_spec,hf_generate,vllm_target_only,vllm_ngram", "batches": "1,16,64",
            "prompts_1": 3, "few_rounds": "hf_generate", "name": "engine_vs_vllm", "title": "Engine vs vLLM"}

if __name__ == "__main__":
    main(defaults=DEFAULTS, command=" ".join(["python", str(Path(sys.argv[0])), *sys.argv[1:]]))
