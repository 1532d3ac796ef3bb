"""Draft vocabulary (training/draft_vocab.py): choice of ids, loss semantics against the
full-vocabulary loss, lossless greedy and sampled decoding, checkpoints and the converter."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.export import builder
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dspark.training.draft_vocab import DraftVocabError, choose_draft_vocab, scatter_to_vocab
from dspark.training.loss import block_loss
from dspark.training.models import build_drafter

from ..conftest import make_tiny_target, run_to_completion, tiny_drafter
from ..distribution import pooled_chisquare_pvalue

DRAFT_IDS = torch.tensor([2, 3, 7, 9, 11, 13, 17, 20, 23, 29, 31, 37, 40, 41, 47, 53])


def _drafter(target, algo="dspark", ids=DRAFT_IDS, seed=3):
    return tiny_drafter(target, algo, ids, seed)


def test_choice_takes_answer_tokens_by_frequency_then_prompt_tokens_then_low_ids():
    ids = choose_draft_vocab([[9, 9, 9, 4, 4, 50]], [[30, 30, 31]], size=6, vocab_size=64)
    assert ids.tolist() == sorted([9, 4, 50, 30, 31, 0])  # 50 once still beats prompt tokens
    assert choose_draft_vocab([[9, 9, 4]], [], size=1, vocab_size=64).tolist() == [9]
    with pytest.raises(DraftVocabError):
        choose_draft_vocab([], [], size=65, vocab_size=64)


def test_drafter_refuses_unsorted_or_out_of_range_ids():
    d = _drafter(make_tiny_target())
    for bad in (DRAFT_IDS.flip(0), torch.cat([DRAFT_IDS[:-1], torch.tensor([64])]), DRAFT_IDS[:-1]):
        with pytest.raises(DraftVocabError):
            d.set_draft_vocab(bad)


def test_block_loss_equals_the_full_vocabulary_loss_of_a_drafter_with_no_mass_outside():
    """Logits over the draft ids give the same L1, c*, CE and top-1 as full-vocabulary logits
    that are -inf elsewhere: the target mass outside counts fully in the L1 distance."""
    g = torch.Generator().manual_seed(0)
    V, K = 64, 4
    sub = torch.randn(3, K, DRAFT_IDS.numel(), generator=g)
    full = torch.full((3, K, V), float("-inf")).index_copy_(-1, DRAFT_IDS, sub)
    target = torch.randn(3, K, V, generator=g) * 2
    labels = DRAFT_IDS[torch.randint(0, DRAFT_IDS.numel(), (3, K), generator=g)]
    valid = torch.ones(3, K, dtype=torch.bool)
    conf = torch.randn(3, K, generator=g)
    a = block_loss(sub, target, labels, valid, conf, 0.1, 0.9, 1.0, 4.0, draft_ids=DRAFT_IDS)
    b = block_loss(full, target, labels, valid, conf, 0.1, 0.9, 1.0, 4.0)
    for name in ("total", "ce", "l1", "conf", "accept_est", "top1_match"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), msg=name)


def test_labels_outside_the_draft_vocabulary_drop_out_of_cross_entropy_only():
    g = torch.Generator().manual_seed(1)
    sub = torch.randn(1, 2, DRAFT_IDS.numel(), generator=g)
    target = torch.randn(1, 2, 64, generator=g)
    valid = torch.ones(1, 2, dtype=torch.bool)
    inside = block_loss(sub, target, torch.tensor([[7, 9]]), valid, None, 1.0, 0.0, 0.0, 4.0, draft_ids=DRAFT_IDS)
    mixed = block_loss(sub, target, torch.tensor([[7, 8]]), valid, None, 1.0, 0.0, 0.0, 4.0, draft_ids=DRAFT_IDS)
    only_first = block_loss(sub[:, :1], target[:, :1], torch.tensor([[7]]), valid[:, :1], None, 1.0, 0.0, 0.0, 4.0,
                            draft_ids=DRAFT_IDS)
    assert float(inside.ce) != pytest.approx(float(mixed.ce))
    torch.testing.assert_close(mixed.ce, only_first.ce)  # token 8 is not a draft id: no CE term


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_proposals_are_target_ids_with_probabilities_zero_outside_the_draft_vocabulary(algo, rule):
    """Drafts are draft-vocabulary tokens as target ids; for rejection sampling their distributions
    are over the target's vocabulary, zero outside the draft ids (the coupled rule reads none)."""
    target = make_tiny_target()
    engine = SpecEngine(target, _drafter(target, algo), EngineConfig(mode="spec", adaptive_drafting=False,
                                                                     sampling_rule=rule))
    seen = []
    inner = engine.draft_runner.propose

    def spy(*a, **k):
        p = inner(*a, **k)
        seen.append(p)
        return p
    engine.draft_runner.propose = spy
    run_to_completion(engine, [("a", [7, 8, 9], SamplingParams(max_tokens=12, temperature=1.0, seed=1)),
                               ("b", [10, 11], SamplingParams(max_tokens=12))])
    assert seen
    outside = torch.ones(64, dtype=torch.bool)
    outside[DRAFT_IDS] = False
    for p in seen:
        assert bool(torch.isin(p.tokens, DRAFT_IDS).all())
        if rule == "coupled":
            assert p.probs is None
            continue
        assert p.probs.shape[-1] == 64 and float(p.probs[..., outside].abs().max()) == 0.0
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(p.probs.shape[:-1]))


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_greedy_output_with_a_draft_vocabulary_equals_target_only(algo):
    """The target's greedy choices include ids outside the draft vocabulary (never drafted)."""
    target = make_tiny_target()
    jobs = [(f"r{i}", [7 + i, 8, 9 + 2 * i], SamplingParams(max_tokens=16)) for i in range(5)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only")), jobs)
    spec_engine = SpecEngine(target, _drafter(target, algo), EngineConfig(mode="spec", max_batch=3,
                                                                            adaptive_drafting=False))
    spec = run_to_completion(spec_engine, jobs)
    assert spec == base
    emitted = torch.tensor([t for out in base.values() for t in out])
    assert not bool(torch.isin(emitted, DRAFT_IDS).all()), "the check needs target tokens outside the draft ids"
    if algo != "eagle3":  # the untrained Eagle3 here never guesses the target's argmax
        assert spec_engine.stats["accepted_tokens"] > 0


def test_sampled_output_with_a_draft_vocabulary_follows_the_target_distribution():
    """The 2nd and 3rd sampled tokens of one prompt (the 1st comes from prefill; later ones
    from drafting rounds), 4,000 times, against the target's exact joint distribution
    (chi-square, pooled sparse cells): drafts never cover most of the vocabulary, so the
    recovered tokens must supply exactly the mass the drafter cannot."""
    target = make_tiny_target()
    drafter = _drafter(target, "dspark")
    prompt = [7, 8, 9]
    V = 64
    with torch.no_grad():
        p0 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        seq1 = torch.tensor([prompt + [a] for a in range(V)])
        p1 = torch.softmax(target.model(seq1).logits[:, -1].double(), -1)  # [V(y0), V(y1)]
        seq2 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p2 = torch.softmax(target.model(seq2).logits[:, -1].double(), -1).view(V, V, V)
    joint = (p0[:, None, None] * p1[:, :, None] * p2).sum(0).reshape(-1)  # P(y1, y2)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", max_batch=64, adaptive_drafting=False, seed=5))
    n = 4000
    outs = run_to_completion(engine, [(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=i))
                                      for i in range(n)])
    cells = torch.tensor([outs[f"s{i}"][1] * V + outs[f"s{i}"][2] for i in range(n)])
    assert pooled_chisquare_pvalue(torch.bincount(cells, minlength=V * V), joint) > 1e-3
    assert engine.stats["accepted_tokens"] > 0 and engine.stats["accepted_tokens"] < engine.stats["draft_tokens"]


