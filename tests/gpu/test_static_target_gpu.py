"""CUDA-graph decode steps on a GPU: token-identical to the eager engine on the same device.

Run on a CUDA host: ``pytest tests/gpu -m gpu`` (scripts/gpu_check.sh does it on the H200).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected everywhere, run only where a GPU is
    pytest.skip("needs a CUDA device", allow_module_level=True)
# scripts/gpu_check.sh may run with only dspark.plugins importable (no install on the device)
pytest.importorskip("transformers", reason="needs the installed kit (carry .venv to the device)")

from dspark.engine.api import SamplingParams  # noqa: E402
from dspark.engine.runtime import EngineConfig, SpecEngine  # noqa: E402
from dspark.engine.static_target import StaticTarget  # noqa: E402
from dspark.training.models import build_drafter, drafter_config_for  # noqa: E402

from ..conftest import make_tiny_target, run_to_completion, tiny_run_config  # noqa: E402


@pytest.mark.parametrize("mode", ["spec", "target_only"])
def test_graph_replay_is_token_identical_to_eager_on_the_gpu(mode):
    target = make_tiny_target()
    target.model.to("cuda")
    torch.manual_seed(1)
    drafter = None
    if mode == "spec":
        drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target).to("cuda")
    jobs = [(f"r{i}", list(range(6 + i, 20 + 3 * i)), SamplingParams(max_tokens=10 + 2 * i)) for i in range(5)]
    eager = run_to_completion(SpecEngine(target, drafter, EngineConfig(mode=mode, max_batch=4, static_steps="off")), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode=mode, max_batch=4, static_steps="graphs"))
    assert isinstance(engine.runner, StaticTarget) and engine.runner.use_graphs
    assert run_to_completion(engine, jobs) == eager
    assert engine.runner.replays > 0
