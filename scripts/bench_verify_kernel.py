#!/usr/bin/env python
"""Micro-benchmark of the verify-step CUDA kernels against the PyTorch reference.

For R in {1, 16, 256, 1024}, K in {7, 15}, V = 151936, logits in bf16 and fp32 it times, on
one GPU, with CUDA events:

- ``kernel_us``: ``ops.verify`` (sampled rows, temperature 1, every draft verified: the
  costliest case) and ``kernel_greedy_us`` (greedy rows);
- ``scheduler_us``: ``ops.schedule_prefix`` for the same R, K;
- ``reference_us``: ``reference.verify`` on the same GPU tensors (fewer repetitions);
- ``limit_us``: the physical limit, the bytes of the logits [R, K+1, V] read once divided by
  the device-to-device copy bandwidth measured in the same run ((read + write) / time).

Writes ``<out>/verify_kernel.json`` (a list of records with R, K, vocab, dtype, kernel_us,
scheduler_us, reference_us, limit_us, device, ...) and ``<out>/verify_kernel.md``.

    python scripts/bench_verify_kernel.py --out docs/benchmarks      # ~1-2 min on an H200
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dspark.plugins import ops, reference


def time_cuda(fn, iters: int, warmup: int = 2) -> float:
    """Mean microseconds per call of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), iters=20, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)


def make_case(R: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    """Target logits, draft probabilities (same dtype), drafts near the target's argmax."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(R, K + 1, V, generator=g, device="cuda", dtype=dtype)
    draft_logits = logits[:, :K].float() + 0.5 * torch.randn(R, K, V, generator=g, device="cuda")
    draft_probs = torch.softmax(draft_logits, -1).to(dtype)
    drafts = draft_logits.argmax(-1)
    del draft_logits
    lens = torch.full((R,), K, dtype=torch.long, device="cuda")
    conf = torch.rand(R, K, generator=g, device="cuda")
    return drafts, draft_probs, logits, lens, conf


def bench_one(R: int, K: int, V: int, dtype: torch.dtype, bw: float, ref_iters: int) -> dict:
    drafts, probs, logits, lens, conf = make_case(R, K, V, dtype)
    temp = torch.ones(R, device="cuda")
    greedy = torch.zeros(R, device="cuda")
    seed = torch.arange(R, device="cuda")
    offset = torch.zeros(R, dtype=torch.long, device="cuda")
    sps = (1.0 / (1.0 + torch.arange(R * (K + 1) + 1, dtype=torch.float64) / 512.0)).cuda()

    kernel_us = time_cuda(lambda: ops.verify(drafts, probs, logits, lens, temp, seed=seed, offset=offset), iters=10)
    greedy_us = time_cuda(lambda: ops.verify(drafts, None, logits, lens, greedy), iters=10)
    sched_us = time_cuda(lambda: ops.schedule_prefix(conf, sps), iters=50)
    ref_us = time_cuda(lambda: reference.verify(drafts, probs, logits, lens, temp, seed=seed, offset=offset),
                       iters=ref_iters, warmup=1)
    logits_bytes = logits.numel() * logits.element_size()
    rec = {
        "R": R, "K": K, "vocab": V, "dtype": str(dtype).replace("torch.", ""),
        "kernel_us": round(kernel_us, 2), "kernel_greedy_us": round(greedy_us, 2),
        "scheduler_us": round(sched_us, 2), "reference_us": round(ref_us, 1),
        "limit_us": round(logits_bytes / bw * 1e6, 2),
        "device": torch.cuda.get_device_name(),
    }
    rec["kernel_over_limit"] = round(rec["kernel_us"] / rec["limit_us"], 2)
    rec["speedup_vs_reference"] = round(rec["reference_us"] / rec["kernel_us"], 1)
    del drafts, probs, logits, lens, conf
    torch.cuda.empty_cache()
    return rec


def write_markdown(records: list[dict], meta: dict, path: Path) -> None:
    lines = [
        "# Verify-step kernel micro-benchmark",
        "",
        f"Device: {meta['device']}; torch {meta['torch']}, CUDA {meta['cuda']}; copy bandwidth "
        f"{meta['copy_bandwidth_GBps']:.0f} GB/s (read + write), measured in the same run.",
        "",
        "Reproduce: `bash scripts/gpu_check.sh` (or `python scripts/bench_verify_kernel.py --out docs/benchmarks`).",
        "Sampled rows at temperature 1 with every draft verified; `limit` = bytes of the logits [R, K+1, V] "
        "read once / copy bandwidth; times in microseconds (CUDA events, launch included).",
        "",
        "| R | K | V | dtype | kernel (sampled) | kernel (greedy) | scheduler | reference | limit | kernel/limit | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['R']} | {r['K']} | {r['vocab']} | {r['dtype']} | {r['kernel_us']} | {r['kernel_greedy_us']} "
                     f"| {r['scheduler_us']} | {r['reference_us']} | {r['limit_us']} | {r['kernel_over_limit']} "
                     f"| {r['speedup_vs_reference']}x |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="folder for verify_kernel.{json,md}")
    ap.add_argument("--R", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--K", type=int, nargs="+", default=[7, 15])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new cases after this long")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify_kernel: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    if not ops.load_extension(verbose=False):
        print(f"bench_verify_kernel: extension failed to build: {ops._state['error']}", file=sys.stderr)
        return 1
    build_s = time.time() - t0
    bw = copy_bandwidth()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "copy_bandwidth_GBps": bw / 1e9, "extension_build_s": round(build_s, 1), "host": platform.node()}
    print(f"device {meta['device']}, copy bandwidth {bw / 1e9:.0f} GB/s, extension ready in {build_s:.0f} s", flush=True)
    records = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for K in args.K:
            for R in args.R:
                if time.time() - t0 > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s reached: skipping R={R} K={K} {dtype_name}", flush=True)
                    continue
                ref_iters = 3 if R >= 256 else 5
                try:
                    rec = bench_one(R, K, args.vocab, dtype, bw, ref_iters)
                except torch.cuda.OutOfMemoryError as exc:
                    print(f"R={R} K={K} {dtype_name}: out of memory ({exc})", flush=True)
                    torch.cuda.empty_cache()
                    continue
                records.append(rec)
                print(json.dumps(rec), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify_kernel.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    write_markdown(records, meta, args.out / "verify_kernel.md")
    print(f"wrote {args.out / 'verify_kernel.json'} and .md ({len(records)} cases, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
