"""Shared fixtures: a tiny random Llama target (fast, exact semantics) and the real SmolLM2."""
from __future__ import annotations

import signal

import pytest
import torch

from dspark.training.config import RunConfig, TargetProfile, load_run_config
from dspark.training.target import Target


def pytest_configure(config):
    """A SIGTERM to the test run (a CI timeout, ``kill``) tears the fixtures down like Ctrl-C:
    the servers the e2e fixtures started are stopped instead of being left running."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


class _TinyTokenizer:
    """Just enough tokenizer for a random tiny target (ids are their own text)."""

    eos_token_id = 2
    pad_token_id = 2

    def get_vocab(self):
        return {f"t{i}": i for i in range(64)}

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True):
        return [1] + [3 + (ord(c) % 60) for c in msgs[0]["content"]] + [1]


def make_tiny_target(model_type: str = "llama", seed: int = 0, attention_bias: bool = False) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                  attention_bias=attention_bias)
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # sharpen the random model so greedy decoding has clear (non-tied) argmaxes
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
    profile = TargetProfile(name="tiny", family=model_type, source=None, layer_ids=[0, 1, 2], mask_token_id=5,
                            stop_token_ids=[], block_size=4, draft_layers=1, markov_rank=8)
    return Target(model.float(), _TinyTokenizer(), profile)


def run_to_completion(engine, jobs) -> dict[str, list[int]]:
    """Submit ``jobs`` [(request id, prompt ids, SamplingParams)] at once, run the engine dry;
    -> request id -> emitted token ids."""
    outs: dict[str, list[int]] = {}
    for rid, prompt, params in jobs:
        engine.submit(rid, prompt, params, lambda o: outs.setdefault(o.request_id, []).extend(o.new_token_ids))
    engine.run_until_done()
    return outs


def record_rows(obj, method: str) -> list[int]:
    """Wrap ``obj.method(slots, ...)`` so each call appends ``len(slots)`` to the returned list."""
    inner = getattr(obj, method)
    rows: list[int] = []

    def recording(slots, *args, **kwargs):
        rows.append(len(slots))
        return inner(slots, *args, **kwargs)
    setattr(obj, method, recording)
    return rows


def run_with_arrivals(engine, jobs) -> dict[str, list[int]]:
    """Submit ``jobs`` [(arrival step, request id, prompt ids, SamplingParams)] each at its step
    (ties in list order) while the engine steps, until all are done; -> request id -> emitted ids."""
    outs: dict[str, list[int]] = {}
    pending = sorted(jobs, key=lambda j: j[0])
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.submit(rid, prompt, params, lambda o: outs.setdefault(o.request_id, []).extend(o.new_token_ids))
        engine.step()
        step += 1
    return outs


def tiny_run_config(algo: str = "dspark") -> RunConfig:
    cfg = load_run_config(None, [f"algo={algo}"])
    cfg.target = TargetProfile(name="tiny", family="llama", source=None, layer_ids=[0, 1, 2], mask_token_id=5,
                               stop_token_ids=[], block_size=4, draft_layers=1, markov_rank=8)
    return cfg


@pytest.fixture
def tiny_target() -> Target:
    return make_tiny_target()


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target (dequantised once into ~/.cache/dspark)."""
    from dspark.training.target import load_target

    return load_target(load_run_config("quickstart").target)


def tiny_drafter(target: Target, algo: str = "dspark", draft_ids: torch.Tensor | None = None, seed: int = 3,
                 head_std: float = 0.5):
    """A fresh ``algo`` drafter for the tiny ``target`` (built after ``torch.manual_seed(seed)``), in
    eval mode, with the draft vocabulary ``draft_ids`` when given, and its Markov / confidence
    heads drawn from N(0, head_std) (they start at zero, which would hide what they do)."""
    from dspark.training.models import build_drafter, drafter_config_for

    cfg = tiny_run_config(algo)
    if draft_ids is not None:
        cfg.target.draft_vocab = int(draft_ids.numel())
    torch.manual_seed(seed)
    d = build_drafter(drafter_config_for(cfg, target), target).eval()
    if draft_ids is not None:
        d.set_draft_vocab(draft_ids)
    with torch.no_grad():
        if getattr(d, "markov", None) is not None:
            d.markov.w2.weight.normal_(0, head_std)
        if getattr(d, "confidence", None) is not None:
            d.confidence.proj.weight.normal_(0, head_std)
    return d
