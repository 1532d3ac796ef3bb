"""accept_len at T=1 under the two verify rules, rejection sampling and the coupled rule.

The coupled rule (plugins/coupled.py) makes a seeded request's tokens a function of the
seed alone; its price is acceptance, since a draft then counts only when it *is* the
target's own choice. This measures that price the way ``dspark eval`` measures acceptance
(the report's Table 1 setting: first turn, batch 1, full blocks, T = 1) on the same prompts
for both rules, and writes ``<output-dir>/<name>.json`` and ``.md`` with the command.
Requests run ``--batch`` at a time: with full blocks (``scheduler=fixed``, no drafting gate)
each request drafts and is verified on its own, so its rounds are those of batch 1; only
the wall time changes.

    .venv/bin/python scripts/bench_seeded_sampling.py -c quickstart \
        --checkpoint runs/<run>/checkpoints/last --prompts-per-task 6 --samples 2 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

RULES = ("rejection", "coupled")


def _per_request(rounds) -> dict[str, tuple[int, int]]:
    """request id -> (accepted drafts, rounds)."""
    out: dict[str, list[int]] = {}
    for r in rounds:
        acc = out.setdefault(r.request_id, [0, 0])
        acc[0] += r.accepted
        acc[1] += 1
    return {k: (a, n) for k, (a, n) in out.items()}


def collect(target, drafter, jobs: list[tuple[str, list[int], int]], max_tokens: int, rule: str, batch: int) -> list:
    """Decode ``jobs`` [(request id, prompt ids, seed)] at T=1 with full blocks, ``batch`` at a
    time, verified by ``rule``; -> the engine's per-round records."""
    from dspark.engine.api import SamplingParams
    from dspark.engine.runtime import EngineConfig, SpecEngine

    eng = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=batch,
                                                   record_rounds=True, sampling_rule=rule))
    stops = list(target.profile.stop_token_ids)
    for rid, ids, seed in jobs:
        eng.submit(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop_token_ids=stops),
                   lambda o: None)
    eng.run_until_done()
    return eng.rounds


def measure(target, drafter, prompts_by_task: dict[str, list[str]], samples: int, max_tokens: int, seed: int,
            batch: int) -> list[dict]:
    from dspark.engine.evaluate import summarize

    K = drafter.cfg.block_size
    # the same prompts and seeds for both rules; under rejection a seed fixes the stream, not the tokens
    jobs = [(f"{task}-{i}-{s}", target.chat_prompt_ids(p), seed + 1000 * s + i)
            for task, prompts in prompts_by_task.items() for i, p in enumerate(prompts) for s in range(samples)]
    rows = []
    for rule in RULES:
        t0 = time.perf_counter()
        all_rounds = collect(target, drafter, jobs, max_tokens, rule, batch)
        per = _per_request(all_rounds)
        # accept_len per request, then the spread over requests: rounds of one request are correlated
        lens = np.array([(a + n) / n for a, n in per.values()])
        summary = summarize(all_rounds, K)
        rows.append({"rule": rule, "accept_len": summary["accept_len"],
                     "accept_len_se": float(lens.std(ddof=1) / np.sqrt(len(lens))) if len(lens) > 1 else None,
                     "accept_rate_at_k": summary["accept_rate_at_k"], "rounds": summary["rounds"],
                     "requests": len(per), "seconds": time.perf_counter() - t0})
        print(f"{rule}: accept_len {rows[-1]['accept_len']:.3f} +- {rows[-1]['accept_len_se'] or 0:.3f} "
              f"over {rows[-1]['rounds']} rounds, {len(per)} requests", flush=True)
    return rows


def write(rows: list[dict], meta: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    base = rows[0]["accept_len"]
    lines = [f"# accept_len at T=1: rejection sampling vs the coupled rule ({meta['drafter']})", "",
             f"Command: `{meta['command']}`", "",
             "| rule | accept_len | +- (s.e. over requests) | x rejection | rate@1 | rate@2 | rate@3 | rounds | requests |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rates = (r["accept_rate_at_k"] + [float("nan")] * 3)[:3]
        se = "-" if r["accept_len_se"] is None else f"{r['accept_len_se']:.3f}"
        lines.append(f"| {r['rule']} | {r['accept_len']:.3f} | {se} | {r['accept_len'] / base:.3f} | "
                     + " | ".join(f"{x:.3f}" for x in rates) + f" | {r['rounds']} | {r['requests']} |")
    lines += ["", "Full blocks (`scheduler=fixed`, no gate), T = 1, first turn of each prompt, the same prompts and "
              "seeds for both rules. Requests were decoded "
              f"{meta['decoded_together']} at a time; with full blocks a request's rounds do not depend on the batch, "
              "so these are batch-1 acceptance figures. `accept_len` is accepted drafts + 1 per round; `rate@k` is "
              "P(accepted > k | verified > k).", ""]
    (out_dir / f"{name}.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default="quickstart")
    p.add_argument("--checkpoint", required=True, help="drafter checkpoint directory")
    p.add_argument("--tasks", default="math,code,chat")
    p.add_argument("--prompts-per-task", type=int, default=6)
    p.add_argument("--samples", type=int, default=2, help="seeds per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="requests decoded together (rounds are those of batch 1)")
    p.add_argument("--output-dir", default="docs/benchmarks")
    p.add_argument("--name", default="seeded_sampling")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_args(argv)

    import torch

    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.config import load_run_config
    from dspark.training.data import load_eval_prompts
    from dspark.training.target import load_target

    cfg = load_run_config(args.config, args.overrides)
    target = load_target(cfg.target)
    drafter, _, _ = load_checkpoint(Path(args.checkpoint), target)
    prompts = {t: load_eval_prompts(t, args.prompts_per_task, cfg.data.data_root) for t in args.tasks.split(",")}
    rows = measure(target, drafter.eval(), prompts, args.samples, args.max_tokens, args.seed, args.batch)
    meta = {"command": " ".join(["python scripts/bench_seeded_sampling.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])]),
            "drafter": f"{drafter.cfg.algo}, {drafter.cfg.num_layers} layers, checkpoint {args.checkpoint}",
            "target": cfg.target.name, "temperature": 1.0, "batch": 1, "block_size": drafter.cfg.block_size,
            "tasks": list(prompts), "prompts_per_task": args.prompts_per_task, "samples": args.samples,
            "max_tokens": args.max_tokens, "decoded_together": args.batch, "threads": torch.get_num_threads()}
    write(rows, meta, Path(args.output_dir), args.name)
    print(f"wrote {Path(args.output_dir) / (args.name + '.json')} and .md")


if __name__ == "__main__":
    main()
