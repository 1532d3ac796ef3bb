#!/usr/bin/env python
"""What a verify block's drafts cost the target on the CPU, with and without shared key reads.

Times the embedded target's forward (``TargetRunner``, the engine's fused decoder stack) over
R rows of ``context`` cached positions, each row verifying ``1 + drafts`` tokens, with the
varlen attention reading each row's keys once per block (``attention_block = 16``, the
engine's setting) and once per token (``attention_block = 1``), the two alternating within
each round. Per shape: the median over rounds of each side's mean ms per step and the
median of same-round ratios; per R and side, the marginal ms of one more verified draft,
``(t(1 + D) - t(1)) / (R * D)`` at the largest D: the price the scheduler weighs a draft
against. Checks that both sides give the same logits.

Writes ``<out>/cpu_attention.json`` and ``<out>/cpu_attention.md``.

    python scripts/bench_cpu_attention.py --out docs/benchmarks --threads 2     # ~3 min
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.engine import threads
from dspark.engine.bench import prime_cache
from dspark.engine.target_runner import TargetRunner
from dspark.training.config import load_target_profile
from dspark.training.target import load_target

SIDES = {"block": 16, "per_token": 1}


def _step(runner: TargetRunner, rows: int, tokens: int, context: int):
    for r in range(rows):
        runner.set_length(r, context)
    return runner.forward(list(range(rows)), [[7 + (r % 50)] * tokens for r in range(rows)])


def _time(runner: TargetRunner, rows: int, tokens: int, context: int, iters: int) -> tuple[float, torch.Tensor]:
    out = _step(runner, rows, tokens, context).token_logits.clone()
    t0 = time.perf_counter()
    for _ in range(iters):
        _step(runner, rows, tokens, context)
    return (time.perf_counter() - t0) / iters, out


def run(runner: TargetRunner, shapes: list[tuple[int, int]], context: int, rounds: int, iters: int) -> list[dict]:
    records = []
    prime_cache(runner, max(r for r, _ in shapes), context)
    for rows, tokens in tqdm(shapes, desc="shapes"):
        times = {side: [] for side in SIDES}
        same = True
        for rnd in range(rounds):
            order = list(SIDES) if rnd % 2 == 0 else list(SIDES)[::-1]
            got = {}
            for side in order:
                runner.attention_block = SIDES[side]
                t, got[side] = _time(runner, rows, tokens, context, iters)
                times[side].append(t)
            same &= torch.equal(got["block"], got["per_token"])
        runner.attention_block = SIDES["block"]
        records.append(dict(rows=rows, tokens_per_row=tokens, context=context,
                            block_ms=1e3 * statistics.median(times["block"]),
                            per_token_ms=1e3 * statistics.median(times["per_token"]),
                            speedup=statistics.median(p / b for p, b in zip(times["per_token"], times["block"])),
                            same_logits=bool(same), rounds=rounds, iters=iters))
    return records


def marginal(records: list[dict]) -> list[dict]:
    """Per R: ms of one more verified draft, from the plain step and the longest block."""
    out = []
    for rows in sorted({r["rows"] for r in records}):
        mine = sorted((r for r in records if r["rows"] == rows), key=lambda r: r["tokens_per_row"])
        base, top = mine[0], mine[-1]
        drafts = rows * (top["tokens_per_row"] - base["tokens_per_row"])
        if drafts <= 0:
            continue
        out.append(dict(rows=rows, drafts_per_row=top["tokens_per_row"] - 1,
                        **{f"{side}_ms_per_draft": (top[f"{side}_ms"] - base[f"{side}_ms"]) / drafts
                           for side in SIDES},
                        **{f"{side}_step_ms": base[f"{side}_ms"] for side in SIDES}))
    return out


def write(records: list[dict], out: Path, n_threads: int, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    per_draft = marginal(records)
    meta = dict(cpu=platform.processor() or platform.machine(), threads=n_threads, torch=torch.__version__,
                command=command)
    (out / "cpu_attention.json").write_text(json.dumps(dict(meta=meta, records=records, per_draft=per_draft),
                                                       indent=2) + "\n")
    lines = [f"# Verify blocks on the CPU: one key read per block against one per token ({n_threads} threads)", "",
             f"Command: `{command}`", "",
             "The embedded target's forward (fused decoder stack) over `rows` rows of "
             f"{records[0]['context'] if records else '-'} cached positions, each verifying `tokens` tokens (the "
             "anchor and its drafts), with each row's keys read once per block (the engine's setting) and once "
             "per token, alternating within each round; ms per step are medians over rounds, the speedup the "
             "median of same-round ratios; `same logits`: both sides gave bit-identical logits in every round.", "",
             "| rows | tokens per row | block ms | per-token ms | speedup | same logits |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['rows']} | {r['tokens_per_row']} | {r['block_ms']:.1f} | {r['per_token_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {'yes' if r['same_logits'] else 'NO'} |")
    lines += ["", "One more verified draft, `(t(tokens) - t(1)) / (rows x drafts)` at the longest block, against "
                  "the plain step (one token per row):", "",
              "| rows | drafts per row | block ms per draft | per-token ms per draft | plain step ms |",
              "|---|---|---|---|---|"]
    for m in per_draft:
        lines.append(f"| {m['rows']} | {m['drafts_per_row']} | {m['block_ms_per_draft']:.2f} | "
                     f"{m['per_token_ms_per_draft']:.2f} | {m['block_step_ms']:.1f} |")
    (out / "cpu_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[6:]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=384, help="cached positions per row (a prompt and some output)")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--tokens", default="1,2,4", help="tokens verified per row (1: a plain decode step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    threads.configure(args.threads)
    rows = [int(x) for x in args.rows.split(",") if x]
    tokens = [int(x) for x in args.tokens.split(",") if x]
    target = load_target(load_target_profile("smollm2-135m"), device="cpu", dtype=torch.float32)
    longest = args.context + max(tokens) + 2
    runner = TargetRunner(target, max(rows), initial_capacity=longest, max_context=longest)
    if not runner.varlen:
        raise SystemExit("the varlen attention kernel could not be built here (see the log): nothing to compare")
    command = (f"python scripts/bench_cpu_attention.py --out {args.out} --threads {args.threads} "
               f"--context {args.context} --rows {args.rows} --tokens {args.tokens} --rounds {args.rounds} "
               f"--iters {args.iters}")
    write(run(runner, [(r, t) for r in rows for t in tokens], args.context, args.rounds, args.iters),
          args.out, args.threads, command)


if __name__ == "__main__":
    main()
