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
    from dspark.training.trainer import train_count

    records = read_records(cfg.run_dir / "data" / "records.jsonl")
    if not records:
        raise RuntimeError(f"no records in {cfg.run_dir / 'data'}: run `dspark prepare-data` first")
    held = records[train_count(len(records), cfg.data.holdout_fraction):] or records[-1:]
    tok = target.tokenizer
    # the records hold chat-templated prompt ids; decode back to text for the engine's chat path
    texts = []
    for r in held[:limit]:
        text = tok.decode(r.prompt_ids, skip_special_tokens=True)
        texts.append(text.split("user\n", 1)[-1].rsplit("assistant", 1)[0].strip() or text)
    return texts


def calibrate(target, drafter, prompts: list[str], max_new_tokens: int, seed: int, out: Path,
              report_fraction: float = 0.0) -> dict:
    """Fit STS on the rounds of the held-out prompts and save it to ``out``.

    ``report_fraction`` > 0 keeps that share of the prompts (the last ones) out of the fit:
    the per-position report is then on rounds the temperatures never saw (out of sample);
    with 0 it is on the fitting rounds themselves.
    """
    if drafter.confidence is None:
        raise ValueError(f"a {drafter.cfg.algo} drafter has no confidence head: nothing to calibrate")
    if not 0.0 <= report_fraction < 1.0:
        raise ValueError(f"report_fraction must be in [0, 1), got {report_fraction}")
    rounds = collect_rounds(target, drafter, prompts, 1.0, max_new_tokens, seed, desc="calibration")
    n_fit = len(prompts) - int(round(len(prompts) * report_fraction))
    if report_fraction > 0 and not 0 < n_fit < len(prompts):
        raise ValueError(f"{len(prompts)} prompts cannot be split {1 - report_fraction:.2f} / {report_fraction:.2f}")
    prompt_of = [int(r.request_id.rsplit("-", 1)[1]) for r in rounds]  # collect_rounds names requests <desc>-<i>
    fit_rows = [r for r, i in zip(rounds, prompt_of) if i < n_fit]
    report_rows = [r for r, i in zip(rounds, prompt_of) if i >= n_fit] if report_fraction > 0 else fit_rows
    z, acc, prop = _round_tensors(fit_rows)
    cal = StsCalibration.fit(z, acc, num_proposed=prop, meta={"rounds": len(fit_rows), "prompts": n_fit})
    cal.save(out)
    rz, racc, rprop = _round_tensors(report_rows)
    report = [dataclasses.asdict(p) for p in calibration_report(rz, racc, cal.temperatures, num_proposed=rprop)]
    summary = {"sts": str(out), "temperatures": cal.temperatures, "rounds": len(rounds),
               "fit": {"prompts": n_fit, "rounds": len(fit_rows)},
               "report": {"prompts": len(prompts) - n_fit if report_fraction > 0 else n_fit,
                          "rounds": len(report_rows), "out_of_sample": report_fraction > 0},
               "positions": report}
    out.with_name(out.stem + "_report.json").write_text(json.dumps(summary, indent=2))
    return summary


def _round_tensors(rounds: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(confidence logits [N, K], accepted drafts [N], verified drafts [N]) of decoding rounds."""
    return (torch.tensor([r.conf_logits for r in rounds]), torch.tensor([r.accepted for r in rounds]),
            torch.tensor([r.verify_len for r in rounds]))


def write_calibration_docs(summary: dict, out_dir: Path, command: str, note: str = "") -> None:
    """``calibration.json`` (per position ECE/AUC/Brier before and after STS) + ``calibration.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    positions = [{"position": p["position"] + 1, "n": p["n"], "positive_rate": p["positive_rate"],
                  "before": {"ece": p["ece_before"], "auc": p["auc_before"], "brier": p["brier_before"]},
                  "after": {"ece": p["ece_after"], "auc": p["auc_after"], "brier": p["brier_after"]}}
                 for p in summary["positions"]]
    doc = {"command": command, "note": note, "fit": summary["fit"], "report": summary["report"],
           "sts_temperatures": summary["temperatures"], "positions": positions}
    (out_dir / "calibration.json").write_text(json.dumps(doc, indent=2) + "\n")
    where = "held-out prompts the fit never saw" if summary["report"]["out_of_sample"] else "the fitting rounds (in sample)"
    lines = ["# STS calibration (cumulative confidence vs accepted prefix)", "", f"Command: `{command}`", "",
             f"Fitted on {summary['fit']['rounds']} rounds of {summary['fit']['prompts']} held-out prompts; reported on "
             f"{summary['report']['rounds']} rounds of {where}. {note}".rstrip(), "",
             "| pos | n | accept rate | ECE before | ECE after | AUC | Brier before | Brier after |",
             "|---|---|---|---|---|---|---|---|"]
    for p in positions:
        lines.append(f"| {p['position']} | {p['n']} | {p['positive_rate']:.3f} | {p['before']['ece']:.4f} | "
                     f"{p['after']['ece']:.4f} | {p['after']['auc']:.3f} | {p['before']['brier']:.4f} | "
                     f"{p['after']['brier']:.4f} |")
    lines += ["", "STS temperatures: " + ", ".join(f"{t:.3g}" for t in summary["temperatures"]), ""]
    (out_dir / "calibration.md").write_text("\n".join(lines))
