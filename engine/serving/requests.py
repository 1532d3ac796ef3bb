"""Request parsing and validation for the LLM model: tensors -> prompt ids + SamplingParams.

Triton already refuses unknown input names, wrong data types and wrong ranks (from
config.pbtxt); what is checked here is what the config cannot say: one sequence per
request, non-empty prompts that fit the context, token ids (prompt and ``end_id``) inside
the vocabulary, positive output lengths, sane sampling values, and no unknown request
parameters. Every failure is a ``RequestValidationError``
whose message goes back to the client as an INVALID_ARG error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dspark.engine.api import RequestValidationError, SamplingParams

from . import tensors as T

# Request parameters (the gRPC ``parameters`` map) the LLM model understands. Triton's own
# (``triton_*``, e.g. triton_enable_empty_final_response) are ignored here.
KNOWN_PARAMETERS: frozenset[str] = frozenset()
MAX_SEED = 2**63 - 1
NO_END_ID = -1  # end_id meaning "no end token", as in the TensorRT-LLM backend


@dataclass
class LLMRequest:
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool


def parse_parameters(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's parameters; unknown ones are refused so that typos do not pass silently."""
    if raw is None or raw == "":
        return {}
    params = json.loads(raw) if isinstance(raw, str) else dict(raw)
    unknown = sorted(k for k in params if k not in KNOWN_PARAMETERS and not k.startswith("triton_"))
    if unknown:
        accepted = ", ".join(sorted(KNOWN_PARAMETERS)) or "none"
        raise RequestValidationError(
            f"unknown request parameter(s) {', '.join(unknown)}; accepted: {accepted} "
            "(sampling settings are input tensors: temperature, top_p, top_k, ...)")
    return params


def check_end_id(end_id: int, vocab_size: int | None) -> list[int]:
    """The stop token ids an ``end_id`` asks for: -1 means none (the TensorRT-LLM backend's
    convention); any other id must be a token of the vocabulary."""
    if end_id == NO_END_ID:
        return []
    if end_id < 0 or (vocab_size is not None and end_id >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab)"
        raise RequestValidationError(
            f"{T.END_ID}={end_id} is not a token id: use one in {bound}, or -1 for no end token")
    return [end_id]


def parse_llm_request(inputs: T.Tensors, max_context: int, default_max_tokens: int = 64,
                      parameters: str | Mapping[str, Any] | None = None,
                      vocab_size: int | None = None) -> LLMRequest:
    """One request's tensors -> prompt ids and SamplingParams; ``vocab_size`` (the target's)
    bounds the prompt ids and ``end_id`` (None: only negative ids are refused)."""
    parse_parameters(parameters)
    ids = T.one_row(inputs, T.INPUT_IDS)
    if ids is None:
        raise RequestValidationError(f"{T.INPUT_IDS} is required")
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestValidationError(f"{T.INPUT_IDS}: expected integer token ids, got {ids.dtype}")
    length = T.scalar(inputs, T.INPUT_LENGTHS, "int", default=ids.size)
    if not 0 <= length <= ids.size:
        raise RequestValidationError(f"{T.INPUT_LENGTHS}={length} but {T.INPUT_IDS} holds {ids.size} tokens")
    prompt = [int(x) for x in ids[:length]]
    if not prompt:
        raise RequestValidationError("the prompt is empty (0 tokens)")
    if min(prompt) < 0:
        raise RequestValidationError(f"{T.INPUT_IDS}: negative token id {min(prompt)}")
    if vocab_size is not None and max(prompt) >= vocab_size:
        raise RequestValidationError(
            f"{T.INPUT_IDS}: token id {max(prompt)} outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_context:
        raise RequestValidationError(
            f"the prompt has {len(prompt)} tokens; the engine context is {max_context} tokens "
            "(prompt + max_tokens must fit)")

    max_tokens = T.scalar(inputs, T.REQUEST_OUTPUT_LEN, "int", default=default_max_tokens)
    if max_tokens < 1:
        raise RequestValidationError(f"max_tokens must be a positive integer, got {max_tokens}")
    if len(prompt) + max_tokens > max_context:
        raise RequestValidationError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the engine "
            f"context of {max_context} tokens; use max_tokens <= {max_context - len(prompt)}")

    if not T.scalar(inputs, T.EXCLUDE_INPUT_IN_OUTPUT, "bool", default=True):
        raise RequestValidationError("exclude_input_in_output=false is not supported: outputs never include the prompt")
    seed = T.scalar(inputs, T.RANDOM_SEED, "int")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise RequestValidationError(f"random_seed must be in [0, 2^63), got {seed}")
    end_id = T.scalar(inputs, T.END_ID, "int")
    stop_ids = [] if end_id is None else check_end_id(end_id, vocab_size)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=T.scalar(inputs, T.TEMPERATURE, "float", default=0.0),
        top_p=T.scalar(inputs, T.RUNTIME_TOP_P, "float", default=1.0),
        top_k=T.scalar(inputs, T.RUNTIME_TOP_K, "int", default=0),
        seed=seed,
        stop_token_ids=stop_ids,
        stop_strings=T.strings(inputs, T.STOP_WORDS),
    )
    params.validate(max_context)
    return LLMRequest(prompt, params, streaming=T.scalar(inputs, T.STREAMING, "bool", default=False))
