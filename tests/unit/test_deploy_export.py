"""Exports engines load (issue 23): the layer style, the DSpark layout with and without a draft
vocabulary, DFlash, the EAGLE-3 layout, refusals that write nothing, and the TensorRT-LLM
option spelling per version. vLLM's own loader is checked in tests/vllm/."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dspark.engine.export import builder
from dspark.engine.export.parity import move_off_initial_values
from dspark.engine.export.deepspec_import import DeepSpecImportError, import_deepspec
from dspark.engine.export.eagle3_export import export_eagle3, import_eagle3
from dspark.engine.export.hf_export import export_hf
from dspark.engine.export.layout import ExportError
from dspark.engine.export.trtllm_options import KEY_SPELLINGS, TrtllmVersionError, resolve_version, write_trtllm_options
from dspark.training.checkpoint import load_checkpoint, save_checkpoint
from dspark.training.config import ConfigError, load_run_config
from dspark.training.models import build_drafter, drafter_config_for
from tests.conftest import make_tiny_target, tiny_run_config

DRAFT_IDS = torch.tensor([2, 3, 5, 7, 9, 11, 13, 17, 20, 23, 29, 31, 37, 40, 47, 53])


def _drafter(target, algo="dspark", draft_vocab=False, style=None, seed=0):
    cfg = tiny_run_config(algo)
    if draft_vocab:
        cfg.target.draft_vocab = int(DRAFT_IDS.numel())
    if style is not None:
        cfg.algo.layer_style = style
    torch.manual_seed(seed)
    d = build_drafter(drafter_config_for(cfg, target), target).eval()
    if draft_vocab:
        d.set_draft_vocab(DRAFT_IDS)
    move_off_initial_values(d, head_std=0.5)
    return d


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_new_drafters_default_to_qwen3_layers_and_eagle3_to_the_llama_midlayer():
    for algo, style in (("dspark", "qwen3"), ("dflash", "qwen3"), ("eagle3", "llama")):
        assert load_run_config(None, [f"algo={algo}"]).algo.layer_style in (None, style)
        assert drafter_config_for(tiny_run_config(algo), make_tiny_target()).layer_style == style
    with pytest.raises(ConfigError, match="layer_style"):
        load_run_config(None, ["algo.layer_style=gpt2"])


def test_a_llama_target_drafter_has_per_head_qk_norms_and_exports_as_qwen3_dspark(tmp_path):
    target = make_tiny_target()  # Llama family
    d = _drafter(target)
    assert "layers.0.q_norm.weight" in d.state_dict() and "layers.0.k_norm.weight" in d.state_dict()
    export_hf(d, target, tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["model_type"] == "qwen3"
    assert "layers.0.self_attn.q_norm.weight" in load_file(str(tmp_path / "hf" / "model.safetensors"))


def test_a_checkpoint_without_layer_style_loads_as_the_old_style(tmp_path):
    target = make_tiny_target()
    old = build_drafter(dataclasses.replace(_drafter(target).cfg, layer_style="target"), target)
    save_checkpoint(tmp_path / "ck", old, old.cfg, target.identity(), step=1)
    meta = json.loads((tmp_path / "ck" / "drafter.json").read_text())
    del meta["drafter"]["layer_style"]  # as written before the field existed
    (tmp_path / "ck" / "drafter.json").write_text(json.dumps(meta))
    back, cfg, _ = load_checkpoint(tmp_path / "ck", target)
    assert cfg.layer_style == "target" and "layers.0.q_norm.weight" not in back.state_dict()
    _same_state(old, back)
    with pytest.raises(ExportError, match="q/k RMSNorm"):
        export_hf(back, target, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


@pytest.mark.parametrize("algo,draft_vocab", [("dspark", True), ("dspark", False), ("dflash", True),
                                              ("dflash", False)])
def test_dspark_layout_round_trip_is_bit_exact(tmp_path, algo, draft_vocab):
    target = make_tiny_target()
    d = _drafter(target, algo, draft_vocab)
    export_hf(d, target, tmp_path / "hf")
    back, cfg, info = import_deepspec(tmp_path / "hf", target)
    assert cfg == d.cfg
    _same_state(d, back)
    assert info["lm_head_max_abs_diff_vs_target"] == 0.0


def test_draft_vocabulary_tensors_are_what_the_loaders_read(tmp_path):
    """d2t: target id = i + d2t[i]; lm_head and markov_w2 draft-sized; markov_w1 over the full
    vocabulary with row t = the kit's row for t (outside ids share the out-of-vocabulary row)."""
    target = make_tiny_target()
    d = _drafter(target, "dspark", draft_vocab=True)
    export_hf(d, target, tmp_path)
    st = load_file(str(tmp_path / "model.safetensors"))
    conf = json.loads((tmp_path / "config.json").read_text())
    n, V = DRAFT_IDS.numel(), target.vocab_size
    assert conf["draft_vocab_size"] == n and conf["vocab_size"] == V
    assert torch.equal(torch.arange(n) + st["d2t"], DRAFT_IDS) and st["d2t"].dtype == torch.int64
    assert st["t2d"].dtype == torch.bool and st["t2d"].nonzero().flatten().tolist() == DRAFT_IDS.tolist()
    assert st["lm_head.weight"].shape == (n, target.hidden_size)
    assert torch.equal(st["lm_head.weight"], target.lm_head.weight[DRAFT_IDS])
    w1, w2 = st["markov_head.markov_w1.weight"], st["markov_head.markov_w2.weight"]
    assert w1.shape == (V, 8) and w2.shape == (n, 8)
    prev = torch.tensor([3, 4, 53, 63])  # in, out, in, out of the draft vocabulary
    assert torch.equal(w1[prev] @ w2.T, d.markov.bias(d.markov.w1(d.to_draft(prev))))


