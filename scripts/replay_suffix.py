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
from dataclasses import dataclass
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



@dataclass
class Round:
    prompt: int  # index into the rows
    verify_len: int
    accepted: int
    conf_logits: list[float]  # raw logits of the verified drafts
    host_s: float  # proposer seconds: propose + commit


def replay_prompt(prop, i: int, prompt: list[int], output: list[int], cap: int, policy: str, sps_dense) -> list[Round]:
    """Greedy rounds of one recorded output with ``prop`` drafting (slot 0); the output is exact by construction."""
    import torch

    from dspark.plugins.reference import schedule_prefix

    t0 = time.perf_counter()
    prop.reset(0, prompt)
    prop.commit(0, output[:1])  # the first token comes from prefill
    setup = time.perf_counter() - t0
    rounds, p, N = [], 1, len(output)
    while p < N:
        t0 = time.perf_counter()
        batch = prop.propose([0])
        host = time.perf_counter() - t0
        avail = min(int(batch.lens[0]), cap, N - p - 1)  # the engine's cap: max_tokens - 1 - emitted
        if policy == "full" or avail == 0:
            l = avail
        else:
            l = int(schedule_prefix(batch.confidence[:, :cap].double(), sps_dense, torch.tensor([avail]))[0])
        drafts = batch.tokens[0, :l].tolist()
        n = 0
        while n < l and drafts[n] == output[p + n]:
            n += 1
        t0 = time.perf_counter()
        prop.commit(0, output[p:p + n + 1])
        host += time.perf_counter() - t0 + (setup if not rounds else 0.0)
        rounds.append(Round(i, l, n, batch.conf_logits[0, :l].tolist(), host))
        p += n + 1
    prop.release(0)
    return rounds


def prompt_lookup_rounds(i: int, prompt: list[int], output: list[int], cap: int = 3) -> list[Round]:
    """Plain prompt lookup (the issue's reference): the most recent earlier match of the last 4..2 tokens."""
    rounds, p, N = [], 1, len(output)
    while p < N:
        seq = prompt + output[:p]
        drafts: list[int] = []
        for n in (4, 3, 2):
            tail = seq[-n:]
            for s in range(len(seq) - n - 1, -1, -1):
                if seq[s:s + n] == tail:
                    drafts = seq[s + n:s + n + cap]
                    break
            if drafts:
                break
        l = min(len(drafts), cap, N - p - 1)
        acc = 0
        while acc < l and drafts[acc] == output[p + acc]:
            acc += 1
        rounds.append(Round(i, l, acc, [], 0.0))
        p += acc + 1
    return rounds


def summarize(rounds: list[Round], step_s, host: bool = True) -> dict:
    """accepted per round, tau (accept_len), verify lens, and the expected speed-up over target-only at batch 1."""
    from dspark.engine.proposers import accept_len

    n = len(rounds)
    acc = sum(r.accepted for r in rounds)
    emitted = acc + n
    spec_s = sum(step_s(1 + r.verify_len) for r in rounds)
    host_s = sum(r.host_s for r in rounds)
    return {"rounds": n, "accepted_per_round": round(acc / n, 4), "tau": round(accept_len(acc, n), 4),
            "verified_per_round": round(sum(r.verify_len for r in rounds) / n, 4),
            "speedup_vs_target_only": round(emitted * step_s(1) / (spec_s + host_s), 4),
            "speedup_without_host_time": round(emitted * step_s(1) / spec_s, 4),
            "host_ms_per_round": round(1000 * host_s / n, 4)}


def fit_fold_temperatures(rounds: list[Round], fold_of, K: int) -> dict[int, list[float]]:
    """STS temperatures for each fold, fitted on the other fold's rounds (out of sample)."""
    import torch

    from dspark.engine.sts import calibration_report, fit_sts

    out, reports = {}, {}
    for fold in (0, 1):
        def tensors(rows):
            z = torch.zeros(len(rows), K, dtype=torch.float64)
            for j, r in enumerate(rows):
                z[j, :r.verify_len] = torch.tensor(r.conf_logits, dtype=torch.float64)
            return z, torch.tensor([r.accepted for r in rows]), torch.tensor([r.verify_len for r in rows])
        fit = [r for r in rounds if fold_of(r.prompt) != fold and r.verify_len > 0]
        held = [r for r in rounds if fold_of(r.prompt) == fold and r.verify_len > 0]
        out[fold] = fit_sts(*tensors(fit)[:2], num_proposed=tensors(fit)[2])
        z, a, l = tensors(held)
        reports[fold] = [{"position": p.position, "n": p.n, "ece_before": round(p.ece_before, 4),
                          "ece_after": round(p.ece_after, 4)} for p in calibration_report(z, a, out[fold], num_proposed=l)]
    return out, reports


