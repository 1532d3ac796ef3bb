"""Serving benchmark and soak run against the ensembles of a running server (gRPC streaming).

``sweep``: for each system (``ensemble`` = spec, ``ensemble_target_only``) and each
concurrency, keep that many streaming requests in flight (closed loop) until
``num_requests`` finished; report TTFT, ITL (time per output token after the first),
end-to-end latency percentiles, output tokens/s, requests/s and accept_len; with the server's
metrics URL also accept_len by proposer (the ``dspark_proposer_*`` counters over the run) and
the engine's ms per step by phase (the ``dspark_engine_*`` counters), which says where a
system's steps went under that load.

Two throughputs per run. ``output tokens/s`` is the run's tokens over its wall time, the drain
at the end included: once the last request is sent, fewer than ``concurrency`` streams remain,
and the run ends with the slowest of them. ``sustained tokens/s`` is the tokens received while
all ``concurrency`` streams were busy (from the first request sent to the last) over that
window: the rate a server holds at that load, which is what a deployment at that concurrency
sees. The two differ most for a system whose requests finish at different steps (speculative
decoding accepts more for some requests than others, so its last requests trickle out), and
least for target-only decoding of equal-length requests, which finish in waves.

``soak``: ``streams`` workers each send, back to back for ``minutes``, a streamed and a
non-streamed greedy request for the same prompt and compare the texts; reports failed and
mismatched requests and the server's memory (RSS of tritonserver + its python stubs).
"""
from __future__ import annotations

import json
import os
import random
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from ...training.data import find_data_root
from ..host import cpu_model
from .client import Result, StreamClient, make_inputs

SYSTEMS = {"spec": "ensemble", "target_only": "ensemble_target_only"}


# prompts -------------------------------------------------------------------------------
def default_prompt_files() -> list[Path]:
    """``eval/*.jsonl`` of the kit's prompt data (``$DSPARK_DATA`` overrides the shipped copy)."""
    return sorted((find_data_root() / "eval").glob("*.jsonl"))


def load_prompts(files: Iterable[Path], limit: int | None = None) -> list[str]:
    """First turn of each ``{"turns": [...]}`` line, interleaved across files."""
    per_file = []
    for f in files:
        prompts = []
        for line in Path(f).read_text().splitlines():
            if line.strip():
                turns = json.loads(line).get("turns") or []
                if turns and str(turns[0]).strip():
                    prompts.append(str(turns[0]))
        per_file.append(prompts)
    out = []
    for i in range(max((len(p) for p in per_file), default=0)):  # round-robin across files
        out += [prompts[i] for prompts in per_file if i < len(prompts)]
    if not out:
        raise ValueError("no prompts found (expected JSONL lines with a non-empty 'turns' list)")
    return out[:limit] if limit else out


# statistics ----------------------------------------------------------------------------
def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


def sustained_rate(results: list[Result]) -> tuple[float | None, float]:
    """(tokens/s, seconds) over the window from the first request sent to the last, in which a
    closed loop keeps every stream busy; None when no request finished inside it (every request
    was sent at once: nothing was sustained)."""
    if not results:
        return None, 0.0
    start = min(r.t_submit for r in results)
    end = max(r.t_submit for r in results)
    if end <= start or not any(r.t_done is not None and r.t_done <= end for r in results):
        return None, max(end - start, 0.0)
    tokens = sum(r.tokens_by(end) for r in results if r.error is None)
    return tokens / (end - start), end - start


def summarize(system: str, concurrency: int, results: list[Result], wall: float) -> dict:
    done = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in done)
    sustained, window = sustained_rate(results)
    steps = sum(r.num_steps for r in done)
    accepted = sum(r.num_accepted_tokens for r in done)
    return {
        "system": system,
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(done),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "sustained_tokens_per_s": None if sustained is None else round(sustained, 3),
        "sustained_s": round(window, 3),
        "requests_per_s": round(len(done) / wall, 4) if wall > 0 else None,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": percentiles([r.itl for r in done if r.itl is not None]),
        "e2e_ms": percentiles([r.e2e for r in done if r.e2e is not None]),
        "accept_len": round((accepted + steps) / steps, 4) if steps else None,
    }


