"""Converter: ONNX graph carries the plugin node per the contract, manifest validation,
reference-layout round trip, and a clear failure for --what trt without TensorRT."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dspark.engine.export import builder, manifest as mf, weights
from dspark.engine.export.deepspec_import import DeepSpecImportError, import_deepspec
from dspark.engine.export.hf_export import export_hf, to_deepspec_state
from dspark.engine.export.trt_build import TensorRTUnavailable, tensorrt_version
from dspark.plugins import contract
from dspark.training.checkpoint import save_checkpoint
from tests.conftest import make_tiny_target, tiny_drafter

onnx = pytest.importorskip("onnx")


def _drafter(target, algo="dspark", seed=0):
    d = tiny_drafter(target, algo, seed=seed)
    return d, d.cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = make_tiny_target()
    d, cfg = _drafter(target)
    root = tmp_path_factory.mktemp("engine")
    save_checkpoint(root / "ckpt", d, cfg, target.identity(), step=7)
    m = builder.build_engine(drafter_dir=root / "ckpt", output=root / "eng", target=target, max_batch=4,
                             what="onnx,hf,trtllm")
    return target, d, root, m


def test_engine_json_has_the_runtime_keys_and_a_manifest(built):
    _, _, root, m = built
    meta = json.loads((root / "eng" / "engine.json").read_text())
    assert meta["drafter_dir"] == "drafter" and meta["sps"] is None and meta["sts"] is None
    assert meta["target_profile"]["layer_ids"] == [0, 1, 2]
    assert meta["format"] == mf.MANIFEST_FORMAT and meta["manifest_version"] == mf.MANIFEST_VERSION
    assert set(meta["built"]) == {"onnx", "hf", "trtllm"}
    for rel in ("drafter/model.safetensors", "onnx/dspark_draft.onnx", "hf/model.safetensors",
                "trtllm/llm_api_options.yaml"):
        assert rel in meta["files"], rel


def test_onnx_graph_holds_the_schedule_plugin_node_as_the_contract_documents(built):
    _, d, root, _ = built
    model = onnx.load(str(root / "eng" / "onnx" / "dspark_draft.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_SCHEDULE]
    assert len(nodes) == 1, "exactly one DSparkSchedule node"
    node = nodes[0]
    spec = contract.schedule_node(d.cfg.block_size, [1.0, 1.0])
    assert node.domain == contract.ONNX_DOMAIN
    assert list(node.input) == spec["inputs"] and list(node.output) == spec["outputs"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_version"].decode() == contract.PLUGIN_VERSION
    assert attrs["plugin_namespace"].decode() == contract.PLUGIN_NAMESPACE
    assert attrs["block_size"] == d.cfg.block_size
    types = {a.name: a.type for a in node.attribute}
    assert types["block_size"] == onnx.AttributeProto.INT and types["sps_table"] == onnx.AttributeProto.FLOATS
    assert len(attrs["sps_table"]) == 4 * (d.cfg.block_size + 1) + 1  # max_batch * (K+1) tokens + entry 0
    assert any(o.domain == contract.ONNX_DOMAIN for o in model.opset_import)
    # dynamic batch and context on the inputs
    aux = next(i for i in model.graph.input if i.name == "aux")
    dims = aux.type.tensor_type.shape.dim
    assert dims[0].dim_param == "R" and dims[1].dim_param == "T"


def test_validation_accepts_the_fresh_engine(built):
    target, _, root, _ = built
    assert mf.validate_engine_dir(root / "eng", target)["drafter_dir"] == "drafter"


def _copy(root, name):
    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "eng", dst)
    return dst


def test_validation_refuses_a_truncated_file(built):
    target, _, root, _ = built
    eng = _copy(root, "trunc")
    w = eng / "drafter" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(mf.IntegrityError, match="truncated"):
        mf.validate_engine_dir(eng, target)


def test_validation_refuses_a_modified_file_of_the_same_size(built):
    target, _, root, _ = built
    eng = _copy(root, "edit")
    w = eng / "hf" / "config.json"
    text = w.read_text()
    w.write_text(text.replace('"block_size": 4', '"block_size": 5'))
    with pytest.raises(mf.IntegrityError, match="modified"):
        mf.validate_engine_dir(eng, target)


def test_validation_refuses_an_unknown_manifest_version(built):
    target, _, root, _ = built
    eng = _copy(root, "ver")
    meta = json.loads((eng / "engine.json").read_text())
    meta["manifest_version"] = 99
    (eng / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(mf.ManifestVersionError, match="manifest_version 99"):
        mf.validate_engine_dir(eng, target)


@pytest.mark.parametrize("key,value", [("hidden_size", 64), ("vocab_size", 128), ("layer_ids", [0, 1]),
                                       ("tokenizer_hash", "0000")])
def test_validation_refuses_a_drafter_built_for_another_target(built, key, value):
    target, _, root, _ = built
    other = dict(target.identity(), **{key: value})
    with pytest.raises(mf.TargetMismatchError, match=key):
        mf.validate_engine_dir(root / "eng", other, files=())


def test_errors_are_one_line(built):
    target, _, root, _ = built
    eng = _copy(root, "oneline")
    (eng / "onnx" / "dspark_draft.onnx").unlink()
    with pytest.raises(mf.EngineDirError) as info:
        mf.validate_engine_dir(eng, target)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("algo", ["dspark", "dflash"])
def test_reference_layout_round_trip_is_bit_exact(tmp_path, algo):
    target = make_tiny_target()
    d, _ = _drafter(target, algo)
    export_hf(d, target, tmp_path / "hf")
    back, cfg, info = import_deepspec(tmp_path / "hf", target)
    assert cfg == d.cfg
    a, b = d.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert info["embed_tokens_max_abs_diff_vs_target"] == 0.0


def test_reference_layout_uses_the_reference_names_and_keys(tmp_path):
    target = make_tiny_target()
    d, _ = _drafter(target)
    names = set(to_deepspec_state(d))
    for n in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.mlp.gate_proj.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
              "confidence_head.proj.weight", "confidence_head.proj.bias", "embed_tokens.weight", "lm_head.weight"):
        assert n in names, n
    export_hf(d, target, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["target_layer_ids"] == [0, 1, 2] and conf["block_size"] == 4 and conf["markov_rank"] == 8
    assert conf["markov_head_type"] == "vanilla" and conf["enable_confidence_head"] is True
    assert conf["confidence_head_with_markov"] is True and conf["tie_word_embeddings"] is False


def test_import_refuses_a_checkpoint_for_other_layer_ids(tmp_path):
    target = make_tiny_target()
    d, _ = _drafter(target)
    export_hf(d, target, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["target_layer_ids"] = [0, 1, 3]
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(DeepSpecImportError, match="target_layer_ids"):
        import_deepspec(tmp_path, target)


def test_block_size_mismatch_is_refused_before_loading_anything(tmp_path):
    target = make_tiny_target()
    d, cfg = _drafter(target)
    save_checkpoint(tmp_path / "ckpt", d, cfg, target.identity(), step=0)
    with pytest.raises(builder.BuildError, match="block_size 4"):
        builder.build_engine(drafter_dir=tmp_path / "ckpt", output=tmp_path / "e", target=target, block_size=7)
    assert not (tmp_path / "e").exists()


def test_unknown_what_is_refused():
    with pytest.raises(builder.BuildError, match="unknown"):
        builder.parse_what("onnx,tflite")
    assert builder.parse_what("trtllm") == ["hf", "trtllm"]


@pytest.mark.skipif(tensorrt_version() is not None, reason="TensorRT is installed here")
def test_what_trt_fails_clearly_without_tensorrt_and_builds_the_rest(tmp_path):
    target = make_tiny_target()
    d, cfg = _drafter(target)
    save_checkpoint(tmp_path / "ckpt", d, cfg, target.identity(), step=0)
    with pytest.raises(TensorRTUnavailable, match="TensorRT is not installed"):
        builder.build_engine(drafter_dir=tmp_path / "ckpt", output=tmp_path / "e", target=target, max_batch=2,
                             what="onnx,trt")
    meta = json.loads((tmp_path / "e" / "engine.json").read_text())
    assert meta["built"]["trt"]["status"] == "not built"
    assert (tmp_path / "e" / "onnx" / "dspark_draft.onnx").is_file()


def test_cli_build_exits_nonzero_with_one_line_on_block_mismatch(tmp_path, capsys):
    from dspark.cli import main

    target = make_tiny_target()
    d, cfg = _drafter(target)
    save_checkpoint(tmp_path / "ckpt", d, cfg, target.identity(), step=0)
    with pytest.raises(SystemExit) as exc:
        main(["build", "--drafter", str(tmp_path / "ckpt"), "--output", str(tmp_path / "e"), "--block-size", "7"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "block_size 4" in err and "\n" not in err


def test_parity_check_runs_the_engine_directory_own_onnx_with_its_sps_and_sts(tmp_path):
    from dspark.engine.export import parity
    from dspark.engine.export.onnx_export import DraftStep, ort_session, parity_case
    from dspark.engine.sps import SpsTable
    from dspark.engine.sts import StsCalibration

    target = make_tiny_target()
    d, cfg = _drafter(target, seed=3)
    save_checkpoint(tmp_path / "ckpt", d, cfg, target.identity(), step=5)
    SpsTable(tokens=[1, 8, 32], steps_per_s=[50.0, 30.0, 5.0], device="cpu", engine="toy").save(tmp_path / "sps.json")
    temps = [0.5 + 0.25 * k for k in range(cfg.block_size)]
    StsCalibration(temperatures=temps).save(tmp_path / "sts.json")
    builder.build_engine(drafter_dir=tmp_path / "ckpt", output=tmp_path / "eng", target=target, max_batch=4,
                         what="onnx", sps=tmp_path / "sps.json", sts=tmp_path / "sts.json")
    drafter, onnx_path, table, sts = parity._engine_dir_inputs(tmp_path / "eng", target)
    assert onnx_path == tmp_path / "eng" / "onnx" / "dspark_draft.onnx" and sts == temps
    assert len(table) == 4 * (cfg.block_size + 1) + 1 and table[1] > table[-1]
    g = torch.Generator().manual_seed(0)
    R, T = 3, 12
    aux = torch.randn(R, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)
    lens = torch.tensor([12, 5, 9])
    anchor = torch.randint(0, cfg.vocab_size, (R,), generator=g)
    case = parity_case(DraftStep(drafter, sts).eval(), ort_session(onnx_path), aux, lens, anchor, lens, table,
                       repeats=1)
    assert case.max_abs_logit_diff < 1e-4 and case.greedy_draft_match == 1.0
    assert case.conf_max_abs_diff < 1e-5 and case.verify_lens_match == 1.0
    # a different STS than the one embedded would show up in the confidences
    other = parity_case(DraftStep(drafter, None).eval(), ort_session(onnx_path), aux, lens, anchor, lens, table,
                        repeats=1)
    assert other.conf_max_abs_diff > 1e-4


# -- the target's weight hash, checked at load -------------------------------------------------
def _weights_dir(tmp_path, payload=b"weights v1"):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(payload)
    return d


@pytest.fixture
def hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    calls = []
    real = weights.sha256_file
    monkeypatch.setattr(weights, "sha256_file", lambda p: calls.append(p) or real(p))
    return calls


def _target_with_source(target, source):
    from types import SimpleNamespace

    ident = target.identity()
    return SimpleNamespace(identity=lambda: ident, profile=SimpleNamespace(source=str(source)))


def _engine_recording(root, name, weights_entries):
    eng = _copy(root, name)
    meta = json.loads((eng / "engine.json").read_text())
    meta["target"]["weights"] = weights_entries
    (eng / "engine.json").write_text(json.dumps(meta))
    return eng


def test_load_validation_accepts_the_weights_the_engine_was_built_against(built, tmp_path, hash_cache):
    target, _, root, _ = built
    src = _weights_dir(tmp_path)
    eng = _engine_recording(root, "w-ok", [weights.weight_entry(src / "model.safetensors")])
    mf.validate_engine_dir(eng, _target_with_source(target, src), files="runtime")


def test_load_validation_refuses_a_zeroed_weight_hash_in_one_line(built, tmp_path, hash_cache):
    target, _, root, _ = built
    src = _weights_dir(tmp_path)
    entry = dict(weights.weight_entry(src / "model.safetensors"), sha256="0" * 64)
    eng = _engine_recording(root, "w-zero", [entry])
    with pytest.raises(mf.TargetMismatchError, match="sha256 .* engine.json says 000000000000.*another checkpoint") as info:
        mf.validate_engine_dir(eng, _target_with_source(target, src), files="runtime")
    assert "\n" not in str(info.value)


def test_load_validation_refuses_another_checkpoint_of_the_same_size(built, tmp_path, hash_cache):
    target, _, root, _ = built
    src = _weights_dir(tmp_path)
    eng = _engine_recording(root, "w-other", [weights.weight_entry(src / "model.safetensors")])
    (src / "model.safetensors").write_bytes(b"weights v2")  # same size, new content and mtime
    with pytest.raises(mf.TargetMismatchError, match="another checkpoint"):
        mf.validate_engine_dir(eng, _target_with_source(target, src), files="runtime")


def test_load_validation_refuses_a_missing_weight_file(built, tmp_path, hash_cache):
    target, _, root, _ = built
    src = _weights_dir(tmp_path)
    eng = _engine_recording(root, "w-missing", [{"path": "other.safetensors", "bytes": 1, "sha256": "0" * 64}])
    with pytest.raises(mf.TargetMismatchError, match="'other.safetensors'"):
        mf.validate_engine_dir(eng, _target_with_source(target, src), files="runtime")


def test_weight_hash_is_computed_once_and_redone_when_size_or_mtime_change(tmp_path, hash_cache):
    f = _weights_dir(tmp_path) / "model.safetensors"
    first = weights.cached_sha256(f)
    assert weights.cached_sha256(f) == first and len(hash_cache) == 1, "second lookup must come from the cache"
    cache = json.loads((tmp_path / "cache" / weights.CACHE_NAME).read_text())
    assert cache[str(f.resolve())]["sha256"] == first
    f.write_bytes(b"weights v2")
    st = f.stat()
    import os
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert weights.cached_sha256(f) != first and len(hash_cache) == 2


def test_a_damaged_hash_cache_is_rebuilt(tmp_path, hash_cache):
    f = _weights_dir(tmp_path) / "model.safetensors"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / weights.CACHE_NAME).write_text("{not json")
    assert weights.cached_sha256(f) == mf.sha256_file(f)
    assert json.loads((tmp_path / "cache" / weights.CACHE_NAME).read_text())


def test_engine_json_that_is_not_json_is_refused_naming_the_file(tmp_path):
    (tmp_path / "engine.json").write_text("{not json")
    with pytest.raises(mf.ManifestVersionError, match=r"engine.json: not valid JSON") as info:
        mf.read_engine_json(tmp_path)
    assert "\n" not in str(info.value)
