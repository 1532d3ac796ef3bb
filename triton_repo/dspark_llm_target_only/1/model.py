"""The target-only baseline: the dspark_llm binding with ``mode: target_only`` in config.pbtxt."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dspark_llm_model", Path(__file__).resolve().parents[2] / "dspark_llm" / "1" / "model.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

TritonPythonModel = _module.TritonPythonModel