# the server's proposer counters -----------------------------------------------------------
_PROPOSER_LINE = re.compile(r'^dspark_proposer_(rounds|draft_tokens|accepted_tokens)_total\{([^}]*)\}\s+([0-9.eE+-]+)$')
_FIELD = {"rounds": "rounds", "draft_tokens": "drafted", "accepted_tokens": "accepted"}


def parse_proposer_counters(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> ``{proposer: {"rounds", "drafted", "accepted"}}``, summed over the other labels."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _PROPOSER_LINE.match(line.strip())
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        name = labels.get("proposer")
        if name is None:
            continue
        d = out.setdefault(name, {"rounds": 0.0, "drafted": 0.0, "accepted": 0.0})
        d[_FIELD[m.group(1)]] += float(m.group(3))
    return out


_ENGINE_LINE = re.compile(r'^dspark_engine_(seconds|steps|decode_steps)_total\{([^}]*)\}\s+([0-9.eE+-]+)$')


def parse_engine_counters(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"steps", "decode_steps", "seconds:<phase>"...}``, summed over models
    (only the model under load advances during a run)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _ENGINE_LINE.match(line.strip())
        if not m:
            continue
        key = m.group(1)
        if key == "seconds":
            phase = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))).get("phase")
            if phase is None:
                continue
            key = f"seconds:{phase}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def scrape_metrics(metrics_url: str | None, timeout: float = 5.0) -> str | None:
    """The server's metrics text now, or None without a URL or when it cannot be read."""
    if not metrics_url:
        return None
    import urllib.request
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
            return resp.read().decode("utf-8", "replace")
    except OSError:
        return None


def scrape_proposer_counters(metrics_url: str | None, timeout: float = 5.0) -> dict[str, dict[str, float]] | None:
    """The server's proposer counters now, or None without a URL or when it cannot be read."""
    text = scrape_metrics(metrics_url, timeout)
    return None if text is None else parse_proposer_counters(text)


def _parsed(parse, *texts: str | None) -> list:
    """Each metrics text through ``parse`` (None stays None)."""
    return [None if t is None else parse(t) for t in texts]


def engine_window(before: dict | None, after: dict | None) -> dict | None:
    """Engine steps between two scrapes and ms per step by phase: ``step`` (whole steps), its parts
    ``verify``, ``neural``, ``suffix``, ``prefill``, and ``host`` (what the parts leave); None when
    either scrape is missing or no step ran."""
    if before is None or after is None:
        return None
    from ..proposers.stats import PHASES
    gain = {k: v - before.get(k, 0.0) for k, v in after.items()}
    steps = int(round(gain.get("steps", 0.0)))
    if steps <= 0:
        return None
    ms = {p: round(1000.0 * gain.get(f"seconds:{p}", 0.0) / steps, 3) for p in PHASES}
    ms["host"] = round(ms["step"] - sum(ms[p] for p in PHASES if p != "step"), 3)
    return {"steps": steps, "decode_steps": int(round(gain.get("decode_steps", 0.0))), "ms_per_step": ms}


def proposer_window(before: dict | None, after: dict | None) -> dict[str, dict] | None:
    """What the counters gained between two scrapes, with ``accept_len`` per proposer (the one
    definition: (accepted + rounds) / rounds); None when either scrape is missing."""
    if before is None or after is None:
        return None
    from ..proposers.stats import accept_len
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: int(round(a[k] - b.get(k, 0.0))) for k in ("rounds", "drafted", "accepted")}
        if d["rounds"] > 0:
            d["accept_len"] = round(accept_len(d["accepted"], d["rounds"]), 4)
            out[name] = d
    return out


# load generation -------------------------------------------------------------------------
def run_level(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
              max_tokens: int, temperature: float | None = None, timeout: float = 1800.0) -> tuple[list[Result], float]:
    """Closed loop: ``concurrency`` requests in flight until ``num_requests`` finished."""
    client = StreamClient(url, model)
    slots = threading.Semaphore(concurrency)
    results: list[Result] = []
    lock = threading.Lock()

    def release(res: Result):
        res.done.wait(timeout)
        slots.release()

    t0 = time.perf_counter()
    try:
        for i in range(num_requests):
            slots.acquire()
            res = client.submit(make_inputs(prompts[i % len(prompts)], max_tokens, True, temperature=temperature))
            with lock:
                results.append(res)
            threading.Thread(target=release, args=(res,), daemon=True).start()
        for res in results:
            if not res.done.wait(timeout):
                res.error = res.error or "timeout"
        wall = max((r.t_done or time.perf_counter()) for r in results) - t0
    finally:
        client.close(cancel=True)
    return results, wall


