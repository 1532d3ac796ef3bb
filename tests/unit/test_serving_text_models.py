"""The preprocessing and postprocessing Triton models read their config the same way
(``factory.text_model_setup``): input names, parameters and the tokenizer they name."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import json_format, text_format  # noqa: E402

REPO = Path(__file__).resolve().parents[2] / "triton_repo"


class TinyTokenizer:
    """Just what the text ends read at set-up."""

    eos_token_id = 2
    chat_template = None

    def __len__(self) -> int:
        return 10


def tiny_tokenizer(target: str | None) -> TinyTokenizer:
    assert target == "tiny-target", "the model's 'target' parameter reaches the tokenizer factory"
    return TinyTokenizer()


def _initialized(name: str, monkeypatch: pytest.MonkeyPatch, **params: str):
    """The model's TritonPythonModel after ``initialize`` with its committed config.pbtxt,
    ``params`` overriding parameters; no server, a stand-in python backend module."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    for key in ("DSPARK_TARGET", "DSPARK_TOKENIZER_FACTORY"):
        monkeypatch.delenv(key, raising=False)
    spec = importlib.util.spec_from_file_location(f"_test_{name}_model", REPO / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "watch_server", lambda: True)  # no watchdog thread in a test
    config = json_format.MessageToDict(text_format.Parse((REPO / name / "config.pbtxt").read_text(), mc.ModelConfig()),
                                       preserving_proto_field_name=True)
    params = {"target": "tiny-target", "tokenizer_factory": f"{__name__}:tiny_tokenizer", **params}
    for key, value in params.items():
        config.setdefault("parameters", {})[key] = {"string_value": value}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config)})
    return model, [i["name"] for i in config["input"]]


def test_preprocessing_reads_its_inputs_parameters_and_tokenizer(monkeypatch):
    model, inputs = _initialized("preprocessing", monkeypatch, system_prompt="Be brief.")
    assert model.input_names == inputs and "text_input" in inputs
    assert isinstance(model.pre.tokenizer, TinyTokenizer)
    assert model.pre.system_prompt == "Be brief." and model.pre.default_end_id == 2


def test_postprocessing_reads_its_inputs_parameters_and_tokenizer(monkeypatch):
    model, inputs = _initialized("postprocessing", monkeypatch, skip_special_tokens="false")
    assert model.input_names == inputs
    assert isinstance(model.post.tokenizer, TinyTokenizer) and model.post.num_tokens == 10
    assert model.post.skip_special_tokens is False
