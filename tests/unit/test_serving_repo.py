"""triton_repo/ is concrete and wired consistently: every ensemble tensor is produced once
with the type its consumer expects, and the python models read the names in their configs."""
from __future__ import annotations

from pathlib import Path

import pytest

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import text_format  # noqa: E402

from dspark.engine.serving import tensors as T  # noqa: E402

REPO = Path(__file__).resolve().parents[2] / "triton_repo"
MODELS = sorted(p.parent.name for p in REPO.glob("*/config.pbtxt"))
ENSEMBLES = {"ensemble": "dspark_llm", "ensemble_target_only": "dspark_llm_target_only"}


def load(name):
    return text_format.Parse((REPO / name / "config.pbtxt").read_text(), mc.ModelConfig())


def io(cfg):
    return ({i.name: i.data_type for i in cfg.input}, {o.name: o.data_type for o in cfg.output})


def test_the_repository_holds_the_expected_models():
    assert MODELS == sorted(["preprocessing", "postprocessing", "dspark_llm", "dspark_llm_target_only",
                             "ensemble", "ensemble_target_only"])


@pytest.mark.parametrize("name", MODELS)
def test_configs_are_concrete_and_loadable(name):
    text = (REPO / name / "config.pbtxt").read_text()
    assert "${" not in text
    cfg = load(name)
    assert cfg.name == name and (REPO / name / "1").is_dir()
    if cfg.backend == "python":
        assert (REPO / name / "1" / "model.py").is_file()
    assert cfg.max_batch_size == 64


@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_ensemble_wiring_matches_the_composing_models(ensemble):
    cfg = load(ensemble)
    ens_in, ens_out = io(cfg)
    available = dict(ens_in)
    produced = {}
    steps = [s.model_name for s in cfg.ensemble_scheduling.step]
    assert steps == ["preprocessing", ENSEMBLES[ensemble], "postprocessing"]
    for step in cfg.ensemble_scheduling.step:
        m_in, m_out = io(load(step.model_name))
        for key, tensor in step.input_map.items():
            assert key in m_in, f"{step.model_name} has no input {key}"
            assert tensor in available, f"{ensemble}: {tensor} is used before it is produced"
            assert available[tensor] == m_in[key], f"{ensemble}: {tensor} type differs for {step.model_name}.{key}"
        for key, tensor in step.output_map.items():
            assert key in m_out, f"{step.model_name} has no output {key}"
            assert tensor not in produced, f"{ensemble}: {tensor} produced twice"
            produced[tensor] = m_out[key]
            available[tensor] = m_out[key]
    for name, dtype in ens_out.items():
        assert produced.get(name) == dtype, f"{ensemble}: output {name} not produced with its type"


@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_every_ensemble_input_reaches_preprocessing_so_a_missing_text_input_is_refused(ensemble):
    # Triton 2.51 checks a request's input count, not names: with text_input required, a request
    # carrying only max_tokens scheduled no step and was never answered. So text_input is optional
    # and preprocessing (which refuses its absence) sees every input the request may carry.
    cfg = load(ensemble)
    first = cfg.ensemble_scheduling.step[0]
    assert first.model_name == "preprocessing"
    public = {i.name for i in cfg.input}
    assert set(first.input_map.values()) == public
    assert all(i.optional for i in cfg.input), "a required ensemble input would skip the check"
    assert all(i.optional for i in load("preprocessing").input)


def test_llm_models_differ_only_in_name_and_mode():
    spec, base = load("dspark_llm"), load("dspark_llm_target_only")
    assert spec.model_transaction_policy.decoupled and base.model_transaction_policy.decoupled
    assert spec.parameters["mode"].string_value == "spec"
    assert base.parameters["mode"].string_value == "target_only"
    for cfg in (spec, base):
        cfg.name = "x"
        cfg.parameters["mode"].string_value = "x"
    assert spec == base


def test_llm_config_declares_every_tensor_the_request_logic_uses():
    m_in, m_out = io(load("dspark_llm"))
    read = {T.INPUT_IDS, T.INPUT_LENGTHS, T.REQUEST_OUTPUT_LEN, T.END_ID, T.STREAMING, T.TEMPERATURE,
            T.RUNTIME_TOP_P, T.RUNTIME_TOP_K, T.RANDOM_SEED, T.STOP_WORDS, T.STOP, T.REQUEST_KEY,
            T.EXCLUDE_INPUT_IN_OUTPUT}
    assert read == set(m_in)
    written = {T.REQUEST_KEY, T.OUTPUT_IDS, T.PREFIX_IDS, T.IS_FINAL, *T.STAT_OUTPUTS}
    assert written == set(m_out)
