"""``dspark eval`` is one function (engine/evaluate.run_eval) that ``dspark quickstart`` calls too."""
from __future__ import annotations

import json

import torch

from dspark.engine.evaluate import evaluate, run_eval
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, tiny_run_config


def test_run_eval_writes_what_evaluate_measures_with_its_provenance(tmp_path, capsys):
    cfg = tiny_run_config("dspark")
    cfg.eval.samples_per_task, cfg.eval.max_new_tokens, cfg.eval.temperatures = 2, 8, [0.0]
    target = make_tiny_target()
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config_for(cfg, target), target).eval()
    out = run_eval(cfg, target, drafter, tmp_path / "ckpt", tasks=["math"], output=tmp_path / "eval.json")
    assert out == tmp_path / "eval.json"
    doc = json.loads(out.read_text())
    assert {k: doc[k] for k in ("checkpoint", "target", "proposers")} == {
        "checkpoint": str(tmp_path / "ckpt"), "target": "tiny", "proposers": "neural"}
    e = cfg.eval
    again = evaluate(target, drafter, ["math"], e.temperatures, e.samples_per_task, e.max_new_tokens, e.seed,
                     cfg.data.data_root)
    assert json.loads(json.dumps(again)) == doc["results"], "eval.json holds evaluate()'s rows, unchanged"
    assert [r["task"] for r in doc["results"]] == ["math", "overall"]
    assert "acceptance" in capsys.readouterr().out, "the table is printed"
