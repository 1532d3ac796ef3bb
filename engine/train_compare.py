"""``dspark bench-train``: DSpark vs DFlash vs Eagle3 on the same data and the same budget.

Same self-distilled records, same feature cache, same batch / anchors per sequence /
learning-rate schedule; then the same batch-1 evaluation on math, code and chat at each
temperature. Writes ``train_compare.json``, ``.md`` and a plot. It lives in the engine layer
because it evaluates with the engine (training never imports the engine).

The budget is either the same step count (``train.steps``) or, with
``train.budget_seconds``, the same training time on this machine: an Eagle3 step runs its
layer over the whole sequence, then unrolls ``ttt_steps - 1`` more passes over its scored
entries, so at equal steps it gets several times the compute of a block drafter. Each drafter's step count is then planned from a timed probe
and kept in ``<run>/budget.json``, so a rerun resumes the same plan.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path


def run_comparison(cfg, out_dir: Path, command: str, algos: tuple[str, ...] | None = None) -> dict:
    """``algos``: profile names (configs/algos/); default every registered algorithm."""
    from dspark.training.algorithms import REGISTRY
    from dspark.training.checkpoint import load_checkpoint, read_meta
    from dspark.training.config import load_algo
    from dspark.training.data import prepare_data
    from dspark.training.models import draft_layers_for
    from dspark.training.target import load_target
    from dspark.training.trainer import resolve_device, seconds_per_step, train

    from .evaluate import evaluate, print_table

    algos = REGISTRY.names() if algos is None else algos
    # on the training device: online features come from the target there, and the evaluation runs there
    device = resolve_device(cfg.train.device)
    target = load_target(cfg.target, device=device)
    prepare_data(cfg, target)
    results, timings, plans, layers = [], {}, {}, {}
    for algo in algos:
        c = copy.deepcopy(cfg)
        c.algo = load_algo(algo)
        c.name = f"{cfg.name}-{algo}"
        layers[algo] = draft_layers_for(c)
        data_link = c.run_dir / "data"
        data_link.parent.mkdir(parents=True, exist_ok=True)
        if not data_link.exists():
            data_link.symlink_to((cfg.run_dir / "data").resolve())
        if cfg.train.budget_seconds is not None:
            plans[algo] = plan_steps(c, target, cfg.train.budget_seconds, seconds_per_step)
            c.train.steps = plans[algo]["steps"]
        last = c.run_dir / "checkpoints" / "last"
        done_before = last.exists() and read_meta(last).get("step") == c.train.steps
        t0 = time.perf_counter()
        ckpt = train(c, target)
        # a drafter finished by an earlier call is only evaluated: its training time is not ours to report
        timings[algo] = None if done_before else time.perf_counter() - t0
        if algo in plans and timings[algo] is not None:
            planned = plans[algo]["steps"] * plans[algo]["seconds_per_step"]
            print(f"bench-train: {algo} trained {timings[algo]:.1f} s for a plan of {planned:.1f} s "
                  f"({plans[algo]['steps']} steps)", flush=True)
        drafter = load_checkpoint(ckpt, target)[0].to(device)
        e = cfg.eval
        results += [r for r in evaluate(target, drafter, e.tasks, e.temperatures, e.samples_per_task,
                                        e.max_new_tokens, e.seed, cfg.data.data_root)]
        # written after every drafter: a crash in a later one keeps the hours already spent
        report = comparison_report(cfg, command, results, plans, layers, timings)
        write_report(report, out_dir)
    print_table(results)
    return report


def comparison_report(cfg, command: str, results: list[dict], plans: dict, layers: dict, timings: dict) -> dict:
    """The ``train_compare.json`` document for the drafters evaluated so far."""
    steps = {a: p["steps"] for a, p in plans.items()} if plans else cfg.train.steps
    return {"target": cfg.target.name, "command": command,
            "budget": {"steps": steps, "budget_seconds": cfg.train.budget_seconds,
                       "probe_seconds_per_step": {a: p["seconds_per_step"] for a, p in plans.items()} or None,
                       "batch_size": cfg.train.batch_size,
                       "blocks_per_seq": cfg.train.blocks_per_seq, "records": cfg.data.max_prompts,
                       "draft_layers": layers, "block_size": cfg.target.block_size,
                       "train_seconds": timings},
            "results": results}


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_compare.json").write_text(json.dumps(report, indent=2))
    (out_dir / "train_compare.md").write_text(markdown_table(report))
    plot_comparison(report, out_dir / "train_compare.png")


def plan_steps(cfg, target, budget_seconds: float, probe) -> dict:
    """Steps that fit ``budget_seconds`` of training for this drafter; planned once per run dir."""
    path = cfg.run_dir / "budget.json"
    if path.is_file():
        plan = json.loads(path.read_text())
        if plan.get("budget_seconds") == budget_seconds:
            return plan
        raise RuntimeError(f"{path} plans {plan.get('budget_seconds')} s, not {budget_seconds} s: "
                           "use a new run name or delete that run directory")
    per_step = probe(cfg, target)
    plan = {"budget_seconds": budget_seconds, "seconds_per_step": per_step,
            "steps": max(cfg.train.warmup_steps + 1, int(budget_seconds / per_step))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    return plan


def markdown_table(report: dict) -> str:
    lines = [f"# Drafter comparison on {report['target']}", "", f"Command: `{report['command']}`", "",
             f"Budget: `{json.dumps(report['budget'])}`", "",
             "| drafter | task | T | accept_len | rate@1 | rate@2 | rate@3 | rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        rates = (r["accept_rate_at_k"] + [float("nan")] * 3)[:3]
        lines.append(f"| {r['drafter']} | {r['task']} | {r['temperature']:g} | {r['accept_len']:.3f} | "
                     + " | ".join(f"{x:.2f}" for x in rates) + f" | {r['rounds']} |")
    return "\n".join(lines) + "\n"


def plot_comparison(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rows = [r for r in report["results"] if r["temperature"] == t]
        tasks = list(dict.fromkeys(r["task"] for r in rows))
        drafters = list(dict.fromkeys(r["drafter"] for r in rows))
        w = 0.8 / len(drafters)
        for i, d in enumerate(drafters):
            vals = [next(r["accept_len"] for r in rows if r["task"] == tk and r["drafter"] == d) for tk in tasks]
            ax.bar([j + i * w for j in range(len(tasks))], vals, w, label=d)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks)
        ax.set_title(f"accept_len, T={t:g}")
        ax.set_ylim(0, 1.25 * max(r["accept_len"] for r in rows))  # headroom: the legend sits above the bars
        ax.legend(loc="upper right", ncols=len(drafters))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
