"""ONNX Runtime (CPU, DSparkSchedule as a custom op) computes the same drafter step as PyTorch."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.export.onnx_export import DraftStep, export_onnx, ort_session, parity_case
from dspark.training.models import build_drafter, drafter_config_for
from tests.conftest import make_tiny_target, tiny_drafter

pytest.importorskip("onnxruntime_extensions")


def _exported_drafter(model_type: str, seed: int, path, sampled: bool = False):
    """A tiny drafter with non-zero heads, exported to ``path``; -> (target, drafter, ORT session, SPS table)."""
    target = make_tiny_target(model_type)
    d = tiny_drafter(target, seed=seed)
    K = d.cfg.block_size
    table = [0.0] + [100.0 / (1 + 0.2 * b) for b in range(1, 16 * (K + 1) + 1)]
    export_onnx(d, path, sps_table=table, sampled=sampled)
    return target, d, ort_session(path), table


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def exported(request, tmp_path_factory):
    return _exported_drafter(request.param, 3, tmp_path_factory.mktemp("onnx") / "d.onnx")


@pytest.mark.parametrize("R,T", [(1, 1), (3, 9), (16, 40)])
def test_ort_matches_torch_on_dynamic_batch_and_context(exported, R, T):
    target, d, session, table = exported
    g = torch.Generator().manual_seed(R * 100 + T)
    aux = torch.randn(R, T, d.cfg.num_aux_layers * d.cfg.hidden_size, generator=g)
    lens = torch.randint(1, T + 1, (R,), generator=g)
    anchor = torch.randint(0, d.cfg.vocab_size, (R,), generator=g)
    case = parity_case(DraftStep(d).eval(), session, aux, lens, anchor, lens, table, repeats=1)
    assert case.max_abs_logit_diff < 1e-4
    assert case.greedy_draft_match == 1.0, "greedy drafts must be identical"
    assert case.conf_max_abs_diff < 1e-5
    assert case.verify_lens_match == 1.0, "the custom op runs the reference scheduler"


def test_exported_step_equals_the_engine_propose_path(exported):
    """The wrapper is the drafter's own inference path, not a re-implementation that drifts."""
    target, d, _, _ = exported
    R, T = 5, 12
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(R, T, d.cfg.num_aux_layers * d.cfg.hidden_size, generator=g)
    lens = torch.randint(1, T + 1, (R,), generator=g)
    anchor = torch.randint(0, d.cfg.vocab_size, (R,), generator=g)
    with torch.no_grad():
        pos = torch.arange(T).expand(R, T)
        kv = d.context_kv(d.context(aux), pos)
        prop = d.propose(anchor, lens, kv, pos < lens[:, None], torch.zeros(R))
        out = DraftStep(d)(aux, lens, anchor, lens)
    assert torch.equal(prop.tokens, out[0])
    assert prop.probs is None  # a greedy batch carries no draft distributions
    assert torch.equal(prop.tokens, d.to_target(out[1].argmax(-1)))  # the drafts are the exported logits' argmax
    assert torch.allclose(prop.conf_logits, out[2])


@pytest.mark.slow
def test_ort_matches_torch_on_the_real_target(smollm2, tmp_path):
    torch.manual_seed(0)
    from dspark.training.config import load_run_config

    d = build_drafter(drafter_config_for(load_run_config("quickstart"), smollm2), smollm2).eval()
    with torch.no_grad():
        d.markov.w2.weight.normal_(0, 0.02)
        d.confidence.proj.weight.normal_(0, 0.05)
    table = [0.0] + [1000.0 / (20 + 0.05 * b) for b in range(1, 4 * 8 + 1)]
    export_onnx(d, tmp_path / "d.onnx", sps_table=table)
    ids = torch.randint(0, smollm2.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    aux = smollm2.features(ids[:, :32]).aux
    lens = torch.tensor([32, 20])
    case = parity_case(DraftStep(d).eval(), ort_session(tmp_path / "d.onnx"), aux, lens,
                       ids.gather(1, lens[:, None]).squeeze(-1), lens, table, repeats=1)
    assert case.max_abs_logit_diff < 1e-3 and case.greedy_draft_match == 1.0


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def exported_sampled(request, tmp_path_factory):
    return _exported_drafter(request.param, 4, tmp_path_factory.mktemp("onnx") / "d_sampled.onnx", sampled=True)


def test_sampled_drafts_are_identical_in_ort_torch_and_the_engine_given_the_same_noise(exported_sampled):
    """The sampled graph races the drafter's distributions against fed noise: with the noise the
    engine's RaceNoise computes, ORT, the eager step and ``propose`` draw the same drafts."""
    from dspark.plugins.coupled import RaceNoise, race_noise
    from dspark.training.models.block_drafter import noise_ids

    _, d, session, table = exported_sampled
    R, T, K = 6, 10, d.cfg.block_size
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(R, T, d.cfg.num_aux_layers * d.cfg.hidden_size, generator=g)
    lens = torch.randint(1, T + 1, (R,), generator=g)
    anchor = torch.randint(0, d.cfg.vocab_size, (R,), generator=g)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.0])  # greedy rows mixed in
    key = torch.arange(R) * 7919 + 11
    noise = torch.stack([race_noise(key, lens + k, d.draft_vocab_size, noise_ids(d)) for k in range(K)], dim=1)
    step = DraftStep(d, sampled=True).eval()
    case = parity_case(step, session, aux, lens, anchor, lens, table, repeats=1, temperature=temperature, noise=noise)
    assert case.greedy_draft_match == 1.0, "ORT and PyTorch must draw the same drafts from the same noise"
    assert case.max_abs_logit_diff < 1e-4 and case.conf_max_abs_diff < 1e-5
    assert case.verify_lens_match == 1.0
    with torch.no_grad():
        out = step(aux, lens, anchor, lens, temperature, noise)
        pos = torch.arange(T).expand(R, T)
        kv = d.context_kv(d.context(aux), pos)
        prop = d.propose(anchor, lens, kv, pos < lens[:, None], temperature, RaceNoise(key, lens))
    assert torch.equal(prop.tokens, out[0]), "the exported sampler is the engine's"
    greedy = d.to_target(out[1].argmax(-1))
    assert torch.equal(out[0][temperature == 0], greedy[temperature == 0])
    assert not torch.equal(out[0][temperature > 0], greedy[temperature > 0]), "sampled rows must not be the argmax"