def test_checkpoint_round_trip_keeps_the_draft_ids_and_refuses_corrupt_ones(tmp_path):
    target = make_tiny_target()
    d = _drafter(target)
    save_checkpoint(tmp_path / "ck", d, d.cfg, target.identity(), step=1)
    loaded, cfg, _ = load_checkpoint(tmp_path / "ck", target)
    assert cfg.draft_vocab_size == 16 and loaded.draft_ids.tolist() == DRAFT_IDS.tolist()
    torch.testing.assert_close(loaded.draft_head.weight, target.lm_head.weight[DRAFT_IDS])
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "ck" / "model.safetensors"))
    state["draft_ids"] = state["draft_ids"].flip(0).contiguous()
    save_file(state, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="draft_ids"):
        load_checkpoint(tmp_path / "ck", target)


def test_builder_exports_a_draft_vocabulary_in_the_reference_layout_with_d2t(tmp_path):
    """A draft vocabulary is expressed in the DSpark layout (d2t, draft-sized lm_head); what the
    layout cannot express (draft layers without q/k norms) is skipped by default, refused when asked."""
    import dataclasses

    target = make_tiny_target()
    d = _drafter(target)
    save_checkpoint(tmp_path / "ck", d, d.cfg, target.identity(), step=1)
    m = builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng", target=target, max_batch=2)
    assert m["built"]["hf"]["draft_vocab_size"] == 16 and m["built"]["trtllm"]["file"]
    assert m["built"]["onnx"]["file"] and m["shapes"]["draft_vocab_size"] == 16
    legacy = build_drafter(dataclasses.replace(d.cfg, layer_style="target"), target)  # Llama target: no q/k norm
    save_checkpoint(tmp_path / "old", legacy, legacy.cfg, target.identity(), step=1)
    m = builder.build_engine(drafter_dir=tmp_path / "old", output=tmp_path / "eng2", target=target, max_batch=2)
    assert m["built"]["hf"]["status"] == "skipped" and "q/k RMSNorm" in m["built"]["hf"]["reason"]
    with pytest.raises(builder.BuildError, match="q/k RMSNorm"):
        builder.build_engine(drafter_dir=tmp_path / "old", output=tmp_path / "eng3", target=target, max_batch=2,
                             what="onnx,hf")
    assert not (tmp_path / "eng3").exists()


