"""``dspark calibrate``: fit STS temperatures on held-out prompts and report ECE/AUC/Brier.

Held-out data = the records the trainer never saw (the last ``data.holdout_fraction`` of
``records.jsonl``), decoded at batch 1 with full blocks at T=1, so every position's
confidence is judged against a real verification outcome.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .evaluate import collect_rounds
from .sts import StsCalibration, calibration_report


def held_out_prompts(cfg, target, limit: int) -> list[str]:
    from dspark.training.data import read_records

    records = read_records(cfg.run_dir / "data" / "records.jsonl")
    if not records:
        raise RuntimeError(f"no records in {cfg.run_dir / 'data'}: run `dspark prepare-data` first")
    n_train = max(1, int(len(records) * (1 - cfg.data.holdout_fraction)))
    held = records[n_train:] or records[-1:]
    tok = target.tokenizer
    # the records hold chat-templated prompt ids; decode back to text for the engine's chat path
    texts = []
    for r in held[:limit]:
        text = tok.decode(r.prompt_ids, skip_special_tokens=True)
        texts.append(text.split("user\n", 1)[-1].rsplit("assistant", 1)[0].strip() or text)
    return texts


def calibrate(target, drafter, prompts: list[str], max_new_tokens: int, seed: int, out: Path) -> dict:
    if drafter.confidence is None:
        raise ValueError(f"a {drafter.cfg.algo} drafter has no confidence head: nothing to calibrate")
    rounds = collect_rounds(target, drafter, prompts, 1.0, max_new_tokens, seed, desc="calibration")
    z = torch.tensor([r.conf_logits for r in rounds])
    acc = torch.tensor([r.accepted for r in rounds])
    prop = torch.tensor([r.verify_len for r in rounds])
    cal = StsCalibration.fit(z, acc, num_proposed=prop, meta={"rounds": len(rounds), "prompts": len(prompts)})
    cal.save(out)
    report = [dataclasses.asdict(p) for p in calibration_report(z, acc, cal.temperatures, num_proposed=prop)]
    summary = {"sts": str(out), "temperatures": cal.temperatures, "rounds": len(rounds), "positions": report}
    out.with_name(out.stem + "_report.json").write_text(json.dumps(summary, indent=2))
    return summary
