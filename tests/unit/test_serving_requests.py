"""Request tensors -> SamplingParams, and every bad input -> a readable RequestValidationError."""
from __future__ import annotations

import numpy as np
import pytest

from dspark.engine.api import RequestValidationError
from dspark.engine.serving.requests import parse_llm_request, parse_parameters
from dspark.engine.serving.text import Postprocessor, Preprocessor

CTX = 128


def req(**kw):
    base = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32)}
    base.update(kw)
    return base


def one(v, dtype):
    return np.array([[v]], dtype=dtype)


def test_defaults_are_greedy_non_streaming():
    r = parse_llm_request(req(), CTX, default_max_tokens=16)
    assert r.prompt_ids == [5, 6, 7] and not r.streaming
    assert r.params.max_tokens == 16 and r.params.temperature == 0.0 and r.params.stop_token_ids == []


def test_all_fields_map_to_sampling_params():
    r = parse_llm_request(req(
        request_output_len=one(9, np.int32), end_id=one(2, np.int32), streaming=one(True, bool),
        temperature=one(0.7, np.float32), runtime_top_p=one(0.8, np.float32), runtime_top_k=one(20, np.int32),
        random_seed=one(3, np.uint64), stop_words=np.array([[b"\n\n", b""]], dtype=object),
        input_lengths=one(2, np.int32)), CTX)
    p = r.params
    assert r.prompt_ids == [5, 6] and r.streaming
    assert (p.max_tokens, p.top_k, p.seed, p.stop_token_ids, p.stop_strings) == (9, 20, 3, [2], ["\n\n"])
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.8)


def test_end_id_minus_one_means_no_end_token():
    assert parse_llm_request(req(end_id=one(-1, np.int32)), CTX).params.stop_token_ids == []
    assert parse_llm_request(req(end_id=one(-1, np.int32)), CTX, vocab_size=VOCAB).params.stop_token_ids == []


VOCAB = 49152


@pytest.mark.parametrize("end_id", [10**6, VOCAB, -7, -2])
def test_end_id_outside_the_vocabulary_is_refused_not_treated_as_no_end_token(end_id):
    with pytest.raises(RequestValidationError, match=f"end_id={end_id} is not a token id.*-1 for no end token"):
        parse_llm_request(req(end_id=one(end_id, np.int32)), CTX, vocab_size=VOCAB)


def test_end_id_at_the_last_vocabulary_entry_is_a_stop_token():
    r = parse_llm_request(req(end_id=one(VOCAB - 1, np.int32)), CTX, vocab_size=VOCAB)
    assert r.params.stop_token_ids == [VOCAB - 1]


def test_negative_end_id_is_refused_even_without_a_known_vocabulary():
    with pytest.raises(RequestValidationError, match="end_id=-7"):
        parse_llm_request(req(end_id=one(-7, np.int32)), CTX)


def test_prompt_ids_past_the_vocabulary_are_refused():
    with pytest.raises(RequestValidationError, match=f"token id {VOCAB} outside the vocabulary"):
        parse_llm_request(req(input_ids=np.array([[5, VOCAB]], np.int32)), CTX, vocab_size=VOCAB)


@pytest.mark.parametrize("inputs, message", [
    (req(input_ids=np.zeros((1, 0), np.int32)), "empty"),
    (req(input_ids=np.zeros((2, 3), np.int32)), "batch size 2"),
    (req(input_ids=np.array([[1.5]], np.float32)), "integer token ids"),
    (req(input_ids=np.array([[-3]], np.int32)), "negative token id"),
    (req(input_ids=np.ones((1, CTX), np.int32)), "context"),
    (req(request_output_len=one(0, np.int32)), "positive"),
    (req(request_output_len=one(-5, np.int32)), "positive"),
    (req(request_output_len=one(2**31 - 1, np.int32)), "exceeds the engine context"),
    (req(request_output_len=np.array([[1, 2]], np.int32)), "one value"),
    (req(temperature=one(np.nan, np.float32)), "finite"),
    (req(temperature=one(-1.0, np.float32)), "temperature"),
    (req(runtime_top_p=one(0.0, np.float32)), "top_p"),
    (req(runtime_top_k=one(-1, np.int32)), "top_k"),
    (req(input_lengths=one(7, np.int32)), "input_lengths"),
    ({"request_output_len": one(3, np.int32)}, "input_ids is required"),
    (req(stop_words=np.array([[b"\xff\xfe"]], dtype=object)), "UTF-8"),
    (req(exclude_input_in_output=one(False, bool)), "exclude_input_in_output"),
])
def test_bad_inputs_are_refused_with_a_reason(inputs, message):
    with pytest.raises(RequestValidationError, match=message):
        parse_llm_request(inputs, CTX)