def test_scatter_puts_each_probability_at_its_target_id():
    p = torch.tensor([[0.25, 0.75]])
    out = scatter_to_vocab(p, torch.tensor([3, 5]), 8)
    assert out.tolist() == [[0, 0, 0, 0.25, 0, 0.75, 0, 0]]


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_an_all_greedy_batch_carries_no_draft_distributions_and_a_mixed_one_does(algo):
    """Only rejection sampling reads draft distributions: greedy rows need none, and a batch with a
    rejection-sampled row carries them for every row."""
    target = make_tiny_target()
    engine = SpecEngine(target, _drafter(target, algo), EngineConfig(mode="spec", adaptive_drafting=False,
                                                                     sampling_rule="rejection"))
    seen = []
    inner = engine.draft_runner.propose
    engine.draft_runner.propose = lambda *a, **k: seen.append(inner(*a, **k)) or seen[-1]
    run_to_completion(engine, [("g", [7, 8, 9], SamplingParams(max_tokens=8))])
    assert seen and all(p.probs is None for p in seen)
    seen.clear()
    run_to_completion(engine, [("g", [7, 8, 9], SamplingParams(max_tokens=8)),
                               ("s", [7, 8], SamplingParams(max_tokens=8, temperature=1.0, seed=0))])
    assert any(p.probs is not None and p.probs.shape[0] == 2 for p in seen)
