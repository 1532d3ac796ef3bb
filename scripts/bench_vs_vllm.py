"""Side by side on one CPU: this kit's engine, transformers generate() and vLLM, token for token.

    .venv-vllm/bin/python scripts/bench_vs_vllm.py            # vLLM's venv has the kit too (scripts/setup_vllm.sh)
    .venv/bin/python scripts/bench_vs_vllm.py                 # without vLLM: says so, runs the rest

Systems: ``ours_target_only`` (``SpecEngine`` mode target_only), ``ours_spec`` (scheduled
speculation, only with ``--engine-dir`` holding a drafter), ``hf_generate``,
``vllm_target_only`` and ``vllm_ngram`` (vLLM's prompt-lookup speculation). Every system
runs in its own process, one after another (each wants every core), ``--rounds`` rounds
in rotating order; a system's row is its median round, and ``x_vllm_target_only`` the
median over rounds of its tokens/s over vLLM target-only's in the same round, so a shared
host's drift cancels.

Levels (fp32, greedy, EOS ignored so every request runs its full length; the same token
ids go to every system): one request at a time, ``--new-tokens-1`` new tokens each; and
``--concurrency`` levels with ``--new-tokens-c`` each, where requests arrive one per engine
step until that many are in flight and a finished one is replaced by the next (in flight,
arriving over time; ``generate()`` has no in-flight batching and runs static batches of
that size). Prompts: the first of each of ``eval/gsm8k``, ``eval/humaneval`` and
``eval/mt-bench`` (chat template applied), interleaved. Per level: tokens/s, p50/p99 ms
between a request's successive tokens, TTFT (submission to first token) and the share of
requests whose greedy tokens equal vLLM fp32 target-only's.

Writes ``<out-dir>/<name>.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("ours_target_only", "ours_spec", "hf_generate", "vllm_target_only", "vllm_ngram")
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# -- workload -----------------------------------------------------------------------------------
def load_prompts(per_task: int) -> list[list[int]]:
    """The first ``per_task`` prompts of math, code and chat, interleaved, as the target's chat-template ids."""
    from dspark.training.config import load_target_profile
    from dspark.training.data import load_eval_prompts
    from dspark.training.target import load_tokenizer

    tok = load_tokenizer(load_target_profile("smollm2-135m").source)
    tasks = [load_eval_prompts(t, per_task) for t in ("math", "code", "chat")]
    out = []
    for i in range(per_task):
        for texts in tasks:
            if i < len(texts):
                msgs = [{"role": "user", "content": texts[i]}]
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)  # as Target.chat_prompt_ids
                out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def levels(args) -> list[dict]:
    """(concurrency, requests, new tokens) of every level."""
    out = [{"batch": 1, "requests": args.prompts_1, "new_tokens": args.new_tokens_1}]
    for c in (int(x) for x in args.concurrency.split(",") if x):
        out.append({"batch": c, "requests": max(c, int(round(args.requests_per_slot * c))),
                    "new_tokens": args.new_tokens_c})
    return out


class Recorder:
    """Arrival times of every request's tokens -> tokens/s, ms per token, TTFT."""

    def __init__(self) -> None:
        self.submitted: dict[str, float] = {}
        self.events: dict[str, list[tuple[float, int]]] = {}
        self.tokens: dict[str, list[int]] = {}

    def submit(self, rid: str) -> None:
        self.submitted[rid] = time.perf_counter()

    def arrive(self, rid: str, new: list[int], now: float | None = None) -> None:
        if new:
            self.events.setdefault(rid, []).append((now or time.perf_counter(), len(new)))
            self.tokens.setdefault(rid, []).extend(new)

    def summary(self, seconds: float, order: list[str]) -> dict:
        import numpy as np

        lat, ttft = [], []
        for rid, ev in self.events.items():
            ttft.append((ev[0][0] - self.submitted[rid]) * 1000)
            for (a, _), (b, n) in zip(ev, ev[1:]):
                lat += [(b - a) * 1000 / n] * n  # n tokens arrived together: n samples of gap / n
        total = sum(len(t) for t in self.tokens.values())
        return {"tokens_per_s": total / seconds, "output_tokens": total, "seconds": seconds,
                "p50_ms_per_token": float(np.percentile(lat, 50)) if lat else None,
                "p99_ms_per_token": float(np.percentile(lat, 99)) if lat else None,
                "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
                "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else None,
                "outputs": [self.tokens.get(r, []) for r in order]}


