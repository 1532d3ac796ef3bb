#!/usr/bin/env python
"""The coupled verify rule on the CPU with and without its choice kernels (``plugins/cpu_choice.py``).

Times ``coupled.verify_coupled_packed`` as the engine calls it on one step's packed logits:
R rows of ``l + 1`` cells over the embedded target's vocabulary (49,152), greedy (T=0) and
sampled (T=1) rows, with the kernels and with torch alone (``cpu_choice.available`` patched
to False), the two alternating within each round. Per shape it reports the median over
rounds of each side's mean time per call and the median of the same-round ratios, and
checks that both sides return the same tokens.

Writes ``<out>/cpu_choice.json`` and ``<out>/cpu_choice.md``.

    python scripts/bench_cpu_choice.py --out docs/benchmarks --threads 2      # ~1 min
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
from dspark.plugins import coupled, cpu_choice

VOCAB = 49_152


def _inputs(rows: int, verify_len: int, temperature: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.full((rows,), verify_len, dtype=torch.long)
    logits = torch.randn(int((lens + 1).sum()), VOCAB, generator=g) * 2.5  # a spread like the target's
    drafts = torch.randint(0, VOCAB, (rows, max(verify_len, 1)), generator=g)
    temps = torch.full((rows,), temperature)
    return dict(draft_tokens=drafts, token_logits=logits, verify_lens=lens, temperature=temps,
                seed=torch.arange(rows) * 7 + 1, position=torch.full((rows,), 300))


def _time(fn, iters: int) -> tuple[float, object]:
    out = fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters, out


def run(shapes, rounds: int, iters: int) -> list[dict]:
    if not cpu_choice.available():
        raise SystemExit("the CPU choice kernels could not be built here (see the log): nothing to compare")
    real = cpu_choice.available
    records = []
    for rows, verify_len, temperature in tqdm(shapes, desc="shapes"):
        args = _inputs(rows, verify_len, temperature, seed=rows * 100 + verify_len)
        kernel, torch_only, same = [], [], True
        for r in range(rounds):
            order = ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel")
            got = {}
            for side in order:
                cpu_choice.available = real if side == "kernel" else (lambda: False)
                try:
                    t, out = _time(lambda: coupled.verify_coupled_packed(**args), iters)
                finally:
                    cpu_choice.available = real
                (kernel if side == "kernel" else torch_only).append(t)
                got[side] = out
            same &= torch.equal(got["kernel"].output_tokens, got["torch"].output_tokens)
        records.append(dict(rows=rows, verify_len=verify_len, temperature=temperature, vocab=VOCAB,
                            kernel_ms=1e3 * statistics.median(kernel), torch_ms=1e3 * statistics.median(torch_only),
                            speedup=statistics.median(t / k for t, k in zip(torch_only, kernel)),
                            same_tokens=bool(same), rounds=rounds, iters=iters))
    return records


def write(records: list[dict], out: Path, n_threads: int, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(cpu=platform.processor() or platform.machine(), threads=n_threads, torch=torch.__version__,
                command=command)
    (out / "cpu_choice.json").write_text(json.dumps(dict(meta=meta, records=records), indent=2) + "\n")
    lines = [f"# The coupled verify rule on the CPU: choice kernels against torch ({n_threads} threads)", "",
             f"Command: `{command}`", "",
             "`verify_coupled_packed` on one step's packed logits (rows x (drafts + 1) cells, vocabulary "
             f"{VOCAB}), the kernels of `plugins/cpu_choice.py` against torch alone, alternating within "
             "each round; ms per call are medians over rounds, the speedup the median of same-round ratios; "
             "`same tokens`: both sides emitted the same tokens in every round.", "",
             "| rows | drafts verified | T | kernels ms | torch ms | speedup | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['rows']} | {r['verify_len']} | {r['temperature']:g} | {r['kernel_ms']:.2f} | "
                     f"{r['torch_ms']:.2f} | {r['speedup']:.1f}x | {'yes' if r['same_tokens'] else 'NO'} |")
    (out / "cpu_choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[8:]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    threads.configure(args.threads)
    shapes = [(rows, l, t) for t in (0.0, 1.0) for rows, l in ((1, 0), (1, 7), (16, 3), (64, 0), (64, 3))]
    command = (f"python scripts/bench_cpu_choice.py --out {args.out} --threads {args.threads} "
               f"--rounds {args.rounds} --iters {args.iters}")
    write(run(shapes, args.rounds, args.iters), args.out, args.threads, command)


if __name__ == "__main__":
    main()
