"""Model parameters (config.pbtxt ``parameters`` with environment overrides) and
``module:function`` references to the engine and tokenizer loaders.

A parameter ``engine_dir`` is read from the model config; ``DSPARK_ENGINE_DIR`` in the
server's environment (set by ``scripts/start_server.sh --engine-dir``) overrides it. An
empty value means the loader's default (the embedded target and its default drafter).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

ENV_PREFIX = "DSPARK_"


def config_parameters(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """``{"parameters": {"k": {"string_value": "v"}}}`` -> ``{"k": "v"}``."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}


def parameter(params: Mapping[str, str], key: str, default: str = "", env: bool = True) -> str:
    """A model parameter; ``DSPARK_<KEY>`` in the environment wins when set and ``env``."""
    if env:
        value = os.environ.get(ENV_PREFIX + key.upper())
        if value is not None:
            return value
    return params.get(key, default)


def as_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def resolve(ref: str) -> Callable:
    """``package.module:attr`` or ``/path/to/file.py:attr`` -> the object."""
    if ":" not in ref:
        raise ValueError(f"expected 'module:attr' or '/path/file.py:attr', got {ref!r}")
    target, attr = ref.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        spec = importlib.util.spec_from_file_location(f"_dspark_factory_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look the module up
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{target} has no attribute {attr!r}") from None


DEFAULT_TOKENIZER_FACTORY = "dspark.training.target:load_tokenizer"


def load_tokenizer(params: Mapping[str, str]):
    """The tokenizer named by the ``tokenizer_factory`` and ``target`` parameters
    (empty target = the embedded default, SmolLM2-135M-Instruct)."""
    ref = parameter(params, "tokenizer_factory", DEFAULT_TOKENIZER_FACTORY) or DEFAULT_TOKENIZER_FACTORY
    return resolve(ref)(parameter(params, "target") or None)


def text_model_setup(args: Mapping[str, str]) -> tuple[dict[str, str], list[str], Any]:
    """What a text model (pre- or postprocessing) reads at ``initialize``: its parameters, its
    input names and the tokenizer those parameters name, from the python backend's ``args``."""
    config = json.loads(args["model_config"])
    params = config_parameters(config)
    return params, [i["name"] for i in config["input"]], load_tokenizer(params)
