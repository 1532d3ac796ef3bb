"""The text ends of the pipeline: preprocessing (text -> token ids) and postprocessing
(token ids -> text), each a function of one request's tensors."""
from __future__ import annotations

import numpy as np

from dspark.engine.api import RequestValidationError

from . import tensors as T
from .detokenizer import decode_chunk


class Preprocessor:
    """``text_input`` -> ``input_ids`` (through the chat template unless switched off)."""

    def __init__(self, tokenizer, apply_chat_template: bool = True, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt or None
        eos = tokenizer.eos_token_id
        self.default_end_id = -1 if eos is None else int(eos)

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat:
            messages = [{"role": "user", "content": text}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def __call__(self, inputs: T.Tensors) -> dict[str, np.ndarray]:
        row = T.one_row(inputs, T.TEXT_INPUT)
        if row is None:
            raise RequestValidationError(f"{T.TEXT_INPUT} is required")
        if row.size != 1:
            raise RequestValidationError(f"{T.TEXT_INPUT}: expected one string, got {row.size}")
        text = T.to_str(row[0], T.TEXT_INPUT)
        if not text:
            raise RequestValidationError(f"{T.TEXT_INPUT} is empty")
        if T.strings(inputs, T.BAD_WORDS):
            raise RequestValidationError(f"{T.BAD_WORDS} is not supported by the DSpark engine; leave it empty")
        chat = T.scalar(inputs, T.APPLY_CHAT_TEMPLATE, "bool", default=self.apply_chat_template)
        if chat and not getattr(self.tokenizer, "chat_template", None):
            raise RequestValidationError("this tokenizer has no chat template; send apply_chat_template=false")
        ids = self.encode(text, chat)
        end_id = T.scalar(inputs, T.END_ID, "int", default=self.default_end_id)
        return {
            T.INPUT_IDS: T.int_tensor(ids),
            T.INPUT_LENGTHS: T.scalar_tensor(len(ids), np.int32),
            T.END_ID: T.scalar_tensor(end_id, np.int32),
        }


class Postprocessor:
    """``output_ids`` (+ ``prefix_ids`` context) -> ``text_output``; statistics pass through.

    Ids come from the LLM model, but postprocessing can also be called directly: ids outside
    the tokenizer's range are refused (the tokenizer would raise OverflowError on a negative
    id and silently drop one past its end)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.num_tokens = len(tokenizer)

    def token_ids(self, inputs: T.Tensors, name: str, required: bool = False) -> list[int]:
        row = T.one_row(inputs, name)
        if row is None:
            if required:  # Triton 2.51 checks the number of inputs, not their names
                raise RequestValidationError(f"{name} is required")
            return []
        if not np.issubdtype(row.dtype, np.integer):
            raise RequestValidationError(f"{name}: expected integer token ids, got {row.dtype}")
        ids = [int(i) for i in row]
        bad = [i for i in ids if not 0 <= i < self.num_tokens]
        if bad:
            raise RequestValidationError(
                f"{name}: token id {bad[0]} outside the tokenizer's range [0, {self.num_tokens})")
        return ids

    def __call__(self, inputs: T.Tensors) -> dict[str, np.ndarray]:
        new_ids = self.token_ids(inputs, T.OUTPUT_IDS, required=True)
        prefix_ids = self.token_ids(inputs, T.PREFIX_IDS)
        final = T.scalar(inputs, T.IS_FINAL, "bool", default=True)
        text = decode_chunk(self.tokenizer, prefix_ids, new_ids, final, self.skip_special_tokens)
        out = {T.TEXT_OUTPUT: T.bytes_tensor([text])}
        for name in T.STAT_OUTPUTS:
            if name in inputs:
                out[name] = np.asarray(inputs[name])
        return out