def run_replay(data: dict, sps_path: Path, caps: list[int], max_depth: int, min_match: int) -> dict:
    from dspark.engine.proposers import SuffixConfig, SuffixProposer
    from dspark.engine.sps import load_sps_table

    table = load_sps_table(sps_path)
    sps_dense = table.as_tensor(64)

    def step_s(tokens: int) -> float:
        return 1.0 / float(sps_dense[tokens])
    rows = data["rows"]
    fold_of = lambda i: i % 2  # noqa: E731 - alternate prompts: both folds hold every task
    results, calibration = [], {}
    for cap in caps:
        for scope in ("request", "shared"):
            cfg = SuffixConfig(max_drafts=cap, max_depth=max_depth, min_match=min_match, scope=scope)
            prop = SuffixProposer(cfg)
            full = [r for i, row in enumerate(rows)
                    for r in replay_prompt(prop, i, row["prompt_ids"], row["output_ids"], cap, "full", sps_dense)]
            temps, report = fit_fold_temperatures(full, fold_of, cap)
            calibration[f"K={cap} {scope}"] = {"temperatures": temps, "held_out_ece": report}
            prop = SuffixProposer(cfg)
            sched = []
            for i, row in enumerate(rows):
                prop.temps = temps[fold_of(i)]
                sched += replay_prompt(prop, i, row["prompt_ids"], row["output_ids"], cap, "algorithm1", sps_dense)
            if scope == "shared":
                calibration[f"K={cap} {scope}"]["shared_index"] = {
                    "outputs": prop.shared_outputs, "tokens": prop.shared.num_tokens, "nodes": prop.shared.num_nodes,
                    "bytes": prop.shared.nbytes()}
            for policy, rounds in (("full", full), ("algorithm1", sched)):
                for task in TASKS + ("overall",):
                    sel = [r for r in rounds if task == "overall" or rows[r.prompt]["task"] == task]
                    results.append({"task": task, "max_drafts": cap, "shared_index": scope == "shared",
                                    "policy": policy, **summarize(sel, step_s)})
            print(f"K={cap} {scope}: " + ", ".join(f"{r['policy']} tau {r['tau']} x{r['speedup_vs_target_only']}"
                                                   for r in results[-8:] if r["task"] == "overall"), file=sys.stderr)
    lookup = [r for i, row in enumerate(rows) for r in prompt_lookup_rounds(i, row["prompt_ids"], row["output_ids"])]
    baseline = [{"task": task, **summarize([r for r in lookup if task == "overall" or rows[r.prompt]["task"] == task],
                                           step_s)} for task in TASKS + ("overall",)]
    return {"sps_table": str(sps_path.relative_to(ROOT)) if sps_path.is_relative_to(ROOT) else str(sps_path),
            "step_ms": {b: round(1000 * step_s(b), 2) for b in (1, 2, 4, 6, 8)},
            "max_depth": max_depth, "min_match": min_match, "results": results,
            "prompt_lookup_3": baseline, "calibration": calibration}


def run_sweep(data: dict, sps_path: Path, depths: list[int], matches: list[int], cap: int) -> list[dict]:
    """tau and speed-up over (max_depth, min_match), shared index, full verification."""
    from dspark.engine.proposers import SuffixConfig, SuffixProposer
    from dspark.engine.sps import load_sps_table

    sps_dense = load_sps_table(sps_path).as_tensor(64)
    out = []
    for D in depths:
        for m in matches:
            prop = SuffixProposer(SuffixConfig(max_drafts=cap, max_depth=D, min_match=m, scope="shared"))
            rounds = [r for i, row in enumerate(data["rows"])
                      for r in replay_prompt(prop, i, row["prompt_ids"], row["output_ids"], cap, "full", sps_dense)]
            out.append({"max_depth": D, "min_match": m, "max_drafts": cap,
                        **summarize(rounds, lambda b: 1.0 / float(sps_dense[b]))})
            print(f"sweep D={D} min_match={m}: tau {out[-1]['tau']}", file=sys.stderr)
    return out