def drive(prompts: list[list[int]], concurrency: int, submit, step, busy, rec: Recorder, tag: str) -> dict:
    """In flight: one new request per step while fewer than ``concurrency`` run, until all are done.
    ``submit(rid, ids)``; ``step()`` -> ids of requests that finished in it; ``busy()``."""
    pending = list(enumerate(prompts))
    running: set[str] = set()
    t0 = time.perf_counter()
    while pending or running or busy():
        if pending and len(running) < concurrency:
            i, p = pending.pop(0)
            rid = f"{tag}-{i}"
            rec.submit(rid)
            submit(rid, p)
            running.add(rid)
        for rid in step():
            running.discard(rid)
    return rec.summary(time.perf_counter() - t0, [f"{tag}-{i}" for i in range(len(prompts))])


# -- workers: one system, every level, in this process -------------------------------------------
def worker_ours(system: str, args, work: list[tuple[dict, list[list[int]]]]) -> tuple[list[dict], dict]:
    from dspark.engine import threads
    from dspark.engine.api import SamplingParams
    from dspark.engine.runtime import EngineConfig, SpecEngine, load_engine
    from dspark.training.config import load_target_profile
    from dspark.training.target import load_target

    threads.configure(args.threads)
    target = load_target(load_target_profile("smollm2-135m"), device="cpu") if system == "ours_target_only" else None
    results = []
    for lv, prompts in work:
        if system == "ours_target_only":
            eng = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=lv["batch"], threads=args.threads,
                                                        static_steps=args.static_steps))
        else:
            eng = load_engine(args.engine_dir, mode="spec", scheduler="algorithm1", max_batch=lv["batch"])
        finished: list[str] = []

        def run(ps, n, tag):
            rec = Recorder()

            def cb(o):
                rec.arrive(o.request_id, list(o.new_token_ids))
                if o.finished:
                    finished.append(o.request_id)

            def step():
                eng.step()
                done = list(finished)
                finished.clear()
                return done
            return drive(ps, lv["batch"], lambda rid, p: eng.submit(rid, p, SamplingParams(max_tokens=n), cb), step,
                         eng.has_work, rec, tag)
        run(prompts[:min(len(prompts), lv["batch"])], 4, "warmup")  # untimed: lazy inits, allocator
        results.append(run(prompts, lv["new_tokens"], f"b{lv['batch']}"))
    info = threads.describe()
    info["attention"] = "varlen" if getattr(eng.runner, "varlen", False) else "sdpa"
    return results, info


