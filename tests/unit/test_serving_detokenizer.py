"""Streamed text equals one-shot text, whatever the chunking, and never shows a split character."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.engine.serving.detokenizer import REPLACEMENT, IncrementalDetokenizer, decode_chunk

SPECIAL = 300  # a special token id (skipped when decoding)


class ByteTokenizer:
    """Byte-level tokenizer: token i < 256 is byte i, as in the fallback of byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and SPECIAL in ids:
            text += "<special>"
        return text


def stream(tok, ids, cuts, window=8):
    det = IncrementalDetokenizer(tok, window=window)
    bounds = sorted({c for c in cuts if 0 < c < len(ids)}) + [len(ids)]
    out, start = [], 0
    for end in bounds:
        out.append(det.push(ids[start:end], final=end == len(ids)))
        start = end
    return out


def test_emoji_split_over_two_chunks_is_held_back_then_emitted_whole():
    tok = ByteTokenizer()
    ids = list("a😀b".encode())  # 1 + 4 + 1 bytes
    chunks = stream(tok, ids, [3])
    assert chunks == ["a", "😀b"]
    assert all(REPLACEMENT not in c for c in chunks)


def test_stream_that_ends_mid_character_shows_the_replacement_like_one_shot_decode():
    tok = ByteTokenizer()
    ids = list("ok".encode()) + list("😀".encode())[:2]
    assert "".join(stream(tok, ids, [1, 3])) == tok.decode(ids)


def test_special_tokens_are_skipped():
    tok = ByteTokenizer()
    assert decode_chunk(tok, list(b"hi"), [SPECIAL], final=True) == ""


@settings(max_examples=400, deadline=None)
@given(text=st.text(min_size=0, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=12),
       window=st.integers(7, 10))
def test_concatenated_chunks_equal_one_shot_decode(text, cuts, window):
    """Exact for valid UTF-8 once the prefix window holds >= 7 bytes (see the module doc)."""
    tok = ByteTokenizer()
    ids = list(text.encode())
    chunks = stream(tok, ids, cuts, window)
    assert "".join(chunks) == text
    assert all(REPLACEMENT not in c for c in chunks[:-1]) or REPLACEMENT in text


def test_a_too_short_window_can_repeat_a_replacement_character():
    """Why the window is 8: a 4-token window starting inside a character loses its place."""
    tok = ByteTokenizer()
    ids = list("0\x80\x80\U00010000".encode())
    assert "".join(stream(tok, ids, [8], window=4)) != tok.decode(ids)
    assert "".join(stream(tok, ids, [8], window=8)) == tok.decode(ids)


@pytest.mark.slow
def test_smollm2_tokenizer_streams_emoji_and_accents_exactly():
    from dspark.training.target import load_tokenizer

    tok = load_tokenizer()
    text = "Héllo wörld 😀👍🏽 — naïve café, 東京タワー. Done!<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    one_shot = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    rng = random.Random(0)
    for _ in range(50):
        cuts = rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(1, 12)))
        chunks = stream(tok, ids, cuts)
        assert "".join(chunks) == one_shot
        assert all(REPLACEMENT not in c for c in chunks)
