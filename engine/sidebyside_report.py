"""The side-by-side benchmark's arithmetic and its results files (pure: no engine, no timing).

``engine/sidebyside.py`` runs every system round by round and hands this module what each
run recorded: per level (batch, temperature) the wall time of the run and one record per
request (task, tokens, time in flight, TTFT, gaps between its token arrivals, and for our
engine its verify rounds and accepted drafts). From those it derives:

- ``tokens_per_s`` of a run: output tokens / wall seconds (every request, all tasks);
- per task, ``request_tokens_per_s``: the task's tokens / the summed in-flight seconds of its
  requests (the rate one request of that task sees; one request at a time it equals the
  task's throughput);
- ratios to a baseline system as the median over rounds of the same-round ratios
  (``paired_median_ratio``): runs of one round are minutes apart, which cancels most of a
  shared host's drift, while a ratio of medians would mix rounds;
- identity: the share of requests whose tokens equal the reference system's (greedy: any
  two exact systems; T=1: our engine under the coupled rule against our target-only with
  the same seeds, ``docs/runtime.md`` "Seeded sampling");
- ``accept_len`` by the one definition (``engine/proposers/stats.py``).

Results file (``<name>.json``): ``{"host", "threads", "command", ..., "results": [...],
"task_results": [...]}``. ``results`` has one entry per (system, batch, temperature) over
all tasks with the keys of the engine-vs-vLLM issue (``system``, ``batch``, ``new_tokens``,
``tokens_per_s``, ``x_vllm_target_only``, ``p50_ms_per_token``, ``ttft_p50_ms``,
``identical_to_vllm_fp32``) and more (``RESULT_KEYS``); ``task_results`` the same per task.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from .proposers.stats import accept_len

__all__ = ["TASKS", "RESULT_KEYS", "REQUIRED_RESULT_KEYS", "paired_median_ratio", "identical_share", "split_by_task",
           "median", "percentile", "summarise", "check_results_schema", "write_report"]

TASKS = ("math", "code", "chat")
OVERALL = "overall"
BASELINE_OURS = "ours_target_only"
BASELINE_VLLM = "vllm_target_only"
# the results-file keys fixed by the engine-vs-vLLM issue, every one present in every entry
REQUIRED_RESULT_KEYS = ("system", "batch", "new_tokens", "tokens_per_s", "x_vllm_target_only", "p50_ms_per_token",
                        "ttft_p50_ms", "identical_to_vllm_fp32")
RESULT_KEYS = REQUIRED_RESULT_KEYS + (
    "task", "temperature", "requests", "tokens_per_s_rounds", "request_tokens_per_s", "x_target_only",
    "p99_ms_per_token", "ttft_p99_ms", "identical_to_target_only", "accept_len", "rounds", "threads", "pinning",
    "proposers")


# -- arithmetic -------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    """The median (mean of the middle two for an even count); None for no values."""
    v = sorted(values)
    if not v:
        return None
    m = len(v) // 2
    return float(v[m]) if len(v) % 2 else (v[m - 1] + v[m]) / 2.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default rule); None for no values."""
    v = sorted(values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def same_round_ratios(values: Sequence[float | None], base: Sequence[float | None]) -> list[float]:
    """``values[i] / base[i]`` per round: rounds pair by index, rounds where either side is
    missing (None, or past the shorter list) are left out."""
    return [v / b for v, b in zip(values, base) if v is not None and b]


def paired_median_ratio(values: Sequence[float | None], base: Sequence[float | None]) -> float | None:
    """Median of ``same_round_ratios``; None when no round pairs."""
    return median(same_round_ratios(values, base))


def identical_share(outputs: Iterable[Sequence[Sequence[int]]], reference: Sequence[Sequence[int]]) -> float | None:
    """Share of requests, over every round's ``outputs`` (each a list of token lists in request
    order), whose tokens equal ``reference``'s for the same request; None with nothing to compare."""
    same = total = 0
    for out in outputs:
        if len(out) != len(reference):
            raise ValueError(f"identity: {len(out)} outputs against {len(reference)} reference requests")
        for a, b in zip(out, reference):
            same += list(a) == list(b)
            total += 1
    return same / total if total else None


def split_by_task(requests: Sequence[dict]) -> dict[str, list[dict]]:
    """Request records grouped by their ``task`` (in ``TASKS`` order, then any other), plus ``overall``."""
    groups: dict[str, list[dict]] = {}
    for r in requests:
        groups.setdefault(r["task"], []).append(r)
    order = [t for t in TASKS if t in groups] + sorted(t for t in groups if t not in TASKS)
    out = {t: groups[t] for t in order}
    out[OVERALL] = list(requests)
    return out


def _measures(requests: Sequence[dict], seconds: float | None) -> dict:
    """What one run says about a group of its requests."""
    tokens = sum(len(r["tokens"]) for r in requests)
    busy = sum(r["seconds"] for r in requests)
    gaps = [g for r in requests for g in r.get("gaps_ms", [])]
    ttft = [r["ttft_ms"] for r in requests if r.get("ttft_ms") is not None]
    rounds = [r.get("rounds") for r in requests]
    acc = [r.get("accepted") for r in requests]
    al = None
    if rounds and all(x is not None for x in rounds) and all(x is not None for x in acc) and sum(rounds):
        al = accept_len(sum(acc), sum(rounds))
    return {"tokens": tokens, "tokens_per_s": tokens / seconds if seconds else None,
            "request_tokens_per_s": tokens / busy if busy > 0 else None,
            "p50_ms_per_token": percentile(gaps, 50), "p99_ms_per_token": percentile(gaps, 99),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "accept_len": al, "rounds": sum(x or 0 for x in rounds)}


def _level_key(lv: dict) -> tuple[int, float]:
    return int(lv["batch"]), float(lv["temperature"])


def summarise(raw: dict[str, list[dict]], few: Iterable[str] = ()) -> tuple[list[dict], list[dict]]:
    """``raw[system]``: that system's runs, one per round it ran (``{"info", "levels": [{"batch",
    "temperature", "requests", "new_tokens", "seconds", "request_records": [...], "proposers": ...}]}``)
    -> (``results``: one entry per system, batch and temperature over all tasks; ``task_results``:
    the same per task). A system's columns come from its median round by the ratio's measure;
    ``*_rounds`` keep every round."""
    ours_base = raw.get(BASELINE_OURS, [])
    vllm_base = raw.get(BASELINE_VLLM, [])

    def levels_of(runs: list[dict], key: tuple[int, float]) -> list[dict | None]:
        return [next((lv for lv in r["levels"] if _level_key(lv) == key), None) for r in runs]

    results, task_results = [], []
    for system, runs in raw.items():
        if not runs:
            continue
        keys = list(dict.fromkeys(_level_key(lv) for r in runs for lv in r["levels"]))
        info = runs[0].get("info", {})
        for key in keys:
            per = [lv for lv in levels_of(runs, key) if lv is not None]
            ob, vb = levels_of(ours_base, key), levels_of(vllm_base, key)
            lv0 = per[0]
            greedy = key[1] == 0.0
            for task in split_by_task(lv0["request_records"]):
                measure = "tokens_per_s" if task == OVERALL else "request_tokens_per_s"

                def by_round(levels: list[dict | None]) -> list[float | None]:
                    out = []
                    for lv in levels:
                        if lv is None:
                            out.append(None)
                            continue
                        group = split_by_task(lv["request_records"]).get(task, [])
                        out.append(_measures(group, lv["seconds"] if task == OVERALL else None)[measure])
                    return out
                mine = by_round(levels_of(runs, key))
                runs_m = [_measures(split_by_task(lv["request_records"]).get(task, []), lv["seconds"]) for lv in per]
                vals = [m[measure] for m in runs_m]
                mid = sorted(range(len(vals)), key=lambda i: vals[i] or 0.0)[(len(vals) - 1) // 2]
                row = dict(runs_m[mid])
                if task != OVERALL:
                    row["tokens_per_s"] = None  # a task's throughput is not separable inside a mixed batch
                row.update({
                    "system": system, "task": task, "batch": key[0], "temperature": key[1],
                    "requests": len(split_by_task(lv0["request_records"])[task]), "new_tokens": lv0["new_tokens"],
                    "tokens_per_s_rounds": [m[measure] for m in runs_m], "measure": measure,
                    "x_target_only": paired_median_ratio(mine, by_round(ob)) if ours_base else None,
                    "x_vllm_target_only": paired_median_ratio(mine, by_round(vb)) if vllm_base else None,
                    "threads": info.get("threads"), "pinning": info.get("pinning"),
                    "proposers": (per[mid].get("proposers") or {}).get(task),
                    "round_ms": (per[mid].get("round_ms") or {}).get(task)})
                if task == OVERALL:
                    row["tokens_per_s"] = median([v for v in vals if v is not None])
                    row["step_ms"] = per[mid].get("step_ms")
                row["identical_to_target_only"] = _identity(per, ob, task) if ours_base else None
                row["identical_to_vllm_fp32"] = _identity(per, vb, task) if (vllm_base and greedy) else None
                if system.startswith("vllm") or system.startswith("hf"):
                    # other samplers' T=1 streams are not ours: identity is defined for greedy only
                    row["identical_to_target_only"] = row["identical_to_target_only"] if greedy else None
                (results if task == OVERALL else task_results).append(row)
    return results, task_results


def _identity(per: list[dict], base: list[dict | None], task: str) -> float | None:
    """Every round of ``per`` against the baseline's first round, over ``task``'s requests."""
    ref = next((lv for lv in base if lv is not None), None)
    if ref is None:
        return None

    def outs(lv: dict) -> list[list[int]]:
        return [r["tokens"] for r in split_by_task(lv["request_records"]).get(task, [])]
    return identical_share([outs(lv) for lv in per], outs(ref))


def check_results_schema(report: dict) -> None:
    """Raise ``ValueError`` naming what is missing when ``report`` lacks the results-file keys."""
    for k in ("host", "threads", "command", "results"):
        if k not in report:
            raise ValueError(f"results file: no {k!r} key (keys: {sorted(report)})")
    for i, row in enumerate(report["results"]):
        missing = [k for k in REQUIRED_RESULT_KEYS if k not in row]
        if missing:
            raise ValueError(f"results[{i}] ({row.get('system')}): missing {missing}")
        if not isinstance(row["batch"], int) or not isinstance(row["new_tokens"], int):
            raise ValueError(f"results[{i}]: batch and new_tokens must be integers")


# -- files ----------------------------------------------------------------------------------------------
def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _proposer_cell(stats: dict | None) -> str:
    """``suffix 0.62/r (l 0:12 1:30 3:40)``: accepted drafts per round and verify-length counts by proposer."""
    if not stats:
        return "-"
    parts = []
    for name, s in stats.items():
        if name == "none" or not s.get("rounds"):
            continue
        hist = " ".join(f"{l}:{n}" for l, n in enumerate(s.get("verify_len_hist", [])) if n)
        parts.append(f"{name} {s['accepted'] / s['rounds']:.2f}/r ({s['rounds']} r; l {hist})")
    plain = stats.get("none", {}).get("rounds")
    if plain:
        parts.append(f"no draft {plain} r")
    return ", ".join(parts) or "-"


def _round_ms_cell(ms: dict | None) -> str:
    """``1.2 / 0.1 / 40.3 / 1.5 = 43.1``: ms per verify round by phase and their sum."""
    if not ms:
        return "-"
    return " / ".join(_f(ms.get(p)) for p in ("neural", "suffix", "verify", "host")) + f" = {_f(ms.get('total'))}"


def write_report(report: dict, out_dir: Path, name: str) -> None:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir``."""
    check_results_schema(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    lines = [f"# {report.get('title', 'Side-by-side decode')} ({report['host']}, our threads: {report['threads']})", "",
             f"Command: `{report['command']}`", "",
             "| system | batch | T | requests x new tokens | tokens/s | x ours target-only | x vLLM target-only | "
             "accept_len | p50 ms/token | p99 ms/token | TTFT p50 ms | = ours target-only | = vLLM fp32 | threads |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(report.get("systems", []))}

    def key(r):
        return (r["temperature"], r["batch"], order.get(r["system"], 99), r["system"], TASKS.index(r["task"])
                if r["task"] in TASKS else -1)
    for r in sorted(report["results"], key=key):
        thr = r["threads"] if r["threads"] is not None else "vLLM auto"
        lines.append(f"| {r['system']} | {r['batch']} | {r['temperature']:g} | {r['requests']} x {r['new_tokens']} | "
                     f"{_f(r['tokens_per_s'])} | {_f(r['x_target_only'], '.2f')} | {_f(r['x_vllm_target_only'], '.2f')} | "
                     f"{_f(r['accept_len'], '.2f')} | {_f(r['p50_ms_per_token'])} | {_f(r['p99_ms_per_token'])} | "
                     f"{_f(r['ttft_p50_ms'], '.0f')} | {_pct(r['identical_to_target_only'])} | "
                     f"{_pct(r['identical_to_vllm_fp32'])} | {thr} |")
    per = ", ".join(f"{s} {n}" for s, n in report.get("rounds_per_system", {}).items())
    settings = report.get("settings", {})
    how = {"lockstep": "a process per level and round runs our systems in lockstep (one engine step of each in "
                       "turn on one loaded target, each timed by its own steps only, so a slow spell of the host falls "
                       "on both sides of our ratios), a process per peer and level, a level's runs back to back",
           "levels": "a process per system and level, a level's systems back to back"}.get(
               settings.get("order"), "a process per system and round")
    lines += ["", f"Rounds run: {per} (of {report.get('rounds')} planned); systems in rotating order, {how}, a "
              "fresh engine for every run. tokens/s is the median round's; `x ...` the median of same-round "
              "ratios; the other columns come from the median round. `= ours target-only` / `= vLLM fp32`: share of "
              "requests (every round) whose tokens equal that system's first round (T=1: our rows under the seeded "
              "coupled rule, the same seeds as our target-only; other samplers have no defined identity at T=1)."]
    if settings.get("history"):
        lines += ["", "History: when a level starts, the shared suffix index of `ours_suffix` / `ours_hybrid` "
                  f"holds the outputs of {settings['history']} earlier requests ({settings.get('history_tokens')} new "
                  "tokens each, at the level's temperature, eval-set prompts that no measured request uses), as a "
                  "server's index would after serving them. No other system keeps state across requests."]
    if report.get("task_results"):
        lines += ["", "## By task", "",
                  "Per task, tokens/s is the rate one request sees (the task's tokens over its requests' summed time in "
                  "flight; one request at a time this is the task's throughput), and `x` its median same-round ratio. "
                  "`ms/round` (our engine): a verify round's time split into the drafter pass, the suffix lookups, the "
                  "target's verify pass and the host's other work, each round a row's equal share of its step (one "
                  "request at a time, the step itself); tokens per round are accept_len.", "",
                  "| system | batch | T | task | requests | tokens/s per request | x ours target-only | x vLLM target-only | "
                  "accept_len | = ours target-only | = vLLM fp32 | ms/round: neural / suffix / verify / host | "
                  "accepted per round by proposer (verify lengths) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(report["task_results"], key=key):
            lines.append(f"| {r['system']} | {r['batch']} | {r['temperature']:g} | {r['task']} | {r['requests']} | "
                         f"{_f(r['request_tokens_per_s'])} | {_f(r['x_target_only'], '.2f')} | "
                         f"{_f(r['x_vllm_target_only'], '.2f')} | {_f(r['accept_len'], '.2f')} | "
                         f"{_pct(r['identical_to_target_only'])} | {_pct(r['identical_to_vllm_fp32'])} | "
                         f"{_round_ms_cell(r.get('round_ms'))} | {_proposer_cell(r['proposers'])} |")
    steps = [r for r in report["results"] if r.get("step_ms")]
    if steps:
        lines += ["", "## Where a decode step's time goes (our engine, median round)", "",
                  "ms per decode step: `neural` the drafter pass, `suffix` the suffix lookups (host), `verify` the target "
                  "forward (with any prompt chunks fused into it) and the verify rule, `host` the rest (scheduling, "
                  "commit, emit); `neural on` the share of "
                  "decode steps that ran the neural pass, `rows` the mean rows per neural pass, `suffix on` the share "
                  "that ran the suffix lookups (the rest the gates skipped); `prefill` is prefill time per decode step.", "",
                  "| system | batch | T | decode steps | ms/step | neural | suffix | verify | host | prefill | "
                  "neural on | rows | suffix on | accepted per round by proposer (verify lengths) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(steps, key=key):
            s = r["step_ms"]
            lines.append(f"| {r['system']} | {r['batch']} | {r['temperature']:g} | {s['decode_steps']} | "
                         f"{_f(s['total'])} | {_f(s['neural'])} | {_f(s['suffix'])} | {_f(s['verify'])} | "
                         f"{_f(s['host'])} | {_f(s['prefill'])} | {_pct(s['neural_step_share'])} | "
                         f"{_f(s['neural_rows'])} | {_pct(s.get('suffix_step_share'))} | {_proposer_cell(r['proposers'])} |")
    lines += [""] + [f"- {n}" for n in report.get("notes", [])]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(report, out_dir / f"{name}.png")


def _plot(report: dict, path: Path) -> None:
    """Output tokens/s per system and level; below, where our target-only ran, each system's
    same-round ratios to it (a dot per round, a bar at their median): a control beside
    the others (``ours_target_only_aa``) shows how far apart identical engines read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    panels = sorted({(r["temperature"], r["batch"]) for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    ratios = {key: round_ratios_by_system(rows, *key) for key in panels}
    n_rows = 2 if any(ratios.values()) else 1
    fig, axes = plt.subplots(n_rows, len(panels), figsize=(3.6 * len(panels), 3.6 * n_rows), squeeze=False)
    for j, (temp, b) in enumerate(panels):
        ax = axes[0][j]
        vals = [next((r["tokens_per_s"] or 0 for r in rows if r["system"] == s and r["batch"] == b
                      and r["temperature"] == temp), 0) for s in systems]
        ax.bar(range(len(systems)), vals, color=[f"C{i}" for i in range(len(systems))])
        ax.set_xticks(range(len(systems)), systems, rotation=40, ha="right", fontsize=7)
        ax.set_title(f"batch {b}, T={temp:g}", fontsize=9)
        ax.set_ylabel("output tokens/s")
        if n_rows == 2:
            _plot_ratios(axes[1][j], ratios[(temp, b)], systems)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def round_ratios_by_system(rows: list[dict], temp: float, batch: int) -> dict[str, list[float]]:
    """Each system's per-round tokens/s over our target-only's in the same round, at one level
    (systems without rounds, and rounds either side missed, left out)."""
    def rounds_of(system: str) -> list:
        return next((r.get("tokens_per_s_rounds") or [] for r in rows if r["system"] == system
                     and r["batch"] == batch and r["temperature"] == temp and r.get("task", OVERALL) == OVERALL), [])
    base = rounds_of(BASELINE_OURS)
    out = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        pairs = same_round_ratios(rounds_of(system), base)
        if system != BASELINE_OURS and pairs:
            out[system] = pairs
    return out


def _plot_ratios(ax, ratios: dict[str, list[float]], systems: list[str]) -> None:
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
    for name, values in ratios.items():
        i = systems.index(name)
        ax.plot([i] * len(values), values, "o", color=f"C{i}", alpha=0.6, ms=4)
        ax.hlines(median(values), i - 0.3, i + 0.3, color=f"C{i}", lw=2)
    ax.set_xticks(range(len(systems)), systems, rotation=40, ha="right", fontsize=7)
    ax.set_ylabel(f"x {BASELINE_OURS}, same round", fontsize=8)