def worker_hf(args, work) -> tuple[list[dict], dict]:
    import torch
    from transformers.generation.streamers import BaseStreamer

    from dspark.engine import threads
    from dspark.training.config import load_target_profile
    from dspark.training.target import load_target

    threads.configure(args.threads)
    target = load_target(load_target_profile("smollm2-135m"), device="cpu")
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    class Stamps(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token of the whole batch."""

        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    @torch.no_grad()
    def run(prompts, n, batch, tag):
        rec = Recorder()
        t0 = time.perf_counter()
        for s in range(0, len(prompts), batch):
            chunk = prompts[s:s + batch]
            w = max(map(len, chunk))
            ids = torch.tensor([[pad] * (w - len(p)) + p for p in chunk])
            attn = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in chunk])
            rids = [f"{tag}-{s + j}" for j in range(len(chunk))]
            for r in rids:
                rec.submit(r)
            st = Stamps()
            out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, pad_token_id=pad, streamer=st)
            for j, r in enumerate(rids):
                toks = out[j, w:].tolist()
                for k, when in enumerate(st.times[1:1 + len(toks)]):
                    rec.arrive(r, [toks[k]], when)
        return rec.summary(time.perf_counter() - t0, [f"{tag}-{i}" for i in range(len(prompts))])

    results = []
    for lv, prompts in work:
        run(prompts[:1], 2, 1, "warmup")
        results.append(run(prompts, lv["new_tokens"], lv["batch"], f"b{lv['batch']}"))
    return results, threads.describe()


def worker_vllm(system: str, args, work) -> tuple[list[dict], dict]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    from vllm import LLM, SamplingParams

    from dspark.training.config import load_target_profile
    from dspark.training.target import resolve_hf_dir

    model = str(resolve_hf_dir(load_target_profile("smollm2-135m").source))  # the same fp32 weights as ours
    kw = {"speculative_config": dict(VLLM_NGRAM)} if system == "vllm_ngram" else {}
    t = time.perf_counter()
    llm = LLM(model=model, dtype="float32", gpu_memory_utilization=args.vllm_memory, max_model_len=2048, seed=0,
              enable_prefix_caching=False, max_num_seqs=max(lv["batch"] for lv, _ in work), **kw)
    start_s = time.perf_counter() - t
    eng = llm.llm_engine
    results = []
    for lv, prompts in work:
        def run(ps, n, tag):
            rec = Recorder()
            seen: dict[str, int] = {}
            sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

            def step():
                done = []
                outs = eng.step()  # blocks until the engine core sends outputs
                now = time.perf_counter()
                for o in outs:
                    ids = list(o.outputs[0].token_ids)
                    k = seen.get(o.request_id, 0)
                    rec.arrive(o.request_id, ids[k:], now)
                    seen[o.request_id] = len(ids)
                    if o.finished:
                        done.append(o.request_id)
                return done
            return drive(ps, lv["batch"], lambda rid, p: eng.add_request(rid, {"prompt_token_ids": p}, sp), step,
                         eng.has_unfinished_requests, rec, tag)
        run(prompts[:min(len(prompts), lv["batch"])], 4, "warmup")
        results.append(run(prompts, lv["new_tokens"], f"b{lv['batch']}"))
    omp = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return results, {"threads": None, "pinning": f"VLLM_CPU_OMP_THREADS_BIND={omp}", "start_s": start_s,
                     "speculative_config": kw.get("speculative_config")}


def worker_main(args) -> None:
    prompts = load_prompts(args.prompts_per_task)
    work = []
    for lv in levels(args):
        n = lv["requests"]
        work.append((lv, [prompts[i % len(prompts)] for i in range(n)]))
    if args.worker.startswith("vllm"):
        results, info = worker_vllm(args.worker, args, work)
    elif args.worker == "hf_generate":
        results, info = worker_hf(args, work)
    else:
        results, info = worker_ours(args.worker, args, work)
    for (lv, _), r in zip(work, results):
        r.update(lv)
    Path(args.out).write_text(json.dumps({"system": args.worker, "info": info, "levels": results}))


# -- orchestration -------------------------------------------------------------------------------
def vllm_importable(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--few-rounds", default="hf_generate",
                    help="systems that run only in the first --few round(s) (peers outside the headline ratio)")
    ap.add_argument("--few", type=int, default=1)
    ap.add_argument("--prompts-1", type=int, default=3, help="requests at the one-at-a-time level")
    ap.add_argument("--new-tokens-1", type=int, default=256)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--requests-per-slot", type=float, default=1.0, help="requests per level = this x concurrency")
    ap.add_argument("--new-tokens-c", type=int, default=128)
    ap.add_argument("--prompts-per-task", type=int, default=22)
    ap.add_argument("--threads", type=int, default=0, help="our engine's and generate()'s intra-op threads (0: all cores)")
    ap.add_argument("--static-steps", default="auto")
    ap.add_argument("--engine-dir", default=None, help="engine directory with a drafter, for ours_spec")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--vllm-memory", type=float, default=0.3)
    ap.add_argument("--out-dir", default="docs/benchmarks")
    ap.add_argument("--name", default="engine_vs_vllm")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        sys.exit(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    notes = []
    if any(s.startswith("vllm") for s in systems) and not vllm_importable(sys.executable):
        notes.append(f"vLLM is not importable from {sys.executable} (bash scripts/setup_vllm.sh, then run this "
                     "script with .venv-vllm/bin/python): the vLLM rows were not run and there is no ratio column.")
        systems = [s for s in systems if not s.startswith("vllm")]
    if "ours_spec" in systems and not args.engine_dir:
        notes.append("ours_spec was not run: no engine directory with a drafter was given (--engine-dir); the "
                     "repository commits no trained drafter (docs/benchmarks/decode.md used runs/big-dspark, "
                     "which is not in the tree).")
        systems.remove("ours_spec")
    print("systems:", ", ".join(systems), *(["\n" + n for n in notes]), flush=True)
    raw: dict[str, list[dict]] = {s: [] for s in systems}
    few = set(x for x in args.few_rounds.split(",") if x)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out_dir) / f".{args.name}.tmp.json"
    passthrough = [a for a in sys.argv[1:]]
    for rnd in range(args.rounds):
        k = rnd % len(systems)
        for system in systems[k:] + systems[:k]:
            if system in few and rnd >= args.few:
                continue
            t = time.perf_counter()
            subprocess.run([sys.executable, __file__, *passthrough, "--worker", system, "--out", str(tmp)], check=True)
            res = json.loads(tmp.read_text())
            raw[system].append(res)
            tps = ", ".join(f"b{lv['batch']} {lv['tokens_per_s']:.1f}" for lv in res["levels"])
            print(f"round {rnd + 1} {system}: {tps} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)
            # the report so far after every run: a run cut short still leaves its finished rounds
            write(summarise({k: v for k, v in raw.items() if v}, args, notes, rnd + 1, few), Path(args.out_dir), args.name)
    tmp.unlink(missing_ok=True)
    print((Path(args.out_dir) / f"{args.name}.md").read_text())


def summarise(raw: dict[str, list[dict]], args, notes: list[str], rounds_started: int, few: set[str]) -> dict:
    import numpy as np
    import torch

    from dspark.engine.host import cpu_model

    base = raw.get("vllm_target_only")
    ref_out = None
    if base:
        ref_out = {lv["batch"]: lv["outputs"] for lv in base[0]["levels"]}
    rows = []
    for system, runs in raw.items():
        for li, lv0 in enumerate(runs[0]["levels"]):
            per = [r["levels"][li] for r in runs]
            med = sorted(per, key=lambda x: x["tokens_per_s"])[(len(per) - 1) // 2]
            ratio = None
            if base:
                ratio = float(np.median([p["tokens_per_s"] / b["levels"][li]["tokens_per_s"] for p, b in zip(per, base)]))
            same = None
            if ref_out is not None:
                ref = ref_out[lv0["batch"]]
                # every round's outputs, against vLLM's first round
                same = float(np.mean([a == b for p in per for a, b in zip(p["outputs"], ref)]))
            info = runs[0]["info"]
            rows.append({"system": system, "batch": lv0["batch"], "requests": lv0["requests"],
                         "new_tokens": lv0["new_tokens"], "tokens_per_s": float(np.median([p["tokens_per_s"] for p in per])),
                         "tokens_per_s_rounds": [p["tokens_per_s"] for p in per], "x_vllm_target_only": ratio,
                         "p50_ms_per_token": med["p50_ms_per_token"], "p99_ms_per_token": med["p99_ms_per_token"],
                         "ttft_p50_ms": med["ttft_p50_ms"], "ttft_p99_ms": med["ttft_p99_ms"],
                         "identical_to_vllm_fp32": same, "threads": info.get("threads"),
                         "pinning": info.get("pinning")})
    ours = raw.get("ours_target_only")
    threads = ours[0]["info"]["threads"] if ours else torch.get_num_threads()
    return {"host": cpu_model(), "threads": threads, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "rounds": args.rounds, "rounds_started": rounds_started,
            "rounds_per_system": {s: len(r) for s, r in raw.items()}, "notes": notes, "systems_info": {s: r[0]["info"] for s, r in raw.items()},
            "results": rows}


def write(report: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)
    lines = [f"# Engine vs vLLM ({report['host']}, our threads: {report['threads']})", "",
             f"Command: `{report['command']}`", "",
             "| system | batch | requests x new tokens | tokens/s | x vLLM target-only | p50 ms/token | p99 ms/token | "
             "TTFT p50 ms | = vLLM fp32 | threads |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["results"], key=lambda r: (r["batch"], r["system"])):
        same = "-" if r["identical_to_vllm_fp32"] is None else f"{100 * r['identical_to_vllm_fp32']:.0f}%"
        thr = r["threads"] if r["threads"] is not None else "1 model + 1 front end (vLLM auto)"
        lines.append(f"| {r['system']} | {r['batch']} | {r['requests']} x {r['new_tokens']} | {f(r['tokens_per_s'])} | "
                     f"{f(r['x_vllm_target_only'], '.2f')} | {f(r['p50_ms_per_token'])} | {f(r['p99_ms_per_token'])} | "
                     f"{f(r['ttft_p50_ms'], '.0f')} | {same} | {thr} |")
    per = ", ".join(f"{s} {n}" for s, n in report["rounds_per_system"].items())
    lines += ["", f"Rounds run: {per} (of {report['rounds']} planned); systems in rotating order, each in its own process; tokens/s is the "
              "median round's, `x vLLM target-only` the median of same-round ratios; the latency columns come from "
              "the median round. `= vLLM fp32`: share of requests (all rounds) whose greedy tokens equal vLLM "
              "fp32 target-only's."]
    lines += [""] + [f"- {n}" for n in report["notes"]]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(report, out_dir / f"{name}.png")


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    batches = sorted({r["batch"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5))
    for ax, b in zip(axes if len(batches) > 1 else [axes], batches):
        vals = [next((r["tokens_per_s"] for r in rows if r["system"] == s and r["batch"] == b), 0) for s in systems]
        ax.bar(range(len(systems)), vals, color=[f"C{i}" for i in range(len(systems))])
        ax.set_xticks(range(len(systems)), systems, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{b} concurrent" if b > 1 else "one at a time")
        ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