def test_import_refuses_a_reduced_vocabulary_without_d2t_and_unequal_outside_rows(tmp_path):
    from safetensors.torch import save_file

    target = make_tiny_target()
    export_hf(_drafter(target, "dspark", draft_vocab=True), target, tmp_path)
    st = load_file(str(tmp_path / "model.safetensors"))
    st["markov_head.markov_w1.weight"][4] += 1.0  # id 4 is outside the draft vocabulary
    save_file(st, str(tmp_path / "model.safetensors"))
    with pytest.raises(DeepSpecImportError, match="outside the draft vocabulary differ"):
        import_deepspec(tmp_path, target)
    del st["d2t"]
    save_file(st, str(tmp_path / "model.safetensors"))
    with pytest.raises(DeepSpecImportError, match="no d2t"):
        import_deepspec(tmp_path, target)


@pytest.mark.parametrize("style", ["llama", "qwen3"])
@pytest.mark.parametrize("draft_vocab", [True, False])
def test_eagle3_layout_round_trip_is_bit_exact(tmp_path, style, draft_vocab):
    target = make_tiny_target()
    d = _drafter(target, "eagle3", draft_vocab, style=style)
    export_eagle3(d, target, tmp_path / "e3")
    conf = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert conf["architectures"] == [{"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}[style]]
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # kit layer outputs = next layers' inputs
    names = set(load_file(str(tmp_path / "e3" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.input_layernorm.weight", "lm_head.weight"} <= names
    assert ("d2t" in names) == draft_vocab and ("midlayer.self_attn.q_norm.weight" in names) == (style == "qwen3")
    back, cfg, _ = import_eagle3(tmp_path / "e3", target)
    assert cfg == d.cfg
    _same_state(d, back)


def test_legacy_eagle3_export_is_refused_with_the_reason_and_nothing_written(tmp_path):
    target = make_tiny_target()
    d = _drafter(target, "eagle3", style="target")
    assert hasattr(d, "combine")
    with pytest.raises(ExportError, match="no counterpart in the EAGLE-3 layout"):
        export_eagle3(d, target, tmp_path / "e3")
    assert not (tmp_path / "e3").exists()


def test_builder_exports_eagle3_and_records_why_the_block_targets_are_skipped(tmp_path):
    target = make_tiny_target()
    d = _drafter(target, "eagle3", draft_vocab=True)
    save_checkpoint(tmp_path / "ck", d, d.cfg, target.identity(), step=1)
    m = builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng", target=target, max_batch=2)
    assert m["built"]["hf"]["layout"] == "eagle3"
    assert m["built"]["onnx"]["status"] == "skipped" and m["built"]["trtllm"]["status"] == "skipped"
    with pytest.raises(builder.BuildError, match="eagle3"):
        builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng2", target=target, what="onnx")


def test_the_quickstart_recipe_drafter_exports_with_no_flag(tmp_path):
    target = make_tiny_target()
    cfg = load_run_config("quickstart")
    cfg.target = dataclasses.replace(tiny_run_config().target, layer_style=cfg.target.layer_style,
                                     draft_vocab=16)
    d = build_drafter(drafter_config_for(cfg, target), target)
    save_checkpoint(tmp_path / "ck", d, d.cfg, target.identity(), step=1)
    m = builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng", target=target, max_batch=2)
    assert m["built"]["hf"]["architectures"] == ["Qwen3DSparkModel"] and m["built"]["hf"]["draft_vocab_size"] == 16


@pytest.mark.parametrize("version", ["main", "1.4"])
def test_trtllm_options_use_the_spelling_of_the_chosen_version(tmp_path, version):
    info = write_trtllm_options(tmp_path, hf_dir="hf", block_size=7, max_batch=8, max_context=512, dtype="float32",
                                sts_file="sts.json", sps_file="trtllm/sps_cost_table.json", has_confidence=True,
                                version=version)
    spec = yaml.safe_load((tmp_path / "llm_api_options.yaml").read_text())["speculative_config"]
    keys = KEY_SPELLINGS[version]
    assert spec[keys["sts"]] == "sts.json" and spec[keys["sps"]] == "trtllm/sps_cost_table.json"
    other = KEY_SPELLINGS["1.4" if version == "main" else "main"]
    assert other["sts"] not in spec and other["sps"] not in spec
    assert spec["decoding_type"] == "DSpark" and spec["enable_confidence_scheduling"] is True
    assert info["trtllm_version"] == version and info["key_spelling"] == keys


def test_trtllm_version_is_resolved_recorded_and_an_unknown_one_refused(tmp_path):
    assert resolve_version(None) == "main" and resolve_version("1.4.2") == "1.4"
    with pytest.raises(TrtllmVersionError, match="knows"):
        resolve_version("0.9")
    target = make_tiny_target()
    d = _drafter(target)
    save_checkpoint(tmp_path / "ck", d, d.cfg, target.identity(), step=1)
    m = builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng", target=target, max_batch=2,
                             what="hf,trtllm", trtllm_version="1.4")
    assert m["built"]["trtllm"]["trtllm_version"] == "1.4"
    spec = yaml.safe_load((tmp_path / "eng" / "trtllm" / "llm_api_options.yaml").read_text())["speculative_config"]
    assert spec["speculative_model"] == "hf"
    with pytest.raises(builder.BuildError, match="trtllm-version"):
        builder.build_engine(drafter_dir=tmp_path / "ck", output=tmp_path / "eng2", target=target,
                             trtllm_version="2.0")


def test_dflash_is_written_with_an_all_zero_markov_head_of_rank_one(tmp_path):
    """vLLM's DSpark model always builds a Markov head (rank 0 crashes its CPU GEMM set-up), so
    DFlash goes out as a zero head: bias exactly 0; the kit record brings it back as DFlash."""
    target = make_tiny_target()
    export_hf(_drafter(target, "dflash", draft_vocab=True), target, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    st = load_file(str(tmp_path / "model.safetensors"))
    assert conf["markov_rank"] == 1 and conf["enable_confidence_head"] is False
    assert st["markov_head.markov_w1.weight"].shape == (target.vocab_size, 1)
    assert st["markov_head.markov_w2.weight"].shape == (16, 1)
    assert not st["markov_head.markov_w1.weight"].any() and not st["markov_head.markov_w2.weight"].any()
