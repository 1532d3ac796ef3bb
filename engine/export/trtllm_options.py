"""TensorRT-LLM LLM-API options for a DSpark-layout drafter (``trtllm/`` of an engine directory).

``llm_api_options.yaml`` is what ``trtllm-serve --extra_llm_api_options`` and ``LLM(**options)``
read: ``backend: pytorch``, ``dtype``, ``max_batch_size``, ``max_seq_len`` and a
``speculative_config`` with ``decoding_type: DSpark``, ``max_draft_len``, ``speculative_model``,
``enable_confidence_scheduling`` and the two confidence files. Those two keys are spelled
differently across TensorRT-LLM versions (:data:`KEY_SPELLINGS`), so the version is chosen at
build time (``--trtllm-version``) and recorded in the manifest:

- ``main`` (upstream source, ``tensorrt_llm/llmapi/llm_args.py`` ``DSparkDecodingConfig`` and the
  readers in ``_torch/speculative/dspark_*``): ``confidence_sts_path``, ``confidence_sps_table_path``;
  confidence scheduling there is the ragged per-request path, ``enable_ragged_verify: true``,
  which its config refuses without a cost table.
- ``1.4`` (the 1.4 LLM-API reference): ``confidence_calibration_path``, ``confidence_cost_table_path``.

Files, in the forms those loaders read: the STS calibration as the kit writes it (the reader
takes ``sts_temperatures``, the kit's key); the SPS table converted to the planner's
interpolated cost curve (:func:`sps_to_trtllm`).
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["KEY_SPELLINGS", "TRTLLM_VERSIONS", "DEFAULT_TRTLLM_VERSION", "TrtllmVersionError", "resolve_version",
           "sps_to_trtllm", "write_trtllm_options"]

KEY_SPELLINGS: dict[str, dict[str, str]] = {
    "main": {"sts": "confidence_sts_path", "sps": "confidence_sps_table_path"},
    "1.4": {"sts": "confidence_calibration_path", "sps": "confidence_cost_table_path"},
}
TRTLLM_VERSIONS = tuple(KEY_SPELLINGS)
DEFAULT_TRTLLM_VERSION = "main"


class TrtllmVersionError(ValueError):
    """A ``--trtllm-version`` whose option spelling the kit does not know."""


def resolve_version(version: str | None) -> str:
    """``None`` -> the default; ``1.4`` / ``1.4.x`` -> ``1.4``; ``main`` as is; anything else refused."""
    if version is None:
        return DEFAULT_TRTLLM_VERSION
    v = str(version).strip().lower()
    if v in KEY_SPELLINGS:
        return v
    if v.startswith("1.4."):
        return "1.4"
    raise TrtllmVersionError(f"--trtllm-version {version!r}: the kit knows the option spelling of "
                             f"{', '.join(TRTLLM_VERSIONS)} (1.4.x counts as 1.4)")


def sps_to_trtllm(table) -> dict:
    """Our ``SpsTable`` -> the interpolated cost curve TensorRT-LLM's DSpark planner loads:
    ``token_counts`` = batch tokens incl. the bonus token (our unit), ``step_time_ms`` = 1000 /
    steps_per_s (whole-step times, so ``fixed_overhead_ms`` = 0), ``_meta.lookup = "interp"``."""
    return {
        "token_counts": [int(t) for t in table.tokens],
        "step_time_ms": [1000.0 / float(s) for s in table.steps_per_s],
        "fixed_overhead_ms": 0.0,
        "_meta": {"lookup": "interp", "encoding": "whole-step", "source": "dspark-sps v1",
                  "device": table.device, "engine": table.engine, "created_at": table.created_at},
    }


def write_trtllm_options(out_dir: str | Path, *, hf_dir: str, block_size: int, max_batch: int, max_context: int,
                         dtype: str, sts_file: str | None, sps_file: str | None, has_confidence: bool,
                         version: str | None = None) -> dict:
    """Write ``llm_api_options.yaml`` in ``version``'s spelling; returns what the manifest records."""
    import yaml

    version = resolve_version(version)
    keys = KEY_SPELLINGS[version]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scheduling = bool(has_confidence and sps_file)
    spec = {"decoding_type": "DSpark", "max_draft_len": int(block_size), "speculative_model": hf_dir,
            "enable_confidence_scheduling": scheduling}
    if scheduling and version == "main":
        spec["enable_ragged_verify"] = True
    if sts_file:
        spec[keys["sts"]] = sts_file
    if sps_file:
        spec[keys["sps"]] = sps_file
    options = {"backend": "pytorch", "dtype": {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}[dtype],
               "max_batch_size": int(max_batch), "max_seq_len": int(max_context), "speculative_config": spec}
    text = (f"# TensorRT-LLM LLM-API options ({version} spelling) for the DSpark drafter in ../hf (paths relative\n"
            "# to the engine dir; make them absolute or run from the engine dir). Written by dspark build.\n")
    (out / "llm_api_options.yaml").write_text(text + yaml.safe_dump(options, sort_keys=False))
    return {"file": "llm_api_options.yaml", "trtllm_version": version, "key_spelling": dict(keys),
            "speculative_config": spec}