MIN_REQUESTS = 12  # per level: a few requests at concurrency 1 last seconds, too short for a noisy host
# default requests per stream and level: the sustained window (first to last request sent) then
# holds three replacements of every stream, not only the ramp-up of the first
REQUESTS_PER_STREAM = 4


def sweep(url: str, prompts: list[str], concurrencies: list[int], systems: list[str], max_tokens: int,
          num_requests: int | None = None, temperature: float | None = None, repeats: int = 1,
          log=print, metrics_url: str | None = None) -> list[dict]:
    """Every concurrency level runs each system back to back, ``repeats`` times, the order
    alternating from one round to the next, so the runs compared at a level ran minutes apart on
    the same host state. Each round of each level sends prompts no earlier round sent (both
    systems the same ones), while ``prompts`` last: a server's shared suffix index holds the
    answers it gave, and a repeated prompt would be drafted from its own earlier answer. A (system, level) row is its median-throughput run (``combine_runs``).
    ``metrics_url`` (Triton's ``/metrics``): each run also gets ``by_proposer``, the rounds,
    drafts and accepted tokens by proposer over that run, and their accept_len."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for system in systems:
        run_level(url, SYSTEMS[system], prompts[:1], 1, 1, min(max_tokens, 8), temperature)  # warm-up
    rows = []
    rounds = 0
    cursor = 1  # prompts[0] warmed the servers up
    for c in concurrencies:
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for _ in range(repeats):
            n = num_requests or max(REQUESTS_PER_STREAM * c, MIN_REQUESTS)
            chosen = [prompts[(cursor + i) % len(prompts)] for i in range(n)]
            if cursor + n > len(prompts) >= cursor:
                log(f"warning: {len(prompts)} prompts run out at concurrency {c}: from here prompts repeat, and a "
                    "server whose shared suffix index saw a prompt's answer drafts it back (pass more --prompts)")
            cursor += n
            for system in (systems if rounds % 2 == 0 else systems[::-1]):
                before = scrape_metrics(metrics_url)
                results, wall = run_level(url, SYSTEMS[system], chosen, c, n, max_tokens, temperature)
                if before is not None:
                    time.sleep(0.5)  # the model publishes its counters on its 0.1 s poll
                after = scrape_metrics(metrics_url)
                row = summarize(system, c, results, wall)
                row["by_proposer"] = proposer_window(*_parsed(parse_proposer_counters, before, after))
                row["engine"] = engine_window(*_parsed(parse_engine_counters, before, after))
                runs[system].append(row)
                log(f"{system:12s} c={c:<4d} {row['output_tokens_per_s']} tok/s  "
                    f"sustained {row['sustained_tokens_per_s']} tok/s  {row['requests_per_s']} req/s  "
                    f"ttft p50 {row['ttft_ms']['p50']} ms  itl p50 {row['itl_ms']['p50']} ms  "
                    f"accept_len {row['accept_len']}{_by_proposer_text(row['by_proposer'])}  failed {row['failed']}")
            rounds += 1
        rows += [combine_runs(runs[s]) for s in systems]
    return sorted(rows, key=lambda r: (systems.index(r["system"]), r["concurrency"]))


def _by_proposer_text(by: dict | None) -> str:
    """`` (suffix 1.9, dspark 1.2)``: accept_len by proposer, rounds without drafts left out."""
    if not by:
        return ""
    parts = [f"{k} {v['accept_len']:.2f}" for k, v in by.items() if k != "none"]
    return f" ({', '.join(parts)})" if parts else ""


def combine_runs(runs: list[dict]) -> dict:
    """The runs of one (system, level) -> one row: the statistics of the median-throughput run (the
    lower one of an even count), every run's throughput, TTFT p50 and engine split in ``*_runs`` (in round order,
    so the systems' runs pair up), and ``requests`` / ``failed`` summed over all runs, so that a
    failure in any run shows."""
    if len(runs) == 1:
        return runs[0]
    by_speed = sorted(runs, key=lambda r: r["output_tokens_per_s"] or 0.0)
    row = dict(by_speed[(len(runs) - 1) // 2])
    row.update(repeats=len(runs), requests=sum(r["requests"] for r in runs), failed=sum(r["failed"] for r in runs),
               output_tokens_per_s_runs=[r["output_tokens_per_s"] for r in runs],
               sustained_tokens_per_s_runs=[r.get("sustained_tokens_per_s") for r in runs],
               ttft_p50_ms_runs=[r["ttft_ms"]["p50"] for r in runs],
               engine_runs=[r.get("engine") for r in runs])
    return row


# reports -----------------------------------------------------------------------------------
def device_label() -> str:
    return f"cpu: {cpu_model()} ({os.cpu_count()} cores)"


def markdown(report: dict) -> str:
    lines = ["# Serving benchmark", "", f"Command: `{report['command']}`", "", f"Device: {report['device']}", "",
             "| system | concurrency | output tok/s | sustained tok/s | req/s | TTFT p50/p90/p99 ms | "
             "ITL p50/p90/p99 ms | e2e p50/p90/p99 ms | accept_len | accept_len by proposer | failed |",
             "|---|---:|---:|---:|---:|---|---|---|---:|---|---:|"]

    def trio(d):
        return " / ".join("-" if d[k] is None else f"{d[k]:.0f}" if d[k] >= 10 else f"{d[k]:.1f}"
                          for k in ("p50", "p90", "p99"))

    for r in report["results"]:
        held = r.get("sustained_tokens_per_s")
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['output_tokens_per_s']} | "
                     f"{'-' if held is None else held} | {r['requests_per_s']} | "
                     f"{trio(r['ttft_ms'])} | {trio(r['itl_ms'])} | {trio(r['e2e_ms'])} | {r['accept_len']} | "
                     f"{_by_proposer_text(r.get('by_proposer')).strip(' ()') or '-'} | {r.get('failed', 0)} |")
    speedups = speedup_rows(report["results"])
    if speedups:
        repeats = max((r.get("repeats", 1) for r in report["results"]), default=1)
        lines += ["", "spec / target_only" + (f" (median of the {repeats} rounds' ratios)" if repeats > 1 else "")
                  + ":", "", "| concurrency | output tok/s | sustained tok/s | TTFT p50 |", "|---:|---:|---:|---:|"]
        lines += [f"| {x.concurrency} | {x.output:.2f}x | {_times(x.sustained)} | {_times(x.ttft)} |" for x in speedups]
        lines += ["", "`output tok/s`: the run's tokens over its wall time, the drain at the end included (after the "
                  "last request is sent fewer streams remain). `sustained tok/s`: tokens received while every stream "
                  "was busy (first request sent to last) over that window, the rate held at that concurrency."]
    timed = [r for r in report["results"] if r.get("engine")]
    if timed:
        lines += ["", "Engine time per step (ms, the run shown above), from the server's `dspark_engine_*` counters:",
                  "", "| system | concurrency | steps | decode steps | step | verify | neural | suffix | prefill | host |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in timed:
            e, ms = r["engine"], r["engine"]["ms_per_step"]
            lines.append(f"| {r['system']} | {r['concurrency']} | {e['steps']} | {e['decode_steps']} | "
                         + " | ".join(f"{ms[p]:.1f}" for p in ("step", "verify", "neural", "suffix", "prefill", "host"))
                         + " |")
        lines += ["", "`verify`: the target pass (prompt chunks fused into it included) and the verify rule; "
                  "`prefill`: prompt chunks run outside a verify pass, and committing every chunk; `host`: the rest "
                  "of the step (admission, gates, scheduling, commits, emitting tokens)."]
    if any(r.get("by_proposer") for r in report["results"]):
        lines += ["", "`accept_len by proposer`: tokens per verify round over the rounds each proposer drafted, from the "
                  "server's `dspark_proposer_*` counters over the run (rounds without drafts not counted)."]
    return "\n".join(lines) + "\n"


class Speedup(NamedTuple):
    """spec / target_only at one concurrency; with repeats, each the median of same-round ratios."""
    concurrency: int
    output: float  # output tokens/s (whole run)
    sustained: float | None  # sustained tokens/s (every stream busy); None where a run had none
    ttft: float | None  # TTFT p50


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def speedup_rows(rows: list[dict]) -> list[Speedup]:
    """spec / target_only per level: output tokens/s, sustained tokens/s and TTFT p50. With repeats,
    each is the median of the ratios of the runs made in the same round."""
    def ratios(a: dict, b: dict, runs_key: str, single) -> list[float]:
        pairs = zip(a.get(runs_key) or [single(a)], b.get(runs_key) or [single(b)])
        return [x / y for x, y in pairs if x is not None and y]

    def median_or_none(values: list[float], complete: int) -> float | None:
        return statistics.median(values) if values and len(values) == complete else None

    base = {r["concurrency"]: r for r in rows if r["system"] == "target_only"}
    out = []
    for r in rows:
        b = base.get(r["concurrency"])
        if r["system"] != "spec" or b is None:
            continue
        tok = ratios(r, b, "output_tokens_per_s_runs", lambda x: x["output_tokens_per_s"])
        held = ratios(r, b, "sustained_tokens_per_s_runs", lambda x: x.get("sustained_tokens_per_s"))
        ttft = ratios(r, b, "ttft_p50_ms_runs", lambda x: x["ttft_ms"]["p50"])
        if tok:
            out.append(Speedup(r["concurrency"], statistics.median(tok), median_or_none(held, len(tok)),
                               statistics.median(ttft) if ttft else None))
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for system in sorted({r["system"] for r in report["results"]}):
        rows = sorted((r for r in report["results"] if r["system"] == system), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        line, = axes[0].plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label=system)
        held = [(x, r.get("sustained_tokens_per_s")) for x, r in zip(xs, rows) if r.get("sustained_tokens_per_s")]
        if held:
            axes[0].plot(*zip(*held), "s--", color=line.get_color(), alpha=0.7, label=f"{system} (sustained)")
        axes[1].plot(xs, [r["ttft_ms"]["p50"] for r in rows], "o-", label=system)
        axes[2].plot(xs, [r["itl_ms"]["p50"] for r in rows], "o-", label=system)
    levels = sorted({r["concurrency"] for r in report["results"]})
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(report["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md"), out.with_suffix(".png")]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    plot(report, paths[2])
    return paths


# soak ----------------------------------------------------------------------------------------
def server_rss_mb(pid: int | None) -> float | None:
    """RSS of ``pid`` and all its descendants (tritonserver + python stubs), in MiB."""
    if not pid:
        return None
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            if p == pid:
                return None
        todo += children.get(p, [])
    return round(total / 1024, 1)


def soak(url: str, prompts: list[str], minutes: float, streams: int, max_tokens: int,
         server_pid: int | None = None, model: str = "ensemble", log=print) -> dict:
    rss_start = server_rss_mb(server_pid)
    deadline = time.time() + minutes * 60
    counts = {"requests": 0, "failed": 0, "mismatched": 0}
    examples: list[dict] = []
    lock = threading.Lock()
    client = StreamClient(url, model)

    def worker(seed: int):
        rng = random.Random(seed)
        while time.time() < deadline:
            prompt = rng.choice(prompts)
            a = client.submit(make_inputs(prompt, max_tokens, True))
            b = client.submit(make_inputs(prompt, max_tokens, False))
            ok_a, ok_b = a.done.wait(1800), b.done.wait(1800)
            with lock:
                counts["requests"] += 2
                failed = [r for r, ok in ((a, ok_a), (b, ok_b)) if not ok or r.error is not None]
                counts["failed"] += len(failed)
                if not failed and a.text != b.text:
                    counts["mismatched"] += 1
                    if len(examples) < 5:
                        examples.append({"prompt": prompt, "streamed": a.text, "non_streamed": b.text})
                if failed and len(examples) < 5:
                    examples.append({"prompt": prompt, "error": failed[0].error or "timeout"})

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    last_log = time.time()
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.time() - last_log < 30.0:
            continue
        last_log = time.time()
        with lock:
            log(f"soak: {counts['requests']} requests, {counts['failed']} failed, {counts['mismatched']} mismatched, "
                f"server RSS {server_rss_mb(server_pid)} MiB")
    client.close()
    return {"streams": streams, "minutes": minutes, "requests": counts["requests"], "failed": counts["failed"],
            "mismatched": counts["mismatched"], "rss_start_mb": rss_start, "rss_end_mb": server_rss_mb(server_pid),
            "max_tokens": max_tokens, "model": model, "examples": examples}