def test_unknown_request_parameters_are_refused_but_triton_ones_pass():
    assert parse_parameters('{"triton_enable_empty_final_response": true}') == {
        "triton_enable_empty_final_response": True}
    with pytest.raises(RequestValidationError, match="unknown request parameter.*temprature"):
        parse_llm_request(req(), CTX, parameters='{"temprature": 0.5}')


class CharTokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def __len__(self):
        return 256


def text_in(s):
    return {"text_input": np.array([[s.encode()]], dtype=object)}


def test_preprocessing_applies_the_chat_template_and_fills_end_id():
    out = Preprocessor(CharTokenizer(), system_prompt="sys")(text_in("hi"))
    ids = out["input_ids"][0].tolist()
    assert "".join(map(chr, ids)) == "<system>sys<user>hi<assistant>"
    assert out["input_lengths"][0, 0] == len(ids) and out["end_id"][0, 0] == 0
    raw = Preprocessor(CharTokenizer())({**text_in("hi"), "apply_chat_template": one(False, bool)})
    assert raw["input_ids"][0].tolist() == [ord("h"), ord("i")]


@pytest.mark.parametrize("inputs, message", [
    (text_in(""), "empty"),
    ({"text_input": np.array([[b"\xff"]], dtype=object)}, "UTF-8"),
    ({**text_in("x"), "bad_words": np.array([[b"foo"]], dtype=object)}, "bad_words"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, "batch size 2"),
    # what the ensemble forwards for a request without text_input (every input goes to preprocessing)
    ({"max_tokens": one(32, np.int32), "stream": one(False, bool)}, "text_input is required"),
])
def test_preprocessing_refuses_bad_text(inputs, message):
    with pytest.raises(RequestValidationError, match=message):
        Preprocessor(CharTokenizer())(inputs)


def test_postprocessing_decodes_the_chunk_and_passes_statistics_through():
    out = Postprocessor(CharTokenizer())({
        "output_ids": np.array([[ord("c"), 0]], np.int32), "prefix_ids": np.array([[ord("a"), ord("b")]], np.int32),
        "is_final": one(True, bool), "accept_len": one(2.5, np.float32)})
    assert out["text_output"][0, 0] == b"c"
    assert out["accept_len"][0, 0] == np.float32(2.5)


@pytest.mark.parametrize("ids, message", [
    ([[1000000, -5]], "output_ids: token id 1000000 outside the tokenizer's range \\[0, 256\\)"),
    ([[-5]], "token id -5 outside"),
    ([[256]], "token id 256 outside"),
])
def test_postprocessing_refuses_ids_outside_the_tokenizer_in_one_line(ids, message):
    with pytest.raises(RequestValidationError, match=message) as info:
        Postprocessor(CharTokenizer())({"output_ids": np.array(ids, np.int32)})
    assert "\n" not in str(info.value)


def test_postprocessing_refuses_bad_prefix_ids_and_float_ids():
    post = Postprocessor(CharTokenizer())
    with pytest.raises(RequestValidationError, match="output_ids is required"):
        post({"is_final": one(True, bool)})
    with pytest.raises(RequestValidationError, match="prefix_ids: token id -1"):
        post({"output_ids": np.array([[97]], np.int32), "prefix_ids": np.array([[-1]], np.int32)})
    with pytest.raises(RequestValidationError, match="integer token ids"):
        post({"output_ids": np.array([[97.0]], np.float32)})
