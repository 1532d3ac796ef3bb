"""vLLM's own draft model classes load the kit's exports and compute what the kit's drafter does
(engine/export/vllm_check.py): one block's draft logits, Markov bias and confidences, and the
greedy drafts, for DSpark with and without a draft vocabulary, DFlash and Eagle3.

Run with vLLM installed: ``.venv-vllm/bin/python -m pytest tests/vllm -m vllm``. Without vLLM
every test here is skipped, with the reason."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.export import vllm_check
from dspark.engine.export.parity import move_off_initial_values
from dspark.engine.export.eagle3_export import export_eagle3
from dspark.engine.export.hf_export import export_hf
from dspark.training.models import build_drafter, drafter_config_for
from tests.conftest import make_tiny_target, tiny_run_config

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_check.vllm_missing_reason() is not None,
                                 reason=str(vllm_check.vllm_missing_reason()))]

DRAFT_IDS = torch.tensor([2, 3, 5, 7, 9, 11, 13, 17, 20, 23, 29, 31, 37, 40, 47, 53])
TOL = 1e-5  # fp32


def _drafter(target, algo, draft_vocab, style=None):
    cfg = tiny_run_config(algo)
    cfg.target.draft_vocab = int(DRAFT_IDS.numel()) if draft_vocab else 0
    if style:
        cfg.algo.layer_style = style
    torch.manual_seed(0)
    d = build_drafter(drafter_config_for(cfg, target), target).eval()
    if draft_vocab:
        d.set_draft_vocab(DRAFT_IDS)
    move_off_initial_values(d, head_std=0.5)
    return d


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    target = make_tiny_target()
    root = tmp_path_factory.mktemp("target")
    target.model.config.save_pretrained(root)  # vLLM's ModelConfig reads the target's config only
    return target, root


def _check(result, reference, has_conf):
    diff = vllm_check.compare(result, reference)
    assert diff["logits_max_abs_diff"] <= TOL, diff
    assert diff["markov_bias_max_abs_diff"] is None or diff["markov_bias_max_abs_diff"] <= TOL, diff
    if has_conf:
        assert diff["confidence_max_abs_diff"] <= TOL, diff
    assert diff["drafts_identical"], (result.drafts, reference.drafts)


@pytest.mark.parametrize("algo,draft_vocab", [("dspark", True), ("dspark", False), ("dflash", True)])
def test_vllm_qwen3_dspark_matches_the_kit_on_one_block(tmp_path, target_dir, algo, draft_vocab):
    target, tdir = target_dir
    d = _drafter(target, algo, draft_vocab)
    export_hf(d, target, tmp_path / "hf")
    v = vllm_check.load_vllm_draft(tmp_path / "hf", tdir, "dspark", d.cfg.block_size)
    assert v.architecture.startswith("vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM")
    torch.manual_seed(1)
    aux, anchor = torch.randn(2, 9, 3 * 32), torch.tensor([7, 40])
    _check(vllm_check.vllm_dspark_block(v, aux, anchor, d.cfg.block_size, d.cfg.mask_token_id),
           vllm_check.kit_dspark_block(d, aux, anchor), has_conf=d.confidence is not None)


@pytest.mark.parametrize("style,draft_vocab", [("llama", True), ("qwen3", False)])
def test_vllm_eagle3_matches_the_kit_over_a_draft_chain(tmp_path, target_dir, style, draft_vocab):
    target, tdir = target_dir
    d = _drafter(target, "eagle3", draft_vocab, style)
    export_eagle3(d, target, tmp_path / "e3")
    v = vllm_check.load_vllm_draft(tmp_path / "e3", tdir, "eagle3", d.cfg.block_size)
    assert ("llama_eagle3" if style == "llama" else "qwen3_eagle3") in v.architecture
    torch.manual_seed(1)
    aux, tokens = torch.randn(2, 9, 3 * 32), torch.randint(6, 64, (2, 10))
    _check(vllm_check.vllm_eagle3_chain(v, aux, tokens, d.cfg.block_size), vllm_check.kit_eagle3_chain(d, aux, tokens),
           has_conf=False)


def test_a_changed_weight_is_seen_by_the_comparison(tmp_path, target_dir):
    """The check can fail: an export edited after the fact no longer matches the kit's drafter."""
    from safetensors.torch import load_file, save_file

    target, tdir = target_dir
    d = _drafter(target, "dspark", True)
    export_hf(d, target, tmp_path / "hf")
    st = load_file(str(tmp_path / "hf" / "model.safetensors"))
    st["markov_head.markov_w2.weight"][3] += 10.0
    save_file(st, str(tmp_path / "hf" / "model.safetensors"))
    v = vllm_check.load_vllm_draft(tmp_path / "hf", tdir, "dspark", d.cfg.block_size)
    aux, anchor = torch.randn(2, 9, 3 * 32), torch.tensor([7, 40])
    diff = vllm_check.compare(vllm_check.vllm_dspark_block(v, aux, anchor, d.cfg.block_size, d.cfg.mask_token_id),
                              vllm_check.kit_dspark_block(d, aux, anchor))
    assert diff["markov_bias_max_abs_diff"] > 100 * TOL


@pytest.mark.parametrize("gemm", vllm_check.GEMM_DISPATCH)
def test_the_bisect_compares_every_stage_and_sees_a_changed_norm_there(tmp_path, target_dir, gemm):
    """bisect_dspark_block: on a faithful export every stage agrees within fp32 rounding under either
    branch of vLLM's GEMM dispatch; a k_norm weight edited in the export shows up at the context K
    stage and after (the stage table points at the op that differs)."""
    from safetensors.torch import load_file, save_file

    target, tdir = target_dir
    d = _drafter(target, "dspark", True)
    export_hf(d, target, tmp_path / "hf")
    torch.manual_seed(1)
    aux, anchor = torch.randn(2, 9, 3 * 32), torch.tensor([7, 40])
    rows = vllm_check.bisect_dspark_block(vllm_check.load_vllm_draft(tmp_path / "hf", tdir, "dspark", d.cfg.block_size,
                                                                     gemm=gemm), d, aux, anchor)
    stages = [r["stage"] for r in rows]
    assert stages[0].startswith("fc") and stages[-1].startswith("draft logits") and len(stages) == 17, stages
    assert all(r["max_abs_diff"] <= TOL and (r["local_diff"] is None or r["local_diff"] <= TOL) for r in rows), rows
    st = load_file(str(tmp_path / "hf" / "model.safetensors"))
    name = next(k for k in st if k.endswith("k_norm.weight"))
    st[name] = st[name] * 1.5
    save_file(st, str(tmp_path / "hf" / "model.safetensors"))
    bad = vllm_check.bisect_dspark_block(vllm_check.load_vllm_draft(tmp_path / "hf", tdir, "dspark", d.cfg.block_size,
                                                                    gemm=gemm), d, aux, anchor)
    by = {r["stage"]: r["max_abs_diff"] for r in bad}
    assert by["fc (context)"] <= TOL and by["layer 0: v_proj"] <= TOL
    assert by["layer 0: context K (k_proj, k_norm, RoPE)"] > 100 * TOL and by["layer 0: k after k_norm + RoPE"] > 100 * TOL
