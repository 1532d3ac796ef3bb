"""The fused C++ decoder stack computes the target's layers as the PyTorch layers do: the same
logits, features and cache writes to float32 rounding, and the same greedy tokens."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dspark.engine import cpu_decoder
from dspark.engine.api import SamplingParams
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.engine.target_runner import TargetRunner
from dspark.training import cpu_linear

from ..conftest import make_tiny_target, run_to_completion

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="the fused stack cannot be built here")


def _biased_target():
    target = make_tiny_target("llama", attention_bias=True)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in target.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                bias = getattr(layer.self_attn, proj).bias
                bias.copy_(torch.randn(bias.shape, generator=g))
    return target


def _forwards(target, layers: str):
    """A gathered prefill (slots 2, 0, 3), then a ragged verify-shaped step."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (9, 3, 14)]
    r = TargetRunner(target, max_slots=4, max_context=64, attention="varlen", layers=layers)
    pre = r.forward([2, 0, 3], prompts)
    for s, p in zip((2, 0, 3), prompts):
        r.set_length(s, len(p))
    step = r.forward([0, 1, 2], [[7, 8, 9], [10], [11, 12, 13, 14]])
    return r, pre, step


@pytest.mark.parametrize("make", [lambda: make_tiny_target("llama"), lambda: make_tiny_target("qwen3"), _biased_target],
                         ids=["llama", "qwen3-qk-norm", "llama-attention-bias"])
@pytest.mark.parametrize("linear_mode", ["kernel", "flinear"])
def test_fused_stack_matches_the_pytorch_layers(make, linear_mode, monkeypatch):
    monkeypatch.setenv("DSPARK_CPU_LINEAR", linear_mode)
    target = make()
    fused, torch_layers = _forwards(target, "fused"), _forwards(target, "torch")
    assert fused[0].stack is not None and torch_layers[0].stack is None
    for got, want in zip(fused[1:], torch_layers[1:]):
        for name in ("logits", "aux", "last"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    written = {0: 3 + 3, 1: 1, 2: 9 + 4, 3: 14}  # past these a CPU cache holds whatever its memory held
    for slot, n in written.items():
        for cache in ("k", "v"):
            torch.testing.assert_close(getattr(fused[0], cache)[:, slot, :, :n],
                                       getattr(torch_layers[0], cache)[:, slot, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_tokens_are_the_same_with_fused_and_pytorch_layers(model_type):
    target = make_tiny_target(model_type)
    g = torch.Generator().manual_seed(5)
    jobs = [(f"r{i}", torch.randint(6, 64, (n,), generator=g).tolist(), SamplingParams(max_tokens=24, temperature=0.0))
            for i, n in enumerate((5, 17, 9))]
    outs = []
    for layers in ("fused", "torch"):
        engine = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=4, max_context=128, layers=layers))
        assert (engine.runner.stack is not None) == (layers == "fused")
        outs.append(run_to_completion(engine, jobs))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_tokens_logits_are_the_same_bits_alone_and_in_any_batch(model_type):
    """With packed weights and the fused stack every row is computed alone: a request's cache
    entries and logits do not depend on which other requests, drafts or prompt chunks share its
    passes (what makes greedy speculation token-identical to target-only by arithmetic)."""
    target = make_tiny_target(model_type)
    g = torch.Generator().manual_seed(6)
    mine = torch.randint(6, 64, (11,), generator=g).tolist()
    others = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (30, 4, 17)]
    alone = TargetRunner(target, max_slots=4, max_context=64, layers="fused")
    alone.forward([0], [mine], last_logits_only=True)
    alone.set_length(0, len(mine))
    solo = alone.forward([0], [[7, 8, 9, 10]]).logits[0]
    crowd = TargetRunner(target, max_slots=4, max_context=64, layers="fused")
    crowd.forward([0, 1, 2, 3], [mine] + others, last_logits_only=True)  # one pass, four prompts
    for s, p in enumerate([mine] + others):
        crowd.set_length(s, len(p))
    mixed = crowd.forward_mixed([0, 1, 2, 3], [[7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17, 18]], 2)[0]
    assert torch.equal(crowd.k[:, 0, :, :len(mine) + 4], alone.k[:, 0, :, :len(mine) + 4])
    assert torch.equal(mixed.logits[0], solo)


