#!/usr/bin/env python
"""Page faults and time per decode step with and without ``engine/host_memory.py`` (freed host
memory kept in the process, ``EngineConfig.retain_host_memory``).

The setting is process-wide, so every run is a fresh process: our target-only engine on the
embedded SmolLM2, ``--batch`` requests in flight (eval prompts, math / code / chat in turn),
``--new-tokens`` each at temperature ``--temperature`` (seeded). Per decode step it records the
wall time and the process's minor page faults (``getrusage``); a run reports their medians over
its decode steps. The two settings alternate in rotating order for ``--rounds`` rounds, and the
ratios are medians of same-round ratios. Writes ``<out>/host_memory.json`` and ``.md``.

    python scripts/bench_host_memory.py --out docs/benchmarks      # ~5 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"retained": True, "returned": False}  # name -> EngineConfig.retain_host_memory


def worker(retain: bool, batch: int, new_tokens: int, temperature: float, threads: int) -> dict:
    """One run in this process -> medians per decode step (ms, minor faults) and tokens/s."""
    from dspark.engine.api import SamplingParams
    from dspark.engine.runtime import EngineConfig, SpecEngine
    from dspark.training.config import load_target_profile
    from dspark.training.data import load_eval_prompts
    from dspark.training.target import load_target

    target = load_target(load_target_profile("smollm2-135m"))
    engine = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=batch, threads=threads,
                                                   retain_host_memory=retain))
    per_task = -(-batch // 3)
    pools = [load_eval_prompts(t, per_task) for t in ("math", "code", "chat")]
    prompts = [p for trio in zip(*pools) for p in trio][:batch]
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", target.chat_prompt_ids(p), SamplingParams(max_tokens=new_tokens, temperature=temperature,
                                                                         seed=i), lambda out: None)
    ms, faults, t0 = [], [], time.perf_counter()
    while engine.has_work():
        decode_before = engine.stats.decode_steps
        f0, s0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.step()
        if engine.stats.decode_steps > decode_before:
            ms.append(1e3 * (time.perf_counter() - s0))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    seconds = time.perf_counter() - t0
    return {"decode_steps": len(ms), "ms_per_step": statistics.median(ms), "faults_per_step": statistics.median(faults),
            "faults_per_step_mean": statistics.fmean(faults), "tokens_per_s": batch * new_tokens / seconds}


def run_once(setting: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", setting, "--batch", str(args.batch), "--new-tokens",
           str(args.new_tokens), "--temperature", str(args.temperature), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_host_memory: the {setting} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = ["# Host memory kept in the process: decode steps with and without (`engine/host_memory.py`)", "",
             f"Command: `{report['command']}`", "",
             f"Host: {report['host']}; our target-only engine on the embedded SmolLM2, "
             f"{report['batch']} requests in flight x {report['new_tokens']} new tokens, "
             f"T = {report['temperature']:g}; "
             f"{report['rounds']} rounds, the two settings alternating in rotating order, a fresh process each.", "",
             "| setting | ms per decode step | minor faults per step (median) | (mean) | tokens/s |",
             "|---|---|---|---|---|"]
    for name in SETTINGS:
        rs = [r[name] for r in report["runs"]]
        lines.append(f"| {name} | {statistics.median(r['ms_per_step'] for r in rs):.1f} | "
                     f"{statistics.median(r['faults_per_step'] for r in rs):.0f} | "
                     f"{statistics.median(r['faults_per_step_mean'] for r in rs):.0f} | "
                     f"{statistics.median(r['tokens_per_s'] for r in rs):.1f} |")
    lines += ["", f"Retained / returned, medians of same-round ratios: step time **{s['step_time_ratio']:.3f}x**, "
                  f"tokens/s **{s['tokens_per_s_ratio']:.3f}x** (rounds: "
                  + ", ".join(f"{x:.3f}" for x in s["tokens_per_s_ratio_rounds"]) + ")."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(SETTINGS[args.worker], args.batch, args.new_tokens, args.temperature, args.threads)))
        return 0
    from tqdm import tqdm

    from dspark.engine.host import cpu_label

    names = list(SETTINGS)
    runs = []
    with tqdm(total=args.rounds * len(names), desc="host memory runs", unit="run") as bar:
        for r in range(args.rounds):
            got = {}
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotating order
                got[name] = run_once(name, args)
                bar.update(1)
            runs.append(got)
    tok = [g["retained"]["tokens_per_s"] / g["returned"]["tokens_per_s"] for g in runs]
    step = [g["retained"]["ms_per_step"] / g["returned"]["ms_per_step"] for g in runs]
    report = {"command": "python scripts/bench_host_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": cpu_label(args.threads), "threads": args.threads, "batch": args.batch,
              "new_tokens": args.new_tokens,
              "temperature": args.temperature, "rounds": args.rounds, "runs": runs,
              "summary": {"tokens_per_s_ratio": statistics.median(tok), "tokens_per_s_ratio_rounds": tok,
                          "step_time_ratio": statistics.median(step)}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (args.out / "host_memory.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
