"""Tensor names of the Triton models and the numpy conversions they share.

Public names follow the TensorRT-LLM backend's ensemble (``text_input``, ``max_tokens``,
``stream``, ``temperature``, ``top_p``, ``top_k``, ``end_id``, ``stop_words``,
``bad_words``, ``random_seed`` -> ``text_output``); the LLM model's own inputs follow
its ``tensorrt_llm`` model (``input_ids``, ``request_output_len``, ``streaming``,
``runtime_top_p`` ...). Every tensor has a leading batch dimension (``max_batch_size`` > 0
in the configs); one request carries one sequence.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dspark.engine.api import RequestValidationError

# preprocessing
TEXT_INPUT = "text_input"
APPLY_CHAT_TEMPLATE = "apply_chat_template"
BAD_WORDS = "bad_words"
# dspark_llm
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
REQUEST_OUTPUT_LEN = "request_output_len"
END_ID = "end_id"
STREAMING = "streaming"
TEMPERATURE = "temperature"
RUNTIME_TOP_P = "runtime_top_p"
RUNTIME_TOP_K = "runtime_top_k"
RANDOM_SEED = "random_seed"
STOP_WORDS = "stop_words"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"  # only true: outputs never echo the prompt
STOP = "stop"  # control request: stop the request named by request_key (or by request id)
REQUEST_KEY = "request_key"  # the LLM model's id of a request, in every response
# dspark_llm -> postprocessing
OUTPUT_IDS = "output_ids"
PREFIX_IDS = "prefix_ids"
IS_FINAL = "is_final"
SEQUENCE_LENGTH = "sequence_length"
FINISH_REASON = "finish_reason"
# acceptance statistics (cumulative for the request), passed through postprocessing
ACCEPT_LEN = "accept_len"
ACCEPTANCE_RATE = "acceptance_rate"
NUM_STEPS = "num_steps"
NUM_DRAFT_TOKENS = "num_draft_tokens"
NUM_ACCEPTED_TOKENS = "num_accepted_tokens"
STAT_OUTPUTS = (SEQUENCE_LENGTH, FINISH_REASON, ACCEPT_LEN, ACCEPTANCE_RATE, NUM_STEPS,
                NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS)
# postprocessing / ensemble
TEXT_OUTPUT = "text_output"

Tensors = Mapping[str, np.ndarray]


def one_row(inputs: Tensors, name: str) -> np.ndarray | None:
    """The single sequence of a batched input ``[1, ...]`` as a 1-D array, or None if absent."""
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim == 0:
        return arr.reshape(1)
    if arr.shape[0] != 1:
        raise RequestValidationError(
            f"{name}: batch size {arr.shape[0]} per request is not supported; "
            "send one sequence per request (concurrent requests are batched in flight)")
    return arr.reshape(-1)


def scalar(inputs: Tensors, name: str, kind: str, default: Any = None) -> Any:
    """One value of a ``[1, 1]`` input; ``kind`` is 'int', 'float', 'bool' or 'str'."""
    row = one_row(inputs, name)
    if row is None:
        return default
    if row.size != 1:
        raise RequestValidationError(f"{name}: expected one value, got {row.size}")
    value = row[0]
    if kind == "int":
        if not np.issubdtype(row.dtype, np.integer):
            raise RequestValidationError(f"{name}: expected an integer tensor, got {row.dtype}")
        return int(value)
    if kind == "float":
        if not np.issubdtype(row.dtype, np.floating) and not np.issubdtype(row.dtype, np.integer):
            raise RequestValidationError(f"{name}: expected a floating-point tensor, got {row.dtype}")
        value = float(value)
        if not np.isfinite(value):
            raise RequestValidationError(f"{name}: must be finite, got {value}")
        return value
    if kind == "bool":
        return bool(value)
    if kind == "str":
        return to_str(value, name)
    raise ValueError(kind)


def to_str(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestValidationError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return str(value)


def strings(inputs: Tensors, name: str) -> list[str]:
    """A list-of-strings input (``[1, n]`` BYTES) without empty entries; [] if absent."""
    row = one_row(inputs, name)
    if row is None:
        return []
    return [s for s in (to_str(v, name) for v in row) if s]


def int_tensor(values, dtype=np.int32) -> np.ndarray:
    """A ``[1, n]`` integer output."""
    return np.asarray(list(values), dtype=dtype).reshape(1, -1)


def scalar_tensor(value, dtype) -> np.ndarray:
    """A ``[1, 1]`` output."""
    return np.asarray([[value]], dtype=dtype)


def bytes_tensor(texts: list[str]) -> np.ndarray:
    """A ``[1, n]`` BYTES output."""
    return np.asarray([[t.encode("utf-8") for t in texts]], dtype=np.object_)


def answer_requests(pb_utils, requests, input_names, handle, before=None) -> list:
    """Shared execute() of the stateless models: one response per request.

    ``handle(inputs) -> {name: ndarray}``; a RequestValidationError becomes an INVALID_ARG
    error response for that request only. ``before(request, inputs)`` runs first (e.g. to
    relay a cancellation). ``pb_utils`` is passed in so this module stays Triton-free.
    """
    responses = []
    for request in requests:
        inputs = {}
        for name in input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        if before is not None:
            before(request, inputs)
        try:
            out = handle(inputs)
        except RequestValidationError as e:
            responses.append(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
            continue
        responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in out.items()]))
    return responses