def test_fused_layers_are_refused_with_the_reason_where_they_cannot_run():
    target = make_tiny_target()
    with pytest.raises(ValueError, match="layers='fused': the fused layers need varlen attention"):
        TargetRunner(target, max_slots=2, attention="sdpa", layers="fused")
    assert TargetRunner(target, max_slots=2, attention="sdpa").stack is None  # auto: the PyTorch layers
    target.model.double()
    assert cpu_decoder.supports(target) == "the fused stack runs float32 targets on the CPU"
    with pytest.raises(ValueError, match="layers must be one of"):
        TargetRunner(make_tiny_target(), max_slots=2, layers="compiled")


@pytest.mark.slow
def test_real_target_greedy_tokens_are_the_same_with_fused_and_pytorch_layers(smollm2):
    prompts = [smollm2.chat_prompt_ids(t) for t in ("What is 17 * 23?", "Write a haiku about the sea.")]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=48, temperature=0.0)) for i, p in enumerate(prompts)]
    outs = []
    for layers in ("fused", "torch"):
        engine = SpecEngine(smollm2, None, EngineConfig(mode="target_only", max_batch=2, layers=layers))
        outs.append(run_to_completion(engine, jobs))
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_real_target_logits_are_the_same_bits_alone_and_in_a_batch(smollm2):
    prompts = [smollm2.chat_prompt_ids(t) for t in ("What is 17 * 23?", "Write a haiku about the sea.",
                                                     "List three prime numbers.")]
    alone = TargetRunner(smollm2, max_slots=3, max_context=256, layers="fused")
    alone.forward([0], prompts[:1], last_logits_only=True)
    alone.set_length(0, len(prompts[0]))
    solo = alone.forward([0], [[1, 2, 3, 4]]).logits[0]
    crowd = TargetRunner(smollm2, max_slots=3, max_context=256, layers="fused")
    crowd.forward([0, 1, 2], prompts, last_logits_only=True)
    for s, p in enumerate(prompts):
        crowd.set_length(s, len(p))
    both = crowd.forward([0, 1, 2], [[1, 2, 3, 4], [5], [6, 7]]).logits[0]
    assert torch.equal(both, solo)


def test_runners_on_one_target_share_its_packed_stack_until_its_weights_change(monkeypatch):
    """One packed copy per target: a second runner (a second engine in the same process) reads the
    same weight memory; a weight changed in place, or another packing choice, gets a new stack
    that computes with the new weights."""
    target = make_tiny_target("llama")
    first = TargetRunner(target, max_slots=2, max_context=64, layers="fused")
    second = TargetRunner(target, max_slots=4, max_context=32, layers="fused")
    assert first.stack is second.stack
    assert TargetRunner(make_tiny_target("llama"), max_slots=2, max_context=64, layers="fused").stack is not first.stack
    before = first.forward([0], [[7, 8, 9]]).logits
    with torch.no_grad():
        target.layers[0].mlp.up_proj.weight.mul_(2.0)
    changed = TargetRunner(target, max_slots=2, max_context=64, layers="fused")
    assert changed.stack is not first.stack
    after = changed.forward([0], [[7, 8, 9]]).logits
    want = TargetRunner(target, max_slots=2, max_context=64, layers="torch").forward([0], [[7, 8, 9]]).logits
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)
    other = "flinear" if cpu_linear.mode() == "kernel" else "kernel"
    monkeypatch.setenv("DSPARK_CPU_LINEAR", other)
    assert TargetRunner(target, max_slots=2, max_context=64, layers="fused").stack is not changed.stack


def test_a_shared_stack_lives_while_a_runner_holds_it():
    target = make_tiny_target("llama")
    runner = TargetRunner(target, max_slots=2, max_context=64, layers="fused")
    gone = weakref.ref(runner.stack)
    del runner
    gc.collect()
    assert gone() is None  # no engine on the target: its packed copy is freed
    assert TargetRunner(target, max_slots=2, max_context=64, layers="fused").stack is not None
