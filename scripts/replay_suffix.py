"""Offline replay of the suffix proposer against the embedded target's own greedy outputs.

What it measures: how many drafts a suffix proposer (``dspark.engine.proposers.suffix``)
would get accepted per verify round if it drafted for the target's greedy decoding, and
what that is worth on this CPU given the SPS table. Greedy verification accepts a draft
iff it equals the target's next token, so replaying a recorded greedy output is exact:
the rounds (drafts, accepted counts, emitted tokens) are what the engine's greedy verify
would produce with this proposer, and the output is the recorded one by construction.

1. ``generate``: the first ``--prompts-per-task`` prompts of math / code / chat, chat
   templated, decoded greedily for ``--max-tokens`` new tokens by our engine in
   ``target_only`` mode (no stop tokens, like ``dspark bench``), cached as JSON under
   ``runs/replay_suffix/`` (regenerated only with ``--regenerate``).
2. ``replay``: for each draft cap K, with and without the shared index (the shared index
   holds the outputs of the prompts replayed before, in order math, code, chat), rounds
   of: propose up to K drafts from the committed history, verify (greedy, against the
   recorded tokens), commit the accepted drafts plus the target's token. Two verify-length
   rules: ``full`` (verify every draft the proposer has, up to K) and ``algorithm1`` (the
   report's Algorithm 1, ``plugins.reference.schedule_prefix``, on the proposer's
   confidences with STS temperatures fitted on the other half of the prompts).
3. expected speed-up over target-only at batch 1: ``sum(accepted + 1) * t(1) /
   sum(t(1 + l) + proposer seconds)`` with ``t(B) = 1 / SPS(B)`` from the SPS table
   (``engine/sps.py``'s loader and dense expansion) and the proposer's measured host time.

Reproduce::

    .venv/bin/python scripts/replay_suffix.py            # docs/benchmarks/suffix_replay.{json,md}
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("math", "code", "chat")


def generate(cache: Path, prompts_per_task: int, max_tokens: int, batch: int) -> dict:
    """Greedy target-only outputs of the eval prompts -> {"rows": [{task, prompt_ids, output_ids}]}."""
    from dspark.engine.api import SamplingParams
    from dspark.engine.runtime import EngineConfig, SpecEngine
    from dspark.training.config import load_target_profile
    from dspark.training.data import load_eval_prompts
    from dspark.training.target import load_target

    target = load_target(load_target_profile("smollm2-135m"))
    rows = [{"task": task, "prompt_ids": target.chat_prompt_ids(p)}
            for task in TASKS for p in load_eval_prompts(task, prompts_per_task)]
    eng = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=batch, max_context=2048))
    outs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=max_tokens)  # no stop tokens: every request runs max_tokens (as dspark bench)
    t0 = time.perf_counter()
    for i, r in enumerate(rows):
        eng.submit(str(i), r["prompt_ids"], params, lambda o: outs.setdefault(o.request_id, []).extend(o.new_token_ids))
    eng.run_until_done()
    for i, r in enumerate(rows):
        r["output_ids"] = outs[str(i)]
    data = {"target": target.profile.name, "max_tokens": max_tokens, "batch": batch, "prompts_per_task": prompts_per_task,
            "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(data))
    return data


def load_or_generate(args) -> dict:
    cache = ROOT / "runs" / "replay_suffix" / f"greedy_{args.prompts_per_task}x{args.max_tokens}.json"
    if cache.is_file() and not args.regenerate:
        return json.loads(cache.read_text())
    print(f"generating greedy outputs -> {cache}", file=sys.stderr)
    return generate(cache, args.prompts_per_task, args.max_tokens, args.batch)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-per-task", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10, help="engine batch for generating the outputs")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--generate-only", action="store_true")
    args = ap.parse_args(argv)
    data = load_or_generate(args)
    if args.generate_only:
        print(f"{len(data['rows'])} outputs, {data['seconds']} s")
        return


if __name__ == "__main__":
    main()
