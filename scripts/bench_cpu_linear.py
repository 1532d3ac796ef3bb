#!/usr/bin/env python
"""CPU micro-benchmark: ``F.linear`` against the packed-weight kernel (``training/cpu_gemm.py``)
at the row counts of decode, verify and prefill steps (``cpu_linear.linear``, called by the
target runner and the drafters, uses the kernel for every inference product); here both side
by side over many calls, to see by how much on this host.

Two workloads, with the embedded SmolLM2 target's shapes (random weights: only shapes
matter for speed):

- ``lm_head`` ``[49152, 576]`` and ``markov_w2`` ``[49152, 128]``, one weight, called
  repeatedly (the LM head does not fit in cache; ``W2``, 25 MB, may);
- ``layers``: the 7 projections of each of 30 decoder layers (q, k, v, o, gate, up, down;
  425 MB), run in order once per call, so every weight streams from memory as in a step.

The two implementations alternate call by call and the median of ``--repeats`` calls is
kept, so both see the same machine load. Writes ``<out>/<name>.json`` and ``.md``.

    python scripts/bench_cpu_linear.py --out docs/benchmarks      # ~3 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.engine.host import cpu_label
from dspark.training import cpu_gemm

LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


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


def stack_fn(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], fn):
    def run():
        for w in weights:
            fn(inputs[w.shape[1]], w)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,7,8,16,32,64,128")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="cpu_linear", help="output file stem")
    args = ap.parse_args(argv)
    if not cpu_gemm.available():
        print("the packed kernel cannot be built here (see the log): nothing to compare", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    workloads = {"lm_head": [torch.randn(49152, 576)], "markov_w2": [torch.randn(49152, 128)],
                 "layers": [torch.randn(o, i) for _ in range(args.layers) for o, i in LAYER_SHAPES]}
    packed = {id(w): cpu_gemm.pack(w) for weights in workloads.values() for w in weights}  # once, as the engine does
    records = []
    with torch.no_grad():
        for name, weights in workloads.items():
            for rows in rows_list:
                xs = {d: torch.randn(rows, d) for d in {w.shape[1] for w in weights}}
                ms = median_ms({"F.linear": stack_fn(weights, xs, F.linear),
                                "kernel": stack_fn(weights, xs, lambda x, w: cpu_gemm.gemm(x, packed[id(w)]))},
                               args.repeats)
                w0, x0 = weights[-1], xs[weights[-1].shape[1]]
                err = float((F.linear(x0, w0) - cpu_gemm.gemm(x0, packed[id(w0)])).abs().max())
                picked = "kernel"
                records.append({"workload": name, "rows": rows, "weights_mb": sum(w.numel() for w in weights) * 4 / 2**20,
                                "f_linear_ms": ms["F.linear"], "kernel_ms": ms["kernel"],
                                "speedup": ms["F.linear"] / ms["kernel"], "max_abs_diff": err,
                                "linear_uses": picked})
                print(f"{name:10s} rows {rows:4d}  F.linear {ms['F.linear']:8.2f} ms  kernel {ms['kernel']:8.2f} ms"
                      f"  x{records[-1]['speedup']:.2f}  |diff| {err:.1e}  linear() uses {picked}", flush=True)
    device = cpu_label(torch.get_num_threads())
    command = "python " + " ".join(sys.argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "device": device, "torch": torch.__version__, "repeats": args.repeats,
         "results": records}, indent=2))
    lines = ["# F.linear against the packed-weight kernel on the CPU", "", f"Command: `{command}`", "",
             f"Device: {device}, torch {torch.__version__}, median of {args.repeats} interleaved calls.", "",
             "| workload | weights MiB | rows | F.linear ms | kernel ms | speed-up | max abs diff | `linear()` uses |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['workload']} | {r['weights_mb']:.0f} | {r['rows']} | {r['f_linear_ms']:.2f} | "
              f"{r['kernel_ms']:.2f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} | {r['linear_uses']} |"
              for r in records]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
