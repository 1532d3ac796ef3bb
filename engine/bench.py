"""Decode benchmark (``dspark bench``), SPS profiling (``dspark profile``), STS calibration (``dspark calibrate``).

The benchmark runs every system on the same prompts in the same process, side by side:
``target_only`` (our engine, the null proposer), ``spec_fixed`` (the neural drafter, full
blocks), ``spec_scheduled`` (the neural drafter, confidence scheduling with the profiled SPS
table), ``suffix`` (the suffix proposer, no training) and ``hybrid`` (suffix + neural,
``engine/proposers/``), both scheduled when there is an SPS table, and transformers' own
``generate()`` (plain, and with prompt lookup decoding) as peers. Every engine run builds a
fresh engine, so the suffix proposer's shared index starts empty; a run whose suffix
systems would see a prompt twice is refused (its earlier answer would be in the index). Requests arrive staggered (one new
request per engine step until the batch is full) so the engine runs in flight.

This in-process benchmark is the quick one (a loaded target, every system in one process).
The committed ``docs/benchmarks/decode.*`` and ``engine_vs_vllm.*`` come from the side-by-side
harness (``engine/sidebyside.py``: our systems in lockstep, each peer in its own process, vLLM as
a peer, per task and per temperature, the time of a decode step split by phase); their commands
are in the files.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from . import host_memory
from .api import SamplingParams
from .proposers import EngineStats, SuffixConfig
from .runtime import EngineConfig, SpecEngine
from .target_runner import TargetRunner


@dataclass
class SystemResult:
    system: str
    batch: int
    tokens_per_s: float
    accept_len: float | None
    verified_per_accepted: float | None  # target tokens verified per emitted token
    p50_token_ms: float
    p99_token_ms: float
    output_tokens: int
    seconds: float
    drafted_step_frac: float | None = None  # share of decode steps that ran the drafter (adaptive drafting)
    # greedy: share of requests whose tokens equal target_only's in the same run (losslessness at scale)
    identical_to_target_only: float | None = None
    static_step_frac: float | None = None  # share of decode steps run from a fixed-shape bucket (CUDA graph on a GPU)
    # with repeats: tokens/s of every run, and the median over runs of tokens/s over target_only's in the same round
    tokens_per_s_runs: list[float] | None = None
    ratio_to_target_only: float | None = None
    # accept_len of the rounds each proposer drafted (engine/proposers/stats.py), e.g. {"suffix": 1.7}
    accept_len_by_proposer: dict[str, float] | None = None


def _token_latencies(arrivals: dict[str, list[float]]) -> list[float]:
    """Per emitted token: time since the request's previous emission, spread over the tokens emitted."""
    out = []
    for times in arrivals.values():
        for a, b in zip(times, times[1:]):
            out.append((b - a) * 1000)
    return out


def run_engine(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams, batch: int, name: str,
               outputs: list[list[int]] | None = None) -> SystemResult:
    """In-flight run: one new request per step until ``batch`` are running, refilled as they finish.

    ``outputs``, when given, receives each prompt's emitted tokens (in prompt order)."""
    emitted: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    active = 0

    def cb(o):
        nonlocal active
        now = time.perf_counter()
        n = len(o.new_token_ids)
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if n:
            # n tokens arrived together: n latency samples of (gap / n)
            last = emitted.setdefault(o.request_id, [])
            counts[o.request_id] = counts.get(o.request_id, 0) + n
            if last:
                gap = now - last[-1]
                last.extend([last[-1] + gap * (i + 1) / n for i in range(n)])
            else:
                last.append(now)
        if o.finished:
            active -= 1
    stats0 = engine.stats.snapshot()
    replays0 = getattr(engine.runner, "replays", None)
    t0 = time.perf_counter()
    while pending or engine.has_work():
        if pending and active < batch:
            i, p = pending.pop(0)
            engine.submit(f"{name}-{i}", p, params, cb)
            active += 1
        engine.step()
    secs = time.perf_counter() - t0
    if outputs is not None:
        outputs[:] = [tokens.get(f"{name}-{i}", []) for i in range(len(prompts))]
    lat = _token_latencies(emitted)
    total = sum(counts.values())
    st: EngineStats = engine.stats.since(stats0)
    rounds, row_rounds = st.decode_steps, st.rounds
    acc, drafted = st.total.accepted, st.total.drafted
    spec = engine.K > 0
    skipped = st.skipped_draft_steps
    by_proposer = {k: v.accept_len for k, v in st.by_proposer.items() if k != "none" and v.rounds}
    return SystemResult(
        system=name, batch=batch, tokens_per_s=total / secs,
        accept_len=st.accept_len if spec else None,
        accept_len_by_proposer=by_proposer if spec else None,
        verified_per_accepted=(drafted + row_rounds) / max(acc + row_rounds, 1) if spec else None,
        p50_token_ms=float(np.percentile(lat, 50)) if lat else float("nan"),
        p99_token_ms=float(np.percentile(lat, 99)) if lat else float("nan"),
        output_tokens=total, seconds=secs,
        drafted_step_frac=1.0 - skipped / rounds if engine.neural is not None and rounds else None,
        static_step_frac=(engine.runner.replays - replays0) / rounds if replays0 is not None and rounds else None)


