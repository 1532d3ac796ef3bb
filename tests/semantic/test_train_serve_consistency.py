"""The engine drafts what training taught: the same target features, positions and masks.

Losslessness cannot catch a drafter that sees the wrong context at serving time (verification
rejects its drafts, output stays right, only acceptance drops), so this pins it directly: for
every block the engine proposes (sampled at T=1 and verified by rejection sampling, so it
carries its distributions; drafts judged by the coupled rule carry none), the training
forward on the committed sequence, teacher-forced with the engine's own drafts, must give the
same distributions.
"""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.training.draft_vocab import scatter_to_vocab

from ..conftest import make_tiny_target, run_to_completion, tiny_drafter


def _jobs() -> list[tuple[str, list[int], SamplingParams]]:
    """Three requests of different prompt lengths, sampled at T=1 (with rejection sampling, proposals
    carry distributions)."""
    return [(f"r{i}", list(range(6 + i, 6 + i + n)), SamplingParams(max_tokens=14, temperature=1.0, seed=i))
            for i, n in enumerate((5, 19, 11))]


def _record_proposals(engine) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Wrap the engine's drafter: each proposal as (committed tokens, anchor last; drafts; probs)."""
    seen: list[tuple[list[int], list[int], torch.Tensor]] = []
    propose = engine.draft_runner.propose

    def recording_propose(slots, anchors, *args, **kwargs):
        prop = propose(slots, anchors, *args, **kwargs)
        by_slot = {r.slot: r for r in engine._active}
        for i, s in enumerate(slots):
            r = by_slot[s]
            assert r.anchor == int(anchors[i]) == r.generated[-1]
            seen.append((r.prompt + r.generated, prop.tokens[i].tolist(), prop.probs[i].float()))
        return prop
    engine.draft_runner.propose = recording_propose
    return seen


def _served_proposals(algo: str, draft_vocab: bool):
    """A tiny target and drafter (over every third id with ``draft_vocab``), run in the engine
    -> (target, drafter, draft ids or None, recorded proposals)."""
    target = make_tiny_target()
    ids = torch.arange(0, target.vocab_size, 3) if draft_vocab else None  # includes the prompts' ids
    drafter = tiny_drafter(target, algo, ids)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=3, prefill_chunk=8,
                                                      sampling_rule="rejection"))
    seen = _record_proposals(engine)
    run_to_completion(engine, _jobs())
    assert len(seen) > 6
    return target, drafter, ids, seen


@pytest.mark.parametrize("algo, draft_vocab", [("dspark", False), ("dspark", True), ("dflash", False)])
def test_engine_proposals_match_the_training_forward(algo, draft_vocab):
    target, drafter, ids, seen = _served_proposals(algo, draft_vocab)
    K = drafter.cfg.block_size
    with torch.no_grad():
        for committed, drafts, probs in seen:
            a = len(committed) - 1  # the anchor's position: its own features are not computed yet
            seq = torch.tensor([committed + drafts])
            aux = target.features(seq).aux.float()
            out = drafter.forward_train(aux, seq, torch.tensor([[a]]))
            trained = torch.softmax(out.logits[0, 0].float(), -1)  # [K, draft vocab]: k predicts seq[a + 1 + k]
            if ids is not None:
                trained = scatter_to_vocab(trained, ids, target.vocab_size)
            torch.testing.assert_close(trained, probs[:K], atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"anchor at {a}: {m}")


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_eagle3_proposals_match_its_training_time_test_unroll(draft_vocab):
    """The Eagle3 baseline: step k of the training unroll at the position before the anchor
    (entry (f_{a-1}, x_a)) gives the engine's k-th draft distribution, teacher-forced with
    the engine's own drafts."""
    from dspark.training.cpu_linear import project

    target, drafter, ids, seen = _served_proposals("eagle3", draft_vocab)
    K = drafter.cfg.block_size
    with torch.no_grad():
        for committed, drafts, probs in seen:
            a = len(committed) - 1
            seq = torch.tensor([committed + drafts])
            hidden = drafter.forward_train(target.features(seq).aux.float(), seq, steps=K)  # [K, 1, T, d]
            trained = torch.softmax(project(drafter.draft_head, hidden[:, 0, a - 1]).float(), -1)  # [K, draft vocab]
            if ids is not None:
                trained = scatter_to_vocab(trained, ids, target.vocab_size)
            torch.testing.assert_close(trained, probs[:K], atol=1e-5, rtol=1e-4, msg=lambda m: f"anchor at {a}: {m}")
