"""Acceptance evaluation (``dspark eval``): speculative decoding at batch size 1, lossless.

Runs the real engine with one request at a time (the report's Table 1 setting: first
turn, batch 1, full blocks) at each temperature over each task and reports
``accept_len`` (mean accepted + 1 per round), ``accept_rate@k`` and, for drafters with a
confidence head, ECE / AUC / Brier of the cumulative confidence against the accepted
prefix. ``run_eval`` is the whole of ``dspark eval`` (also the last step of ``dspark
quickstart``): the run's eval settings, the printed table and ``<run>/eval.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.training.data import load_eval_prompts
from dspark.training.metrics import accept_rate_at_k, confidence_calibration

from .api import SamplingParams
from .proposers import accept_len_of_rounds
from .runtime import EngineConfig, SpecEngine, parse_proposers


def collect_rounds(target, drafter, prompts: list[str], temperature: float, max_new_tokens: int, seed: int,
                   desc: str = "eval", sampling_rule: str = EngineConfig.sampling_rule,
                   proposers: str = "neural") -> list:
    """Decode every prompt at batch 1 with full blocks, sampled requests verified by
    ``sampling_rule`` (the engine's default: what is served), drafts from ``proposers``
    (``EngineConfig.proposers``); return the per-round records."""
    eng = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=1, seed=seed,
                                                   record_rounds=True, sampling_rule=sampling_rule,
                                                   proposers=proposers))
    stops = list(target.profile.stop_token_ids)
    for i, p in enumerate(tqdm(prompts, desc=desc, unit="prompt", leave=False)):
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i, stop_token_ids=stops)
        eng.submit(f"{desc}-{i}", target.chat_prompt_ids(p), params, lambda o: None)
        eng.run_until_done()
    # rounds capped below K by max_tokens are not full-block rounds; keep them (they verify fewer)
    return eng.rounds


def summarize(rounds: list, K: int) -> dict:
    acc = np.array([r.accepted for r in rounds])
    prop = np.array([r.verify_len for r in rounds])
    out = {"accept_len": accept_len_of_rounds(acc), "accept_rate_at_k": accept_rate_at_k(acc, prop, K),
           "rounds": len(rounds)}
    conf = [r.conf_logits for r in rounds]
    if conf and all(c is not None and len(c) == len(conf[0]) for c in conf):
        cum = torch.cumprod(torch.sigmoid(torch.tensor(conf)), dim=-1).numpy()
        out["calibration"] = confidence_calibration(cum, acc, prop)
    return out


def evaluate(target, drafter, tasks: list[str], temperatures: list[float], samples_per_task: int,
             max_new_tokens: int, seed: int = 0, data_root: str | None = None,
             proposers: str = "neural") -> list[dict]:
    """One result per (task, temperature) plus an 'overall' row per temperature; ``proposers``
    as ``EngineConfig.proposers`` (``drafter`` may be None without ``neural``)."""
    names = parse_proposers(proposers)
    ks = ([drafter.cfg.block_size] if "neural" in names else []) + \
         ([EngineConfig().suffix.max_drafts] if "suffix" in names else [])
    K = max(ks, default=0)
    label = proposers if names != ["neural"] else drafter.cfg.algo
    results = []
    for temp in temperatures:
        all_rounds = []
        for task in tasks:
            prompts = load_eval_prompts(task, samples_per_task, data_root)
            rounds = collect_rounds(target, drafter, prompts, temp, max_new_tokens, seed, desc=f"{task}@T={temp}",
                                    proposers=proposers)
            all_rounds += rounds
            results.append({"drafter": label, "task": task, "temperature": temp,
                            "samples": len(prompts), **summarize(rounds, K)})
        results.append({"drafter": label, "task": "overall", "temperature": temp,
                        "samples": samples_per_task * len(tasks), **summarize(all_rounds, K)})
    return results


def run_eval(cfg, target, drafter, checkpoint: Path | None, tasks: list[str] | None = None,
             proposers: str = "neural", output: Path | None = None) -> Path:
    """Evaluate with ``cfg.eval``'s settings (``tasks`` overrides its task list), print the
    table and write the results with their provenance to ``output`` (default
    ``<run>/eval.json``); returns that path. ``checkpoint`` names the drafter (None without one)."""
    e = cfg.eval
    results = evaluate(target, drafter, tasks or e.tasks, e.temperatures, e.samples_per_task, e.max_new_tokens,
                       e.seed, cfg.data.data_root, proposers=proposers)
    print_table(results)
    out = output or cfg.run_dir / "eval.json"
    write_results(results, out, {"checkpoint": None if checkpoint is None else str(checkpoint),
                                 "target": cfg.target.name, "proposers": proposers})
    return out


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="acceptance (batch 1, full blocks)")
    for col in ("drafter", "task", "T", "accept_len", "rate@1", "rate@2", "rate@3", "rounds", "ECE@1"):
        table.add_column(col)
    for r in results:
        rates = r["accept_rate_at_k"] + [float("nan")] * 3
        ece1 = r["calibration"][0]["ece"] if r.get("calibration") else None
        table.add_row(r["drafter"], r["task"], f"{r['temperature']:g}", f"{r['accept_len']:.3f}",
                      *(f"{x:.2f}" for x in rates[:3]), str(r["rounds"]), "-" if ece1 is None else f"{ece1:.3f}")
    Console().print(table)


def write_results(results: list[dict], path: Path, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**(extra or {}), "results": results}, indent=2))
