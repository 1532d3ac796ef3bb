"""Seeded sampling through a real tritonserver: one text for one seed, however it is served.

A sampled request with ``random_seed`` sent alone five times without streaming, five times
streamed, and as four copies among 32 concurrent requests, to the speculative ensemble (the
engine directory's drafter) and to the target-only ensemble: every run gives the same text
(the coupled verify rule, docs/runtime.md "Seeded sampling").
"""
from __future__ import annotations

import pytest

from dspark.engine.serving.client import make_inputs

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPT = "Write a haiku about rain."
SEEDED = dict(max_tokens=16, temperature=1.0, seed=1234)
OTHERS = ["Name one primary color.", "What is 2+2?", "Say hello in French.", "Count to five.",
          "What is the capital of Italy?", "Give me a synonym for happy.", "Write one line about the sea."]


def _ok(res):
    assert res.error is None, res.error
    assert res.finish_reason in ("length", "stop"), res.finish_reason
    return res


def _in_batch(client, model: str) -> list[str]:
    """Four copies of the seeded request among 28 others (greedy, other seeds, no seed), all in flight."""
    jobs = []
    for i in range(28):
        kind = i % 3
        kw = dict(max_tokens=8 + i % 12, temperature=0.0 if kind == 0 else 0.7 + 0.1 * (i % 5),
                  seed=None if kind == 2 else 77 + i)
        jobs.append((False, OTHERS[i % len(OTHERS)], kw))
        if i % 7 == 3:
            jobs.append((True, PROMPT, SEEDED))
    results = [(copy, client.submit(make_inputs(text, kw["max_tokens"], i % 2 == 0,
                                                **{k: v for k, v in kw.items() if k != "max_tokens"}), model))
               for i, (copy, text, kw) in enumerate(jobs)]
    for _, r in results:
        assert r.done.wait(600), "request did not finish"
        _ok(r)
    assert sum(copy for copy, _ in results) == 4 and len(results) == 32
    return [r.text for copy, r in results if copy]


def test_a_seeded_request_gives_one_text_alone_streamed_and_in_a_32_way_batch_with_the_drafter_and_without(client):
    texts: dict[str, list[str]] = {}
    for model in ("ensemble", "ensemble_target_only"):
        runs = [_ok(client.generate(PROMPT, stream=False, model=model, **SEEDED)).text for _ in range(5)]
        runs += [_ok(client.generate(PROMPT, stream=True, model=model, **SEEDED)).text for _ in range(5)]
        runs += _in_batch(client, model)
        texts[model] = runs
    every = texts["ensemble"] + texts["ensemble_target_only"]
    assert every[0].strip() and len(set(every)) == 1, f"seed 1234 gave {len(set(every))} texts: {texts}"
    other = _ok(client.generate(PROMPT, stream=False, **{**SEEDED, "seed": 1235})).text
    assert other != every[0], "another seed must give another text (else the test proves nothing)"