def write_markdown(report: dict, path: Path) -> None:
    g = report["generation"]
    lines = ["# Suffix proposer: offline replay", "",
             f"Command: `{report['command']}`", "",
             f"The target's own greedy outputs ({g['target']}, {g['prompts_per_task']} prompts per task, "
             f"{g['max_tokens']} new tokens, no stop tokens, generated by our engine in target_only mode at batch "
             f"{g['batch']}) replayed against the suffix proposer (`engine/proposers/suffix.py`, max_depth "
             f"{report['max_depth']}, min_match {report['min_match']}). Greedy verification accepts a draft iff it "
             "equals the recorded token, so every round is the one the engine's greedy verify would produce; "
             "the output is the target's by construction.", "",
             f"Expected speed-up over target-only at batch 1: `sum(accepted + 1) * t(1) / sum(t(1 + l) + host)`, "
             f"step times t(B) from `{report['sps_table']}` (ms: "
             + ", ".join(f"t({b}) = {v}" for b, v in report["step_ms"].items())
             + "), host = the proposer's measured Python time per round on this (shared, loaded) CPU. "
             "`full` verifies every draft the proposer has (up to K); `algorithm1` lets the report's Algorithm 1 "
             "(`plugins.reference.schedule_prefix`) choose the verify length from the confidences, STS-calibrated "
             "on the other half of the prompts (2-fold, alternate prompts). `shared`: a ring of the earlier "
             "prompts' outputs (in order math, code, chat) is matched as well as the request's own text.", "",
             "| task | K | shared | policy | accepted/round | tau | verified/round | x target-only | x (no host time) | host ms/round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['task']} | {r['max_drafts']} | {'yes' if r['shared_index'] else 'no'} | {r['policy']} | "
                     f"{r['accepted_per_round']:.3f} | {r['tau']:.3f} | {r['verified_per_round']:.2f} | "
                     f"{r['speedup_vs_target_only']:.2f} | {r['speedup_without_host_time']:.2f} | {r['host_ms_per_round']:.2f} |")
    lines += ["", "Reference, the same outputs: plain prompt lookup (most recent 4- to 2-gram match in prompt + output, "
              "up to 3 drafts, no host time counted):", "",
              "| task | accepted/round | tau | verified/round | x target-only |", "|---|---|---|---|---|"]
    for r in report["prompt_lookup_3"]:
        lines.append(f"| {r['task']} | {r['accepted_per_round']:.3f} | {r['tau']:.3f} | {r['verified_per_round']:.2f} | "
                     f"{r['speedup_without_host_time']:.2f} |")
    lines += ["", "Shared index at the end of each run (every output in the ring, none evicted: "
              "`shared_max_tokens` is larger): " + "; ".join(
                  f"{k}: {v['shared_index']['outputs']} outputs, {v['shared_index']['tokens']} tokens, "
                  f"{v['shared_index']['nodes']} nodes, {v['shared_index']['bytes'] / 2**20:.1f} MiB"
                  for k, v in report["calibration"].items() if "shared_index" in v) + ".",
              "", "STS calibration of the confidences (temperature per draft position, fitted on one half of the "
              "prompts, ECE of the cumulative confidence on the other half, mean of the two folds):", "",
              "| run | position | rounds | ECE before | ECE after |", "|---|---|---|---|---|"]
    for k, v in report["calibration"].items():
        folds = [v["held_out_ece"][f] for f in sorted(v["held_out_ece"])]
        for pos in range(min(3, len(folds[0]))):
            rows = [f[pos] for f in folds]
            lines.append(f"| {k} | {pos + 1} | {sum(r['n'] for r in rows)} | "
                         f"{sum(r['ece_before'] for r in rows) / len(rows):.3f} | "
                         f"{sum(r['ece_after'] for r in rows) / len(rows):.3f} |")
    if report.get("sweep"):
        lines += ["", "Settings sweep (overall, shared index, full verification):", "",
                  "| max_depth | min_match | K | tau | x target-only | x (no host time) | host ms/round |",
                  "|---|---|---|---|---|---|---|"]
        for r in report["sweep"]:
            lines.append(f"| {r['max_depth']} | {r['min_match']} | {r['max_drafts']} | {r['tau']:.3f} | "
                         f"{r['speedup_vs_target_only']:.2f} | {r['speedup_without_host_time']:.2f} | "
                         f"{r['host_ms_per_round']:.2f} |")
    lines += ["", "Not measured here: the engine itself with the suffix proposer (phase 2 wires it into "
              "`SpecEngine.step`), sampled decoding (T > 0: acceptance is then p_t(draft), not a token match), "
              "and batches above 1."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-per-task", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10, help="engine batch for generating the outputs")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--sps", default=str(ROOT / "docs" / "benchmarks" / "sps_smollm2_cpu.json"))
    ap.add_argument("--caps", default="3,5,7")
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--sweep-depths", default="8,16,24,32")
    ap.add_argument("--sweep-matches", default="1,2,3")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "suffix_replay"))
    args = ap.parse_args(argv)
    data = load_or_generate(args)
    if args.generate_only:
        print(f"{len(data['rows'])} outputs, {data['seconds']} s")
        return
    report = {"command": " ".join(["python scripts/replay_suffix.py"] + (argv if argv is not None else sys.argv[1:])),
              "generation": {k: data[k] for k in ("target", "max_tokens", "batch", "prompts_per_task", "seconds")},
              **run_replay(data, Path(args.sps), [int(c) for c in args.caps.split(",")], args.max_depth, args.min_match)}
    if args.sweep_depths:
        report["sweep"] = run_sweep(data, Path(args.sps), [int(d) for d in args.sweep_depths.split(",")],
                                    [int(m) for m in args.sweep_matches.split(",")], cap=5)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
