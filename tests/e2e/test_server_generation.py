"""Generation through a real tritonserver over gRPC: streaming, non-streaming, in-flight batching."""
from __future__ import annotations

import pytest

from dspark.engine.serving.client import make_inputs

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["What is 2+2? Answer briefly.", "Name one primary color.", "Say hello in French.",
           "What is the capital of Italy?"]


def ok(res):
    assert res.error is None, res.error
    assert res.finish_reason in ("length", "stop"), res.finish_reason
    return res


def test_streamed_text_equals_non_streamed_text_for_greedy(client):
    streamed = ok(client.generate(PROMPTS[0], max_tokens=12, stream=True))
    whole = ok(client.generate(PROMPTS[0], max_tokens=12, stream=False))
    assert len(whole.chunks) == 1 and len(streamed.chunks) >= 2
    assert streamed.text == whole.text and whole.text.strip()
    assert streamed.tokens == whole.tokens <= 12
    assert whole.num_steps >= 1 and whole.accept_len >= 1.0


def test_spec_and_target_only_give_the_same_greedy_text_in_one_server(client):
    spec = ok(client.generate(PROMPTS[1], max_tokens=10, stream=False))
    base = ok(client.generate(PROMPTS[1], max_tokens=10, stream=False, model="ensemble_target_only"))
    assert spec.text == base.text
    assert base.num_draft_tokens == 0 and spec.num_draft_tokens > 0


def test_concurrent_requests_join_one_running_batch(client, server):
    solo = ok(client.generate(PROMPTS[2], max_tokens=8, stream=False)).text
    results = [client.submit(make_inputs(p, 8, True)) for p in PROMPTS * 2]
    for r in results:
        assert r.done.wait(300), "request did not finish"
        ok(r)
    # in-flight batching: every request streamed its first token before the first one finished
    assert max(r.chunk_times[0] for r in results) < min(r.t_done for r in results)
    by_prompt = {}
    for p, r in zip(PROMPTS * 2, results):
        by_prompt.setdefault(p, set()).add(r.text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt  # greedy: batch-independent
    assert by_prompt[PROMPTS[2]] == {solo}
    assert server.metric("dspark_batch_size_count", model="dspark_llm") > 0


def test_seeded_sampling_is_reproducible(client):
    kw = dict(max_tokens=8, stream=False, temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    a = ok(client.generate(PROMPTS[3], **kw))
    b = ok(client.generate(PROMPTS[3], **kw))
    assert a.text == b.text


def test_stop_word_ends_the_request(client):
    free = ok(client.generate(PROMPTS[0], max_tokens=12, stream=False))
    words = free.text.split()
    assert len(words) >= 2
    stopped = ok(client.generate(PROMPTS[0], max_tokens=12, stream=True, stop_words=[words[1]]))
    assert stopped.finish_reason == "stop"
    assert stopped.text.startswith(words[0]) and len(stopped.text) < len(free.text)


def test_acceptance_metrics_are_served_next_to_tritons_own(client, server):
    ok(client.generate(PROMPTS[0], max_tokens=6, stream=True))
    text = server.metrics()
    assert "nv_inference_request_success" in text
    for name in ("dspark_draft_rounds_total", "dspark_draft_tokens_total", "dspark_output_tokens_total",
                 "dspark_verify_len_bucket", "dspark_requests_total"):
        assert name in text, name
    assert server.metric("dspark_draft_rounds_total", model="dspark_llm") > 0
    assert server.metric("dspark_draft_tokens_total", model="dspark_llm_target_only") == 0
