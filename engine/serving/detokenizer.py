"""Incremental detokenization that never splits a UTF-8 character.

A byte-level tokenizer may cut one character over several tokens ("😀" is two tokens
in SmolLM2), so decoding each streamed chunk on its own gives U+FFFD garbage. The rule
used here is stateless, so a postprocessing model with no per-request memory can apply
it to every streamed response:

    text(chunk) = decode(prefix + new)[len(stable(decode(prefix))):]

where ``prefix`` is the last few tokens already streamed before ``new`` and
``stable(s)`` drops trailing U+FFFD (an incomplete character at the end). A chunk ending
in an incomplete character holds those bytes back (its own trailing U+FFFD are dropped
too); the next chunk re-emits them once complete, because its ``prefix`` ends at the
same place. The final chunk drops nothing, so a stream that ends mid-character shows
U+FFFD exactly as a one-shot ``decode`` of the whole output would.

Concatenating the chunks gives exactly the one-shot decode when the output is valid
UTF-8 and the prefix spans at least 7 bytes: the prefix may begin inside a character
(at most 3 stray continuation bytes) and end inside one (at most 3 bytes held back), and
a complete character between the two keeps the held-back part separate from the start.
``PREFIX_WINDOW`` = 8 tokens is at least 8 bytes. Invalid byte runs longer than the window
may show a different number of U+FFFD than the one-shot decode. Decoding through the
same prefix also cancels tokenizers that drop the first token's leading space.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"
PREFIX_WINDOW = 8  # tokens of already-streamed context sent with each chunk


def stable_text(text: str) -> str:
    """``text`` without trailing U+FFFD: the part that later tokens cannot change."""
    return text.rstrip(REPLACEMENT)


def decode(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    # clean_up_tokenization_spaces rewrites " ." -> "." across chunk borders: keep it off
    # so that streamed and one-shot text agree.
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def decode_chunk(tokenizer, prefix_ids: Sequence[int], new_ids: Sequence[int], final: bool,
                 skip_special_tokens: bool = True) -> str:
    """Text contributed by ``new_ids`` given the already-streamed ``prefix_ids``."""
    if not prefix_ids and not new_ids:
        return ""
    full = decode(tokenizer, [*prefix_ids, *new_ids], skip_special_tokens)
    done = stable_text(decode(tokenizer, prefix_ids, skip_special_tokens)) if prefix_ids else ""
    if not full.startswith(done):  # a tokenizer whose decode is not prefix-stable
        done = done[:_common_prefix_len(done, full)]
    text = full[len(done):]
    return text if final else stable_text(text)


def prefix_window(streamed_ids: Sequence[int], window: int = PREFIX_WINDOW) -> list[int]:
    """The context to send with the next chunk: the last ``window`` streamed tokens."""
    return list(streamed_ids[-window:]) if window > 0 else []


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class IncrementalDetokenizer:
    """Stateful convenience over ``decode_chunk`` for clients and tests."""

    def __init__(self, tokenizer, window: int = PREFIX_WINDOW, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.window = window
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        prefix = prefix_window(self.ids, self.window)
        self.ids.extend(new_ids)
        return decode_chunk(self.tokenizer, prefix, new_ids, final, self.skip_special_tokens)