@torch.no_grad()
def run_hf_generate(target, prompts: list[list[int]], max_tokens: int, batch: int, prompt_lookup: bool) -> SystemResult:
    """transformers generate() on the same target, static batches of ``batch`` (greedy, left padded)."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    total, lat = 0, []
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        w = max(map(len, chunk))
        dev = next(target.model.parameters()).device
        ids = torch.tensor([[pad] * (w - len(p)) + p for p in chunk], device=dev)
        attn = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in chunk], device=dev)
        kw = {"prompt_lookup_num_tokens": 7} if prompt_lookup else {}
        t1 = time.perf_counter()
        out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                     do_sample=False, pad_token_id=pad, **kw)
        dt = time.perf_counter() - t1
        n = out.shape[1] - w
        total += n * len(chunk)
        lat += [dt / n * 1000] * (n * len(chunk))
    secs = time.perf_counter() - t0
    return SystemResult(system="hf_prompt_lookup" if prompt_lookup else "hf_generate", batch=batch,
                        tokens_per_s=total / secs, accept_len=None, verified_per_accepted=None,
                        p50_token_ms=float(np.percentile(lat, 50)), p99_token_ms=float(np.percentile(lat, 99)),
                        output_tokens=total, seconds=secs)


def decode_benchmark(target, drafter, prompts: list[list[int]], batches: list[int], max_tokens: int, sps=None,
                     sts=None, systems: tuple[str, ...] = ("target_only", "spec_fixed", "spec_scheduled",
                                                         "hf_generate", "hf_prompt_lookup"),
                     min_prompts: int = 4, requests_per_slot: float = 2.0,
                     static_steps: str = "auto", repeats: int = 1,
                     suffix: SuffixConfig | None = None) -> list[SystemResult]:
    """Each batch size decodes ``max(ceil(requests_per_slot * batch), min_prompts)`` prompts (cycled)
    with every system; greedy speculative outputs are checked against ``target_only``'s.

    ``repeats`` > 1 runs every system that many rounds, the order rotating each round so that
    no system always runs first or after the same neighbour. A system's row is its median run;
    ``ratio_to_target_only`` is the median of its per-round ratios (runs of one round are
    minutes apart, which cancels most of a noisy host's drift)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results = []
    # min_tokens is not a thing in our engine: no stop tokens, so every request runs max_tokens
    params = SamplingParams(max_tokens=max_tokens)
    for batch in tqdm(batches, desc="decode bench", unit="batch size"):
        n = max(math.ceil(requests_per_slot * batch), min_prompts)
        ps = [prompts[i % len(prompts)] for i in range(n)]
        runnable = [s for s in systems if _runs_at(s, batch, sps, drafter)]
        if {"suffix", "hybrid"} & set(runnable) and len({tuple(p) for p in ps}) < n:
            raise ValueError(f"batch {batch} needs {n} distinct prompts for the suffix systems (a repeated prompt's "
                             f"answer would be in the shared index), got {len({tuple(p) for p in prompts})}: "
                             "raise --prompts-per-task or lower --requests-per-slot")
        runs: dict[str, list[SystemResult]] = {s: [] for s in runnable}
        outputs: dict[str, list[list[int]]] = {}
        for rnd in range(repeats):
            k = rnd % len(runnable)
            for system in runnable[k:] + runnable[:k]:
                out: list[list[int]] = []
                runs[system].append(_run_system(system, target, drafter, ps, params, batch, sps, sts, static_steps, out,
                                                suffix))
                outputs.setdefault(system, out)
        results += _summarise(runs, outputs)
    return results


SYSTEMS = ("target_only", "spec_fixed", "spec_scheduled", "suffix", "hybrid", "hf_generate", "hf_prompt_lookup")
# the engine systems by their proposers (``EngineConfig.proposers``): ``dspark bench --proposers``
SYSTEM_OF_PROPOSERS = {"neural": "spec_scheduled", "suffix": "suffix", "neural+suffix": "hybrid",
                       "suffix+neural": "hybrid"}


def _runs_at(system: str, batch: int, sps, drafter=None) -> bool:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    if system in ("spec_fixed", "spec_scheduled", "hybrid") and drafter is None:
        return False
    if system == "spec_scheduled":
        return sps is not None
    if system == "hf_prompt_lookup":
        return batch == 1  # transformers' prompt lookup supports batch size 1 only
    return True


def _run_system(system: str, target, drafter, ps: list[list[int]], params: SamplingParams, batch: int, sps, sts,
                static_steps: str, out: list[list[int]], suffix: SuffixConfig | None = None) -> SystemResult:
    """One timed run of ``system`` after an untimed warm-up; ``out`` receives our engine's tokens."""
    if system.startswith("hf_"):
        lookup = system == "hf_prompt_lookup"
        run_hf_generate(target, ps[:1], 2, 1, lookup)  # warm-up, untimed
        return run_hf_generate(target, ps, params.max_tokens, batch, lookup)
    cfg = EngineConfig(mode="spec", max_batch=batch, static_steps=static_steps)
    if suffix is not None:
        cfg = dataclasses.replace(cfg, suffix=suffix)
    scheduled = dataclasses.replace(cfg, scheduler="algorithm1" if sps is not None else "fixed")
    if system == "target_only":
        eng = SpecEngine(target, None, dataclasses.replace(cfg, mode="target_only"))
    elif system == "spec_fixed":
        eng = SpecEngine(target, drafter, dataclasses.replace(cfg, scheduler="fixed"))
    elif system == "suffix":
        eng = SpecEngine(target, None, dataclasses.replace(scheduled, proposers="suffix"), sps=sps)
    elif system == "hybrid":
        eng = SpecEngine(target, drafter, dataclasses.replace(scheduled, proposers="neural+suffix"), sps=sps,
                         sts_temperatures=sts)
    else:
        eng = SpecEngine(target, drafter, dataclasses.replace(cfg, scheduler="algorithm1"), sps=sps,
                         sts_temperatures=sts)
    # untimed warm-up: lazy inits (the verify extension, cuBLAS handles) and GPU clocks; on a
    # prompt of its own, and the suffix index forgets it (no benchmark prompt's answer in it)
    warm = [[t for t in reversed(ps[0])]]
    run_engine(eng, warm, dataclasses.replace(params, max_tokens=4), batch, f"{system}-warmup")
    if eng.suffix is not None:
        eng.suffix.clear_shared()
    return run_engine(eng, ps, params, batch, system, out)  # the engine (caches, CUDA graphs) is freed on return


def _summarise(runs: dict[str, list[SystemResult]], outputs: dict[str, list[list[int]]]) -> list[SystemResult]:
    """One row per system: its median run, every run's tokens/s, the median paired ratio to
    target_only, and (engine systems) the share of requests identical to target_only's."""
    base_runs = runs.get("target_only", [])
    rows = []
    for system, rs in runs.items():
        row = sorted(rs, key=lambda r: r.tokens_per_s)[(len(rs) - 1) // 2]
        row.tokens_per_s = float(np.median([r.tokens_per_s for r in rs]))
        if len(rs) > 1:
            row.tokens_per_s_runs = [r.tokens_per_s for r in rs]
        if base_runs:
            row.ratio_to_target_only = float(np.median([r.tokens_per_s / b.tokens_per_s for r, b in zip(rs, base_runs)]))
        if (system.startswith("spec") or system in ("suffix", "hybrid")) and "target_only" in outputs:
            ref = outputs["target_only"]
            row.identical_to_target_only = sum(a == b for a, b in zip(outputs[system], ref)) / len(ref)
        rows.append(row)
    return rows


def profile_target_sps(target, block_size: int, context: int = 256, max_tokens: int = 512, repeats: int | None = None,
                       token_counts: list[int] | None = None, allow_flat: bool = False, static_steps: str = "auto",
                       batch_rows: list[int] | None = None):
    """Steps/s of one verify forward against its number of tokens B (rows of 1+K tokens over ``context``).

    The steps run the way the engine runs them (``EngineConfig.static_steps``): on a GPU,
    ``auto`` replays CUDA graphs of the padded (rows, query) buckets, whose cost is what the
    scheduler trades against; on the CPU the ragged eager forward. ``repeats`` (sweeps over all
    counts, interleaved: ``profile_sps``) defaults to ``CPU_SWEEPS`` on the CPU (a step takes
    0.02-1 s; about 6 minutes on 2 cores) and 20 on a GPU, after 5 warm-up steps that bring the
    clocks up.

    ``batch_rows``: also time the by-rows grid (``engine/sps.py``): for each R, a step of R rows
    of one token over ``context`` plus ``e`` drafts in blocks of K on the first rows, for e in
    ``ROW_EXTRA_TOKENS`` up to ``R * K`` (and ``max_tokens`` in all)."""
    from .sps import profile_sps
    from .static_target import StaticTarget, with_static_steps

    rows_max = max([max(1, max_tokens // (block_size + 1)) + 1] + list(batch_rows or []))
    runner = TargetRunner(target, rows_max, initial_capacity=context + block_size + 2, max_context=context + block_size + 2)
    on_gpu = runner.device.type == "cuda"
    if not on_gpu:  # the host allocator as the CPU engine sets it (EngineConfig.retain_host_memory)
        host_memory.retain_freed_memory()
    prime_cache(runner, rows_max, context)
    runner = with_static_steps(runner, static_steps, rows_max, block_size)
    kind = ("CUDA graphs" if runner.use_graphs else "static eager") if isinstance(runner, StaticTarget) else "eager"
    counts = token_counts or sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512} & set(range(1, max_tokens + 1)))

    def run(sizes: list[int]) -> None:
        for r in range(len(sizes)):
            runner.set_length(r, context)
        runner.forward(list(range(len(sizes))), [[7] * n for n in sizes], need_features=True)

    def step(B: int) -> None:
        rows = max(1, -(-B // (block_size + 1)))
        run([B // rows + (1 if i < B % rows else 0) for i in range(rows)])
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
    warmup, repeats = (5, repeats or 20) if on_gpu else (1, repeats or CPU_SWEEPS)
    table = profile_sps(step, counts, warmup=warmup, repeats=repeats, sync=sync, device=str(runner.device),
                        engine=f"dspark TargetRunner ({kind}) {target.profile.name} ctx={context}", allow_flat=allow_flat)
    if batch_rows:
        rs = sorted(set(batch_rows))
        extras = {R: [e for e in ROW_EXTRA_TOKENS if e <= R * block_size and R + e <= max(max_tokens, R)] for R in rs}
        seconds = time_rows_grid(lambda R, e: run(_row_sizes(R, e, block_size)), extras, warmup, repeats, sync=sync)
        table.set_rows_grid(rs, [extras[R] for R in rs], [[1.0 / seconds[(R, e)] for e in extras[R]] for R in rs])
    return table


def time_rows_grid(step: Callable[[int, int], None], extras: dict[int, list[int]], warmup: int, repeats: int,
                   sync: Callable[[], None] | None = None, iters: int = 3) -> dict[tuple[int, int], float]:
    """Seconds per step at each (R, e) of the by-rows grid (``extras[R]`` starts at 0), each
    drafted point paired with its row count's plain step: every sweep times, for each R in
    turn, the plain step and every e back to back (in an order that rotates from sweep to
    sweep), each the mean of ``iters`` steps; a point is the plain step's median plus the
    median over sweeps of its difference to that sweep's plain step. A draft's price is the
    difference of two nearby times, so a slow spell of a shared host cancels out of it
    instead of pricing the first draft beside 64 rows at nothing; a price that noise alone
    puts below the row count's slope goes back on it (``supported_draft_prices``)."""
    def timed(R: int, e: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            step(R, e)
        if sync is not None:
            sync()
        return (time.perf_counter() - t0) / iters

    for R, es in extras.items():
        for e in es:
            for _ in range(warmup):
                step(R, e)
    plain: dict[int, list[float]] = {R: [] for R in extras}
    diffs: dict[tuple[int, int], list[float]] = {(R, e): [] for R, es in extras.items() for e in es[1:]}
    with tqdm(total=repeats * sum(len(es) for es in extras.values()), desc="profiling rows", unit="point") as bar:
        for sweep in range(repeats):
            for R, es in extras.items():
                k = sweep % len(es)
                got = {e: timed(R, e) for e in es[k:] + es[:k]}
                plain[R].append(got[0])
                for e in es[1:]:
                    diffs[(R, e)].append(got[e] - got[0])
                bar.update(len(es))
    out = {(R, 0): statistics.median(ts) for R, ts in plain.items()}
    for R, es in extras.items():
        prices = supported_draft_prices(es[1:], [diffs[(R, e)] for e in es[1:]])
        for e, price in zip(es[1:], prices):
            out[(R, e)] = out[(R, 0)] + price
    return out


def supported_draft_prices(extras: Sequence[int], diffs: Sequence[Sequence[float]],
                           evidence: float = 0.9) -> list[float]:
    """What ``extras[i]`` drafts add to a step, from ``diffs[i]`` (each sweep's difference to its
    plain step): the median difference (at least 0), except that a price below the line through
    the plain step and the largest count's price is kept only where at least ``evidence`` of the
    sweeps fall below that line; otherwise the point goes on the line.

    Beside many rows a step's noise (milliseconds) exceeds what one draft adds, and the convex fit
    of ``engine/sps.py`` keeps a low start of a curve as it is: a first draft that timed at nothing
    in a noisy sweep would then be priced free for good, and the schedulers would verify a draft or
    two of any confidence in every step. The largest count's difference is tens of drafts' worth,
    measured well above the noise, so its slope is the reference; where the first drafts really
    are cheaper (a memory-bound step, a GPU) the sweeps show it every time and the price stands.
    Every sweep's differences share that sweep's plain step, so one slow plain step lowers all of
    a sweep's small prices at once: the default asks for 9 sweeps in 10 (every one of 5 to 9).
    """
    if not extras:
        return []
    medians = [max(statistics.median(ds), 0.0) for ds in diffs]
    slope = medians[-1] / extras[-1]
    out = []
    for e, ds, price in zip(extras, diffs, medians):
        line = slope * e
        below = sum(d < line for d in ds)
        out.append(price if price >= line or below >= evidence * len(ds) else line)
    return out


def prime_cache(runner: TargetRunner, rows: int, context: int) -> None:
    """Write ``context`` real positions into the cache of slots ``0..rows-1``: one prefill of
    slot 0, copied to the others. The CPU cache starts uninitialised (``TargetRunner``), and
    reading positions never written reads the kernel's shared zero page, which costs no
    memory traffic: a profile over it prices attention far below a decode step's."""
    runner.set_length(0, 0)
    runner.forward([0], [[7 + (i % 50) for i in range(context)]], need_features=False, last_logits_only=True)
    for r in range(1, rows):
        runner.k[:, r, :, :context] = runner.k[:, 0, :, :context]
        runner.v[:, r, :, :context] = runner.v[:, 0, :, :context]


# Sweeps of a CPU profile: beside 16 or more rows a draft's price (2-3 ms on a 2-core host) is inside a
# step's jitter, and it decides whether any draft pays there; a few sweeps can price the first drafts
# far below what the engine's steps pay for them (docs/benchmarks/sps_rows_epyc15.md).
CPU_SWEEPS = 15

# drafts beyond the anchors at which each row count of the by-rows grid is timed (up to R * K)
ROW_EXTRA_TOKENS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def _row_sizes(rows: int, extra: int, block_size: int) -> list[int]:
    """Tokens per row of a step of ``rows`` anchors and ``extra`` drafts, in blocks of K on the first rows."""
    sizes = [1] * rows
    for i in range(rows):
        take = min(block_size, extra)
        sizes[i] += take
        extra -= take
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_draft_cost(drafter, requests: list[int], context: int = 256, repeats: int | None = None,
                       committed: int = 2) -> list[float]:
    """Median seconds of the drafter's work on one drafted step, per batch size R: appending the
    ``committed`` positions per row that the previous step committed (the anchor plus a typical
    accept) to its context cache, then one pass (``propose``) over R rows of ``context`` positions.
    The append is part of every drafted step's price, and grows with R like the pass."""
    import statistics

    from .draft_runner import make_draft_runner

    p = next(drafter.parameters())
    repeats = repeats or (20 if p.device.type == "cuda" else 3)
    runner = make_draft_runner(drafter, max(requests))
    aux_dim = drafter.fc.in_features  # target features: hidden size x number of tapped layers
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for R in tqdm(requests, desc="profiling drafter", unit="batch size"):
        for slot in range(R):
            runner.reset(slot)
            aux = torch.randn(context, aux_dim, generator=gen)
            runner.append([(slot, aux, torch.full((context,), 7))])
        anchors = torch.full((R,), 7, device=p.device)
        temps = torch.zeros(R, device=p.device)
        new = [(slot, torch.randn(committed, aux_dim, generator=gen), torch.full((committed,), 7)) for slot in range(R)]

        def drafted_step() -> None:
            runner.append(new)
            runner.propose(list(range(R)), anchors, temps)
        drafted_step()  # warm-up
        times = []
        for _ in range(repeats):
            _sync(p.device)
            t0 = time.perf_counter()
            drafted_step()
            _sync(p.device)
            times.append(time.perf_counter() - t0)
        seconds.append(statistics.median(times))
    return seconds


def profile_append_cost(drafter, rows: int = 4, positions: int = 64, repeats: int | None = None) -> float:
    """Median seconds per context position appended to one row's drafter cache: ``rows`` fresh
    rows appending ``positions`` positions each, less the same rows appending one, over the
    difference in positions. This is what a row pays to rebuild its cache from a window of
    recent context before it drafts again (``engine/proposers/neural.py``), which the drafting
    gate counts in the price of a probe."""
    import statistics

    from .draft_runner import make_draft_runner

    if rows < 1 or positions < 2:
        raise ValueError(f"need rows >= 1 and positions >= 2, got {rows}, {positions}")
    p = next(drafter.parameters())
    repeats = repeats or (20 if p.device.type == "cuda" else 5)
    runner = make_draft_runner(drafter, rows)
    aux_dim = drafter.fc.in_features
    gen = torch.Generator().manual_seed(0)
    batches = {n: [(slot, torch.randn(n, aux_dim, generator=gen), torch.full((n,), 7)) for slot in range(rows)]
               for n in (1, positions)}

    def append(n: int) -> float:
        for slot in range(rows):
            runner.reset(slot)
        _sync(p.device)
        t0 = time.perf_counter()
        runner.append(batches[n])
        _sync(p.device)
        return time.perf_counter() - t0

    append(positions)  # warm-up
    extra = [append(positions) - append(1) for _ in range(repeats)]
    return max(statistics.median(extra), 0.0) / (rows * (positions - 1))


def write_decode_results(results: list[SystemResult], out_dir: Path, name: str, command: str, device: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "device": device, "results": [dataclasses.asdict(r) for r in results]}
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    repeats = max((len(r.tokens_per_s_runs or [1]) for r in results), default=1)
    lines = [f"# Decode benchmark ({device})", "", f"Command: `{command}`", "",
             "| system | batch | tokens/s | x target_only | accept_len | verified/emitted | steps drafted | p50 ms/token | "
             "p99 ms/token | = target_only | accept_len by proposer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = float("nan") if r.ratio_to_target_only is None else r.ratio_to_target_only
        al = "-" if r.accept_len is None else f"{r.accept_len:.2f}"
        vp = "-" if r.verified_per_accepted is None else f"{r.verified_per_accepted:.2f}"
        ds = "-" if r.drafted_step_frac is None else f"{100 * r.drafted_step_frac:.0f}%"
        same = "-" if r.identical_to_target_only is None else f"{100 * r.identical_to_target_only:.0f}%"
        by = ", ".join(f"{k} {v:.2f}" for k, v in (r.accept_len_by_proposer or {}).items()) or "-"
        lines.append(f"| {r.system} | {r.batch} | {r.tokens_per_s:.1f} | {ratio:.2f} | {al} | {vp} | {ds} | "
                     f"{r.p50_token_ms:.1f} | {r.p99_token_ms:.1f} | {same} | {by} |")
    lines += ["", "`= target_only`: share of requests whose greedy tokens equal target-only decoding's in this run. "
              "`accept_len by proposer`: tokens per verify round over the rounds each proposer drafted "
              "(rounds without drafts not counted; `accept_len` counts every round)."]
    if repeats > 1:
        lines += ["", f"Each system ran {repeats} rounds in rotating order; tokens/s is the median run's and "
                  "`x target_only` the median of the per-round ratios; the other columns come from the median run."]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(results, out_dir / f"{name}.png")
    return report


def _plot(results: list[SystemResult], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r.system for r in results):
        rows = sorted((r.batch, r.tokens_per_s) for r in results if r.system == system)
        ax.plot([b for b, _ in rows], [t for _, t in rows], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

