"""Where a target-only decode step's time goes: torch.profiler over steps at 1 and 64 rows.

    .venv/bin/python scripts/profile_engine_step.py --threads 1 --attention sdpa,varlen

For each attention mode (``EngineConfig.attention``), one process-local engine per batch
size decodes the first prompts of the math / code / chat eval sets; after the prompts are
in and a few warm-up steps, ``--steps`` steps are timed and three more profiled. Prints
and writes (``--out``) the top operators by self CPU time. The modes alternate inside one
process so a shared host's load hits them alike.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.engine import threads
from dspark.engine.api import SamplingParams
from dspark.engine.host import cpu_model
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.training.config import load_target_profile
from dspark.training.data import load_eval_prompts
from dspark.training.target import load_target


def profile_step(target, prompts, rows: int, attention: str, steps: int, top: int,
                 layers: str = "auto") -> tuple[float, str]:
    eng = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=rows, attention=attention, layers=layers))
    for i in range(rows):
        prompt = prompts[i % len(prompts)]
        room = eng.max_context - len(prompt) - eng.K - 1  # the most the engine accepts: no request ends while profiled
        eng.submit(f"r{i}", prompt, SamplingParams(max_tokens=room), lambda o: None)
    while eng._queue or any(r.anchor is None for r in eng._active):
        eng.step()
    for _ in range(3):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = (time.perf_counter() - t0) / steps * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            eng.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return ms, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--attention", default="sdpa,varlen")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--layers", default="auto", help="EngineConfig.layers: auto | fused | torch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--out", default=None, help="markdown file for the tables")
    args = ap.parse_args()
    threads.configure(args.threads)
    target = load_target(load_target_profile("smollm2-135m"), device="cpu")
    prompts = [target.chat_prompt_ids(p) for task in ("math", "code", "chat") for p in load_eval_prompts(task, 22)]
    info = threads.describe()
    lines = [f"Host: {cpu_model()}, {info['threads']} intra-op thread(s) on {info['cores']} cores; "
             f"load average at start {' / '.join(f'{x:.1f}' for x in __import__('os').getloadavg())}.", ""]
    for rows in (int(r) for r in args.rows.split(",")):
        for attention in args.attention.split(","):
            ms, table = profile_step(target, prompts, rows, attention, args.steps, args.top, args.layers)
            head = (f"### {rows} row(s), attention={attention}, layers={args.layers}: {ms:.1f} ms per step "
                    f"({rows / ms * 1000:.1f} tokens/s)")
            print(head, table, sep="\n", flush=True)
            lines += [head, "", "```", table.strip(), "```", ""]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
