#!/usr/bin/env python
"""CPU micro-benchmark: vocabulary-sized projections through ``F.linear`` against
``training.vocab_projection.vocab_logits`` (what the engine and the drafters use).

Shapes are the embedded target's: the LM head ``[V=49152, d=576]`` (decode, verify and
draft positions) and the Markov head's ``W2 [V, r=128]``. For each row count the two
implementations alternate call by call and the median of ``--repeats`` calls is kept, so
both see the same machine load. The LM head (113 MB in fp32) does not fit in cache; ``W2``
(25 MB) may, which flatters both columns for it equally (in the engine the target's
weights evict it between calls).

Writes ``<out>/vocab_projection.json`` and ``.md``.

    python scripts/bench_vocab_projection.py --out docs/benchmarks     # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.training.vocab_projection import vocab_logits


def median_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each fn, calls interleaved (one warm-up each)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--rows", default="1,2,4,7,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    records = []
    with torch.no_grad():
        for name, d in (("lm_head", args.hidden), ("markov_w2", args.markov_rank)):
            w = torch.randn(args.vocab, d)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, d)
                ms = median_ms({"linear": lambda: F.linear(x, w), "vocab_logits": lambda: vocab_logits(x, w)},
                               args.repeats)
                err = float((F.linear(x, w) - vocab_logits(x, w)).abs().max())
                records.append({"weight": name, "shape": [args.vocab, d], "rows": rows, "linear_ms": ms["linear"],
                                "vocab_logits_ms": ms["vocab_logits"], "speedup": ms["linear"] / ms["vocab_logits"],
                                "max_abs_diff": err})
                print(f"{name:10s} rows {rows:4d}  F.linear {ms['linear']:7.2f} ms  vocab_logits "
                      f"{ms['vocab_logits']:7.2f} ms  x{records[-1]['speedup']:.2f}  |diff| {err:.1e}", flush=True)
    device = f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    command = "python " + " ".join(sys.argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vocab_projection.json").write_text(json.dumps(
        {"command": command, "device": device, "torch": torch.__version__, "repeats": args.repeats,
         "results": records}, indent=2))
    lines = ["# Vocabulary projection on CPU: F.linear against vocab_logits", "",
             f"Command: `{command}`", "", f"Device: {device}, torch {torch.__version__}, median of "
             f"{args.repeats} interleaved calls.", "",
             "| weight | rows | F.linear ms | vocab_logits ms | speed-up | max abs diff |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['weight']} {r['shape'][0]}x{r['shape'][1]} | {r['rows']} | {r['linear_ms']:.2f} | "
              f"{r['vocab_logits_ms']:.2f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |" for r in records]
    (args.out / "vocab_projection.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
