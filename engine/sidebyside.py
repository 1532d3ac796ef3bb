"""Side by side on one host: our engine (target-only, neural, suffix, hybrid), transformers and vLLM.

    python -m dspark.engine.sidebyside --systems ours_target_only,ours_suffix --batches 1,4 ...
    python scripts/bench_vs_vllm.py ...          # the same, the engine-vs-vLLM defaults

Systems (``SYSTEMS``; ``ALIASES`` maps the decode benchmark's names):

- ``ours_target_only``: ``SpecEngine`` with the null proposer, the baseline of every ``x ours`` ratio;
- ``ours_target_only_bf16``: the same with the target in bf16 (``load_engine(dtype="bfloat16")``; the
  identity column then says how many requests bf16 leaves token-identical to the fp32 target);
- ``ours_target_only_aa``: a second target-only engine, the A/A control: its ``x ours`` ratio is what
  two identical systems read in this run (the noise floor of every other ratio);
- ``ours_spec`` (alias ``dspark_scheduled``): the engine directory's neural drafter, Algorithm 1
  with the SPS table, the drafting gate on;
- ``ours_suffix``: the suffix proposer (no training), Algorithm 1;
- ``ours_hybrid``: suffix + neural (``EngineConfig.proposers = "neural+suffix"``);
- ``ours_hybrid_no_slowdown``: the same under the ``no_slowdown`` scheduler (Algorithm 1 that
  slows no request down against decoding without drafts, ``engine/scheduler.py``);
- ``hf_generate`` / ``hf_prompt_lookup``: transformers ``generate()`` on the same weights, plain
  and with ``prompt_lookup_num_tokens`` (static batches; prompt lookup one request at a time);
- ``vllm_target_only`` / ``vllm_ngram``: vLLM fp32 (optional: where ``import vllm`` works).

Every run of a system starts a fresh engine (vLLM's caches start empty; our shared suffix index
starts empty, or with ``--history N``: holding the outputs of N earlier requests on prompts that
no level uses, each eval set's last ones, the same whatever the levels take; the steady state
of a server that has served them), ``--rounds`` rounds in
rotating order (``run_order``). By default (``--order lockstep``) our systems run a level in
one process on one loaded target, one engine step of each in turn, the first of the turn
rotating (``lockstep``), each timed by its own steps only: the host's speed drifts by tens of
percent over seconds to minutes, and lockstep puts the same drift on both sides of our
same-round ratios. The engines of such a process share the target's packed weights
(``cpu_decoder.shared_stack``): engines that packed copies of their own ran as fast as their copy,
the first built 1-6% slower than the third in every A/A/A lockstep of three target-only engines,
so the build order entered the ratios; the order still rotates by round. Each peer runs a
level in a process of its own, right before or after ours. ``--order levels`` gives every
system and level its own process; ``--order systems`` one process per system and round. Levels: for
each temperature, one request at a time (``--prompts-1`` requests x ``--new-tokens-1``) and
each batch > 1 in flight (``max(batch, requests_per_slot x batch)`` requests x ``--new-tokens-c``,
arriving one per engine step until ``batch`` run, a finished one replaced by the next).
Prompts are the first turns of the math, code and chat eval sets, interleaved, and never
repeat within a run (a repeated prompt's answer would be in the shared suffix index); EOS is
ignored so every request runs its full length. At T=1 every request carries a seed (the same
for the same request in every system): our engine's coupled rule then emits exactly our
target-only tokens, which the identity column checks.

Our engine's rows also say why they are as fast as they are (``EngineProbe``): accepted drafts
per round and verify lengths by proposer, and a decode step's time split into drafter pass,
suffix lookups, verify and the rest of the host work. The arithmetic and the files
(``<out-dir>/<name>.{json,md,png}``) are in ``sidebyside_report.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .sidebyside_report import TASKS, summarise, write_report

__all__ = ["SYSTEMS", "ALIASES", "Prompt", "Level", "load_prompts", "plan_levels", "level_prompts", "Recorder",
           "Drive", "drive", "lockstep", "EngineProbe", "build_parser", "main", "run_order"]

SYSTEMS = ("ours_target_only", "ours_target_only_aa", "ours_target_only_bf16", "ours_spec", "ours_suffix",
           "ours_hybrid", "ours_hybrid_no_slowdown", "hf_generate", "hf_prompt_lookup", "vllm_target_only", "vllm_ngram")
# the null proposer; _aa: the A/A control; _bf16: a bf16 target
OURS_TARGET_ONLY = ("ours_target_only", "ours_target_only_aa", "ours_target_only_bf16")
ALIASES = {"target_only": "ours_target_only", "target_only_aa": "ours_target_only_aa", "dspark_scheduled": "ours_spec",
           "spec_scheduled": "ours_spec", "suffix": "ours_suffix", "hybrid": "ours_hybrid"}
OURS_PROPOSERS = {"ours_spec": "neural", "ours_suffix": "suffix", "ours_hybrid": "neural+suffix",
                  "ours_hybrid_no_slowdown": "neural+suffix"}
OURS_SCHEDULERS = {"ours_hybrid_no_slowdown": "no_slowdown"}  # the rest: Algorithm 1 (with an SPS table)
NEEDS_DRAFTER = ("ours_spec", "ours_hybrid", "ours_hybrid_no_slowdown")
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
HF_LOOKUP_TOKENS = 3  # transformers' prompt lookup drafts (the same K as our suffix proposer's default)
SEED_BASE = 1000  # request i of a level samples with seed SEED_BASE + i, in every system
HISTORY_SEED_BASE = 900_000  # the history's request i samples with this + i (no level's seed)


# -- workload -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    task: str  # math | code | chat
    index: int  # position in its eval set
    ids: tuple[int, ...]  # chat-template token ids


@dataclass(frozen=True)
class Level:
    batch: int  # requests in flight
    requests: int
    new_tokens: int
    temperature: float

    @property
    def key(self) -> str:
        return f"b{self.batch}-t{self.temperature:g}"


def load_prompts(per_task: int, data_root: str | None = None, from_end: bool = False,
                 tasks: Sequence[str] = TASKS) -> list[Prompt]:
    """``per_task`` first turns of each of ``tasks`` (math, code and chat), interleaved (math 0,
    code 0, chat 0, math 1, ...): each eval set's first ones, or with ``from_end`` its last ones
    (in file order)."""
    from dspark.training.config import load_target_profile
    from dspark.training.data import load_eval_prompts
    from dspark.training.target import load_tokenizer

    tok = load_tokenizer(load_target_profile("smollm2-135m").source)
    chosen = {}
    for task in tasks:
        texts = load_eval_prompts(task, None if from_end else per_task, data_root)
        start = max(len(texts) - per_task, 0) if from_end else 0
        chosen[task] = list(enumerate(texts))[start:start + per_task]
    out = []
    for i in range(per_task):
        for task in tasks:
            if i < len(chosen[task]):
                index, text = chosen[task][i]
                ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)  # as Target.chat_prompt_ids
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                out.append(Prompt(task, index, tuple(int(t) for t in ids)))
    return out


def parse_tasks(text: str) -> list[str]:
    """``--tasks``: a comma list of distinct eval sets, in ``TASKS`` order."""
    tasks = [t for t in text.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks or len(set(tasks)) < len(tasks):
        raise ValueError(f"--tasks takes distinct names among {', '.join(TASKS)}, got {text!r}")
    return [t for t in TASKS if t in tasks]


def plan_levels(batches: Sequence[int], temperatures: Sequence[float], prompts_1: int, new_tokens_1: int,
                new_tokens_c: int, requests_per_slot: float = 1.0) -> list[Level]:
    """Every (temperature, batch) level: batch 1 runs ``prompts_1`` requests, batch B ``max(B, round(rps x B))``."""
    if any(b < 1 for b in batches) or not batches:
        raise ValueError(f"batches must be >= 1, got {list(batches)}")
    out = []
    for t in temperatures:
        if t < 0:
            raise ValueError(f"temperatures must be >= 0, got {t}")
        for b in batches:
            if b == 1:
                out.append(Level(1, prompts_1, new_tokens_1, float(t)))
            else:
                out.append(Level(b, max(b, int(round(requests_per_slot * b))), new_tokens_c, float(t)))
    return out


def level_prompts(prompts: Sequence[Prompt], level: Level) -> list[Prompt]:
    """The level's requests: the first ``level.requests`` prompts, all distinct (refused otherwise)."""
    chosen = list(prompts[: level.requests])
    if len(chosen) < level.requests or len({p.ids for p in chosen}) < len(chosen):
        raise ValueError(f"batch {level.batch} needs {level.requests} distinct prompts, the eval sets gave "
                         f"{len({p.ids for p in prompts})}: raise --prompts-per-task or lower --requests-per-slot")
    return chosen


def history_prompts(prompts_per_task: int, n: int, data_root: str | None = None,
                    tasks: Sequence[str] = TASKS) -> list[Prompt]:
    """``n`` prompts no level uses, the same whatever the levels need: the last ``ceil(n / len(tasks))``
    prompts of each task's eval set, interleaved; refused where they reach into the first
    ``prompts_per_task`` (the levels' prompts)."""
    per_task = -(-n // len(tasks))
    out = load_prompts(per_task, data_root, from_end=True, tasks=tasks)
    if any(p.index < prompts_per_task for p in out):
        raise ValueError(f"--history {n} takes each eval set's last {per_task} prompts, which overlap the first "
                         f"{prompts_per_task} the levels use: lower --history or --prompts-per-task")
    return out[:n]


# -- recording and driving -------------------------------------------------------------------------------
class Recorder:
    """Arrival times of every request's tokens -> per-request records (``sidebyside_report``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # seconds; a ``Drive`` sets its own clock
        self.submitted: dict[str, float] = {}
        self.events: dict[str, list[tuple[float, int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.counts: dict[str, tuple[int, int, int]] = {}  # rid -> (verify rounds, drafts verified, accepted)

    def submit(self, rid: str, now: float | None = None) -> None:
        self.submitted[rid] = self.clock() if now is None else now

    def arrive(self, rid: str, new: Sequence[int], now: float | None = None) -> None:
        if new:
            self.events.setdefault(rid, []).append((self.clock() if now is None else now, len(new)))
            self.tokens.setdefault(rid, []).extend(int(t) for t in new)

    def records(self, order: Sequence[tuple[str, str]]) -> list[dict]:
        """One record per ``(rid, task)`` in ``order``: tokens, seconds in flight, TTFT, the gaps
        between arrivals (n tokens arriving together give n gaps of gap / n) and engine counts."""
        out = []
        for rid, task in order:
            ev = self.events.get(rid, [])
            gaps = []
            for (a, _), (b, n) in zip(ev, ev[1:]):
                gaps += [(b - a) * 1000.0 / n] * n
            t0 = self.submitted.get(rid)
            rec = {"task": task, "tokens": self.tokens.get(rid, []), "gaps_ms": gaps,
                   "ttft_ms": (ev[0][0] - t0) * 1000.0 if ev and t0 is not None else None,
                   "seconds": ev[-1][0] - t0 if ev and t0 is not None else 0.0}
            if rid in self.counts:
                rec["rounds"], rec["drafted"], rec["accepted"] = self.counts[rid]
            out.append(rec)
        return out


class Drive:
    """One system's workload in flight, advanced one engine step at a time.

    One new request per ``advance()`` while fewer than ``concurrency`` run, until all are done;
    ``submit(rid, i)`` sends prompt i, ``step()`` runs one engine step and returns the ids that
    finished in it. The drive keeps a clock of its own that runs only inside ``advance()``
    (wall time less the time spent between its calls), and gives it to ``rec``: several drives
    taking turns on one host (``lockstep``) are each timed by their own steps, as if alone,
    while a slow spell of the host falls on all of them alike."""

    def __init__(self, prompts: Sequence[Sequence[int]], concurrency: int, submit: Callable[[str, int], None],
                 step: Callable[[], list[str]], busy: Callable[[], bool], rec: Recorder, tag: str) -> None:
        self.rids = [f"{tag}-{i}" for i in range(len(prompts))]
        self._pending = list(range(len(prompts)))
        self._running: set[str] = set()
        self._concurrency, self._submit, self._step, self._busy, self._rec = concurrency, submit, step, busy, rec
        self._away = 0.0  # wall seconds between advance() calls, off this drive's clock
        self._t0: float | None = None
        self._left: float | None = None  # when advance() last returned
        rec.clock = self.now

    def now(self) -> float:
        return time.perf_counter() - self._away

    @property
    def done(self) -> bool:
        return not (self._pending or self._running or self._busy())

    @property
    def seconds(self) -> float:
        """Seconds on this drive's clock from its first ``advance()`` to its last."""
        return 0.0 if self._t0 is None else self._left - self._away - self._t0

    def advance(self) -> None:
        t = time.perf_counter()
        if self._left is None:
            self._t0 = t
        else:
            self._away += t - self._left
        if self._pending and len(self._running) < self._concurrency:
            i = self._pending.pop(0)
            rid = self.rids[i]
            self._rec.submit(rid)
            self._submit(rid, i)
            self._running.add(rid)
        for rid in self._step():
            self._running.discard(rid)
        self._left = time.perf_counter()


def drive(prompts: Sequence[Sequence[int]], concurrency: int, submit: Callable[[str, int], None],
          step: Callable[[], list[str]], busy: Callable[[], bool], rec: Recorder, tag: str) -> tuple[list[str], float]:
    """One ``Drive`` alone until it is done -> (request ids in prompt order, seconds)."""
    d = Drive(prompts, concurrency, submit, step, busy, rec, tag)
    lockstep([d])
    return d.rids, d.seconds


def lockstep(drives: Sequence[Drive]) -> None:
    """Advance every unfinished drive by one step in turn until all are done, the turn's first drive
    rotating from one turn to the next: a step that runs right after another system's (its caches
    evicted, its allocator's state) falls on every system alike, not always on the same one."""
    live = [d for d in drives if not d.done]
    turn = 0
    while live:
        first = turn % len(live)
        for d in live[first:] + live[:first]:
            d.advance()
        live = [d for d in live if not d.done]
        turn += 1


# -- why a row is as fast as it is -------------------------------------------------------------------------
ROUND_PHASES = ("neural", "suffix", "verify", "host")


def attribute_step(totals: dict[str, dict[str, float]], deltas: dict[str, float], rids: Sequence[str]) -> None:
    """Add one engine step's decode time by phase to ``totals[rid]`` of each of its decode rows,
    an equal share each. ``deltas``: the step's seconds by engine phase (``EngineStats.seconds``); its decode
    time is ``step - prefill``, of which ``host`` is what neural, suffix and verify leave. A
    step without decode rows (prompt work only) is nobody's round."""
    if not rids:
        return
    decode = deltas["step"] - deltas["prefill"]
    split = {p: deltas[p] for p in ("neural", "suffix", "verify")}
    split["host"] = decode - sum(split.values())
    share = 1.0 / len(rids)
    for rid in rids:
        row = totals[rid]
        for p, sec in split.items():
            row[p] += sec * share


class EngineProbe:
    """Reads one ``SpecEngine``'s phase clock and records every verify round by request and proposer.

    The split of a decode step is the engine's own (``EngineStats.seconds``, phases
    ``proposers.stats.PHASES``): ``neural`` (the drafter pass), ``suffix`` (suffix lookups),
    ``verify`` (the target forward, with any prompt chunks fused into it, and the verify
    rule), ``host`` (the rest); ``prefill`` is the time of steps' prompt work outside the
    verify pass. The probe wraps ``step`` (to read each step's share), ``_commit`` (to record
    rounds) and the neural proposer's ``propose`` (to count its rows) on this instance only;
    the wrapped calls compute exactly what they did.

    Per request it also keeps each decode step's split, shared equally among the step's rows
    (``attribute_step``): a task's ms per round by phase (``round_ms_of``), which one request
    at a time is exactly its steps' split."""

    def __init__(self, engine) -> None:
        from .proposers.stats import PHASES  # the engine's modules load in the workers only
        self.engine = engine
        self._start = engine.stats.snapshot()
        self.calls: dict[str, int] = defaultdict(int)  # proposer -> steps it drafted in
        self.neural_rows = 0
        self.decode_steps = 0
        # rid -> proposer -> [rounds, drafted, accepted]; proposer -> verify-length counts
        self.by_request: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
        self.hist: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.row_seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # rid -> phase -> s
        self._step_rids: list[str] = []
        step = engine.step
        clock = engine.stats.seconds

        def attributed_step(*args, **kwargs):
            before = dict(clock)
            self._step_rids = []
            try:
                return step(*args, **kwargs)
            finally:
                attribute_step(self.row_seconds, {p: clock[p] - before[p] for p in PHASES}, self._step_rids)
        engine.step = attributed_step
        for name, proposer in (("neural", engine.neural), ("suffix", engine.suffix)):
            if proposer is not None:
                self._counted(proposer, name)
        commit = engine._commit

        def recording_commit(reqs, batch, lens, res, *rest):
            # host lists: three tensor reads per row cost the probed step about 0.2 ms beside 64 rows
            acc, verified = res.num_accepted.cpu().tolist(), lens.tolist()
            drafts = batch.lens.cpu().tolist() if batch.width > 0 else [0] * len(reqs)
            for i, r in enumerate(reqs):
                source = batch.source_of(i) if drafts[i] > 0 else "none"  # as the engine's stats
                c = self.by_request[r.rid][source]
                l_ = verified[i]
                c[0] += 1
                c[1] += l_
                c[2] += acc[i]
                h = self.hist[r.rid][source]
                h.extend([0] * (l_ + 1 - len(h)))
                h[l_] += 1
            self.decode_steps += 1
            self._step_rids = [r.rid for r in reqs]
            return commit(reqs, batch, lens, res, *rest)
        engine._commit = recording_commit

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds by phase since the probe was attached."""
        return self.engine.stats.since(self._start).seconds

    def _counted(self, proposer, name: str) -> None:
        """Count the steps ``proposer`` drafts in (and the neural proposer's rows)."""
        propose = proposer.propose

        def counted(slots, *args, **kwargs):
            self.calls[name] += 1
            if name == "neural":
                self.neural_rows += len(slots)
            return propose(slots, *args, **kwargs)
        proposer.propose = counted

    def proposers_of(self, rids: Sequence[str]) -> dict[str, dict]:
        """Rounds, drafts verified, accepted and verify-length counts by proposer over ``rids``."""
        out: dict[str, dict] = {}
        for rid in rids:
            for name, (n, d, a) in self.by_request.get(rid, {}).items():
                s = out.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0, "verify_len_hist": []})
                s["rounds"] += n
                s["drafted"] += d
                s["accepted"] += a
                h = self.hist[rid][name]
                s["verify_len_hist"].extend([0] * (len(h) - len(s["verify_len_hist"])))
                for l_, c in enumerate(h):
                    s["verify_len_hist"][l_] += c
        return out

    def round_ms_of(self, rids: Sequence[str]) -> dict | None:
        """ms per verify round over ``rids`` by phase (each round a row's equal share of its step)."""
        rounds = sum(n for rid in rids for n, _, _ in self.by_request.get(rid, {}).values())
        if not rounds:
            return None
        out = {p: 0.0 for p in ROUND_PHASES}
        for rid in rids:
            for p, sec in self.row_seconds.get(rid, {}).items():
                out[p] += 1000 * sec / rounds
        out["total"] = sum(out[p] for p in ROUND_PHASES)
        out["rounds"] = rounds
        return out

    def step_ms(self) -> dict:
        """Mean ms per decode step by phase (prefill: per engine step that ran one)."""
        n = max(self.decode_steps, 1)
        s = self.seconds
        decode = s["step"] - s["prefill"]
        return {"decode_steps": self.decode_steps, "total": 1000 * decode / n, "neural": 1000 * s["neural"] / n,
                "suffix": 1000 * s["suffix"] / n, "verify": 1000 * s["verify"] / n,
                "host": 1000 * (decode - s["neural"] - s["suffix"] - s["verify"]) / n,
                "prefill": 1000 * s["prefill"] / n,
                "neural_step_share": self.calls["neural"] / n if self.engine.neural is not None else None,
                "suffix_step_share": self.calls["suffix"] / n if self.engine.suffix is not None else None,
                "neural_rows": self.neural_rows / self.calls["neural"] if self.calls["neural"] else None}


# -- workers: one system, every level, in this process -------------------------------------------------------
def _params(level: Level, i: int, max_tokens: int | None = None):
    from .api import SamplingParams
    n = level.new_tokens if max_tokens is None else max_tokens
    if level.temperature == 0:
        return SamplingParams(max_tokens=n)
    return SamplingParams(max_tokens=n, temperature=level.temperature, seed=SEED_BASE + i)


def _engine_dir_parts(engine_dir: str | None, target, with_drafter: bool = True):
    """(drafter or None, SPS table or None, STS temperatures or None, suffix settings) of an engine
    directory; the drafter only ``with_drafter`` (the suffix rows use the directory's SPS table, not
    its drafter); the suffix settings are its ``engine.json`` ``suffix`` (``SuffixConfig`` fields)."""
    if engine_dir is None:
        return None, None, None, {}
    from dspark.training.checkpoint import load_checkpoint

    from .export.manifest import read_engine_json
    root = Path(engine_dir)
    meta = read_engine_json(root)
    drafter = load_checkpoint(root / meta.get("drafter_dir", "drafter"), target)[0] if with_drafter else None
    sps = sts = None
    if meta.get("sps"):
        from .sps import load_sps_table
        sps = load_sps_table(root / meta["sps"])
    if meta.get("sts"):
        from .sts import StsCalibration
        sts = StsCalibration.load(root / meta["sts"]).temperatures
    return drafter, sps, sts, dict(meta.get("suffix", {}))


def suffix_config(engine_suffix: dict, max_drafts: int | None = None, scope: str | None = None):
    """The suffix proposer's settings for our rows: the engine directory's (``engine.json``
    ``suffix``), with ``max_drafts`` / ``scope`` from the command line where given (3 drafts
    and the shared scope where neither says)."""
    from .proposers import SuffixConfig

    given = {k: v for k, v in (("max_drafts", max_drafts), ("scope", scope)) if v is not None}
    return SuffixConfig(**{"max_drafts": 3, **engine_suffix, **given})


def worker_history(spec: dict, temperatures: Sequence[float]) -> dict[str, list[list[int]]]:
    """The outputs of ``spec["history"]`` earlier requests (``history_prompts``) at each temperature, from
    our target-only engine with all of them in flight: what the shared suffix index of a server holds
    after serving them. Keyed by ``f"{temperature:g}"``; sampled requests carry seeds no level uses."""
    from dspark.training.config import load_target_profile
    from dspark.training.target import load_target

    from . import threads
    from .api import SamplingParams
    from .runtime import EngineConfig, SpecEngine

    threads.configure(spec["threads"])
    prompts = history_prompts(spec["prompts_per_task"], spec["history"], spec.get("data_root"),
                              spec.get("tasks", TASKS))
    target = load_target(load_target_profile("smollm2-135m"), device="cpu")
    eng = SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=len(prompts), threads=spec["threads"]))
    out = {}
    for t in temperatures:
        texts: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=spec["history_tokens"], temperature=t,
                                    seed=HISTORY_SEED_BASE + i if t > 0 else None)
            eng.submit(str(i), list(p.ids), params,
                       lambda o: texts.setdefault(o.request_id, []).extend(o.new_token_ids))
        eng.run_until_done()
        out[f"{t:g}"] = [texts[str(i)] for i in range(len(prompts))]
    return out


def worker_ours(systems: Sequence[str], spec: dict,
                work: list[tuple[Level, list[Prompt]]]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Our engine's ``systems`` in this process, each level with a fresh engine per system (an
    untimed warm-up on a prompt of its own first; the suffix rows' shared index then holds the
    history's outputs at the level's temperature, if any). Several systems run a level in
    ``lockstep``, one step of each in turn, on one loaded target. -> (results, info) by system."""
    from dspark.training.config import load_target_profile
    from dspark.training.target import load_target

    from . import threads
    from .runtime import EngineConfig, SpecEngine
    from .sps import load_sps_table

    import torch

    threads.configure(spec["threads"])
    targets: dict[torch.dtype, torch.nn.Module] = {}
    for system in systems:
        dtype = torch.bfloat16 if system.endswith("_bf16") else torch.float32
        if dtype not in targets:
            targets[dtype] = load_target(load_target_profile("smollm2-135m"), device="cpu", dtype=dtype)
    target32 = targets.get(torch.float32)
    drafter, sps, sts, suffix = _engine_dir_parts(spec.get("engine_dir"), target32,
                                                  with_drafter=any(s in NEEDS_DRAFTER for s in systems))
    if spec.get("sps"):
        sps = load_sps_table(spec["sps"])  # --sps overrides the engine directory's table
    base = EngineConfig(mode="spec", threads=spec["threads"], static_steps=spec["static_steps"],
                        suffix=suffix_config(suffix, spec["suffix_max_drafts"], spec["suffix_scope"]))
    history = json.loads(Path(spec["history_path"]).read_text()) if spec.get("history_path") else {}

    def engine_for(system: str, lv: Level) -> SpecEngine:
        if system in OURS_TARGET_ONLY:
            cfg = dataclasses.replace(base, mode="target_only", max_batch=lv.batch)
        else:
            scheduler = OURS_SCHEDULERS.get(system, "algorithm1") if sps is not None else "fixed"
            cfg = dataclasses.replace(base, proposers=OURS_PROPOSERS[system], max_batch=lv.batch, scheduler=scheduler)
        target = targets[torch.bfloat16 if system.endswith("_bf16") else torch.float32]
        return SpecEngine(target, drafter if system in NEEDS_DRAFTER else None, cfg, sps=sps, sts_temperatures=sts)

    def drive_of(eng: SpecEngine, lv: Level, ps: list[Prompt], max_tokens: int | None, tag: str,
                 rec: Recorder) -> Drive:
        finished: list[str] = []

        def cb(o):
            rec.arrive(o.request_id, o.new_token_ids)
            if o.finished:
                rec.counts[o.request_id] = (o.num_steps, o.num_draft_tokens, o.num_accepted_tokens)
                finished.append(o.request_id)

        def step():
            eng.step()
            done = list(finished)
            finished.clear()
            return done
        return Drive([p.ids for p in ps], lv.batch,
                     lambda rid, i: eng.submit(rid, list(ps[i].ids), _params(lv, i, max_tokens), cb), step,
                     eng.has_work, rec, tag)

    results: dict[str, list[dict]] = {s: [] for s in systems}
    engines: dict[str, SpecEngine] = {}
    for lv, prompts in work:
        runs = []
        for system in systems:
            eng = engines[system] = engine_for(system, lv)
            # warm-up (lazy inits, allocator) on a prompt no request has; the suffix index forgets it
            warm = Prompt("warmup", -1, tuple(reversed(prompts[0].ids)))
            lockstep([drive_of(eng, lv, [warm], 4, "warmup", Recorder())])
            if eng.suffix is not None and eng.suffix.shared is not None:
                eng.suffix.clear_shared()
                for toks in history.get(f"{lv.temperature:g}", []):
                    eng.suffix.add_shared(toks)
            rec = Recorder()
            runs.append((system, EngineProbe(eng), rec, drive_of(eng, lv, prompts, None, lv.key, rec)))
        lockstep([d for *_, d in runs])
        for system, probe, rec, d in runs:
            rids = d.rids
            records = rec.records(list(zip(rids, (p.task for p in prompts))))
            by_task = {t: ids for t in TASKS if (ids := [rid for rid, p in zip(rids, prompts) if p.task == t])}
            by_task["overall"] = rids
            proposers = ({t: probe.proposers_of(r) for t, r in by_task.items()}
                         if system not in OURS_TARGET_ONLY else None)
            results[system].append({"seconds": d.seconds, "request_records": records, "proposers": proposers,
                                    "step_ms": probe.step_ms(),
                                    "round_ms": {t: probe.round_ms_of(r) for t, r in by_task.items()}})
    info = {}
    for system in systems:
        eng = engines.get(system)
        i = threads.describe()
        i["attention"] = "varlen" if getattr(getattr(eng, "runner", None), "varlen", False) else "sdpa"
        i["dtype"] = "bfloat16" if system.endswith("_bf16") else "float32"
        i["sps"] = getattr(sps, "source", None) if sps is not None else None
        i["sps_engine"] = getattr(sps, "engine", None) if sps is not None else None
        i["lockstep"] = list(systems) if len(systems) > 1 else None
        if getattr(eng, "suffix", None) is not None:
            i["suffix"] = dataclasses.asdict(eng.suffix.cfg)  # the settings it ran with (engine dir + overrides)
        info[system] = i
    return results, info


def worker_hf(system: str, spec: dict, work: list[tuple[Level, list[Prompt]]]) -> tuple[list[dict], dict]:
    """transformers ``generate()``: static batches of the level's size (prompt lookup: one at a time)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from dspark.training.config import load_target_profile
    from dspark.training.target import load_target

    from . import threads

    threads.configure(spec["threads"])
    target = load_target(load_target_profile("smollm2-135m"), device="cpu")
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    lookup = system == "hf_prompt_lookup"

    class Stamps(BaseStreamer):
        """generate() calls put() with the prompt, then once per step with that step's new tokens."""

        def __init__(self):
            self.steps: list[tuple[float, int]] = []

        def put(self, value):
            # plain steps put [B] (one token per row), prompt-lookup steps [1, m] (m tokens at once)
            self.steps.append((time.perf_counter(), int(value.shape[-1]) if value.dim() == 2 else 1))

        def end(self):
            pass

    @torch.no_grad()
    def run(lv: Level, ps: list[Prompt], n: int, tag: str) -> tuple[list[dict], float]:
        rec = Recorder()
        batch = 1 if lookup else lv.batch
        t0 = time.perf_counter()
        for s in range(0, len(ps), batch):
            chunk = ps[s:s + batch]
            w = max(len(p.ids) for p in chunk)
            ids = torch.tensor([[pad] * (w - len(p.ids)) + list(p.ids) for p in chunk])
            attn = torch.tensor([[0] * (w - len(p.ids)) + [1] * len(p.ids) for p in chunk])
            rids = [f"{tag}-{s + j}" for j in range(len(chunk))]
            for r in rids:
                rec.submit(r)
            st = Stamps()
            kw = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if lookup else {}
            if lv.temperature > 0:
                torch.manual_seed(SEED_BASE + s)
                kw.update(do_sample=True, temperature=lv.temperature, top_k=0, top_p=1.0)
            else:
                kw.update(do_sample=False)
            # eos_token_id=[]: EOS is an ordinary token, as in our engine without stop tokens (no stop
            # at it, and no masking of it: min_new_tokens would mask it and change the greedy tokens)
            out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, eos_token_id=[],
                                        pad_token_id=pad, streamer=st, **kw)
            stamps = st.steps[1:]  # the first put() is the prompt
            for j, r in enumerate(rids):
                toks = out[j, w:].tolist()
                k = 0
                for when, m in stamps:  # a prompt-lookup step emits m tokens at once
                    if k >= len(toks):
                        break
                    rec.arrive(r, toks[k:k + m], when)
                    k += m
        secs = time.perf_counter() - t0
        return rec.records([(f"{tag}-{i}", p.task) for i, p in enumerate(ps)]), secs

    results = []
    for lv, prompts in work:
        run(lv, prompts[:1], 2, "warmup")
        records, secs = run(lv, prompts, lv.new_tokens, lv.key)
        results.append({"seconds": secs, "request_records": records})
    return results, threads.describe()


def _vllm_spec_counts(llm) -> tuple[int, int] | None:
    """(drafts, accepted tokens) from vLLM's metrics so far, or None where it does not report them."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # older vLLM, or metrics off: the row just has no accept_len
        return None
    sums: dict[str, int] = {}
    for m in metrics:  # one counter per engine-core label set: summed
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            sums[m.name] = sums.get(m.name, 0) + int(getattr(m, "value", 0))
    if len(sums) < 2:
        return None
    return sums["vllm:spec_decode_num_drafts"], sums["vllm:spec_decode_num_accepted_tokens"]


def worker_vllm(system: str, spec: dict, work: list[tuple[Level, list[Prompt]]]) -> tuple[list[dict], dict]:
    """vLLM (fp32, prefix caching off, greedy or seeded T=1), in flight through ``LLMEngine.step``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["vllm_kv_gib"]))
    from vllm import LLM, SamplingParams

    from dspark.training.config import load_target_profile
    from dspark.training.target import resolve_hf_dir

    model = str(resolve_hf_dir(load_target_profile("smollm2-135m").source))  # the same fp32 weights as ours
    kw = {"speculative_config": dict(VLLM_NGRAM)} if system == "vllm_ngram" else {}
    t = time.perf_counter()
    llm = LLM(model=model, dtype="float32", gpu_memory_utilization=spec["vllm_memory"], max_model_len=2048, seed=0,
              enable_prefix_caching=False, max_num_seqs=max(lv.batch for lv, _ in work), disable_log_stats=False, **kw)
    start_s = time.perf_counter() - t
    eng = llm.llm_engine
    results = []
    for lv, prompts in work:
        def run(ps: list[Prompt], n: int, tag: str, rec: Recorder):
            seen: dict[str, int] = {}

            def params(i: int):
                # ignore_eos: EOS neither stops nor is masked (min_tokens would mask it), as in our engine
                if lv.temperature == 0:
                    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                return SamplingParams(temperature=lv.temperature, seed=SEED_BASE + i, max_tokens=n, ignore_eos=True)

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
            return drive([p.ids for p in ps], lv.batch,
                         lambda rid, i: eng.add_request(rid, {"prompt_token_ids": list(ps[i].ids)}, params(i)), step,
                         eng.has_unfinished_requests, rec, tag)
        run(prompts[:1], 4, "warmup", Recorder())
        before = _vllm_spec_counts(llm)
        rec = Recorder()
        rids, secs = run(prompts, lv.new_tokens, lv.key, rec)
        after = _vllm_spec_counts(llm)
        records = rec.records(list(zip(rids, (p.task for p in prompts))))
        level = {"seconds": secs, "request_records": records}
        if before is not None and after is not None and after[0] > before[0]:
            level["vllm_spec"] = {"drafts": after[0] - before[0], "accepted": after[1] - before[1]}
        results.append(level)
    omp = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return results, {"threads": None, "pinning": f"VLLM_CPU_OMP_THREADS_BIND={omp}", "start_s": start_s,
                     "speculative_config": kw.get("speculative_config")}


def worker_main(spec_path: str, out_path: str) -> None:
    """Run the spec's systems (several only for our engine's lockstep) -> ``{system: {info, levels}}``."""
    spec = json.loads(Path(spec_path).read_text())
    systems = spec["systems"]
    if systems == ["history"]:
        Path(out_path).write_text(json.dumps(worker_history(spec, spec["temperatures"])))
        return
    prompts = load_prompts(spec["prompts_per_task"], spec.get("data_root"), tasks=spec.get("tasks", TASKS))
    work = [(lv, level_prompts(prompts, lv)) for lv in (Level(**d) for d in spec["levels"])]
    if all(s.startswith("ours") for s in systems):
        results, info = worker_ours(systems, spec, work)
    elif len(systems) == 1 and systems[0].startswith(("vllm", "hf")):
        worker = worker_vllm if systems[0].startswith("vllm") else worker_hf
        one, one_info = worker(systems[0], spec, work)
        results, info = {systems[0]: one}, {systems[0]: one_info}
    else:
        raise ValueError(f"one worker runs one peer or several of our systems, got {systems}")
    for levels in results.values():
        for (lv, _), r in zip(work, levels):
            r.update(dataclasses.asdict(lv))
    Path(out_path).write_text(json.dumps({s: {"info": info[s], "levels": results[s]} for s in systems}))


# -- orchestration ------------------------------------------------------------------------------------------
def vllm_importable(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def resolve_systems(names: str) -> list[str]:
    """Comma list of system names or aliases -> known systems in the given order (unknown: ValueError)."""
    out = []
    for n in (x.strip() for x in names.split(",") if x.strip()):
        s = ALIASES.get(n, n)
        if s not in SYSTEMS:
            raise ValueError(f"unknown system {n!r}; known: {', '.join(SYSTEMS)} (aliases: {', '.join(ALIASES)})")
        if s not in out:
            out.append(s)
    return out


def levels_for(system: str, levels: list[Level], peer_temperatures: Sequence[float] | None = None,
               peer_batches: Sequence[int] | None = None) -> list[Level]:
    """The levels a system runs: transformers' prompt lookup has no batching, so batch 1 only; the
    peers (transformers, vLLM) only at ``peer_temperatures`` and ``peer_batches`` when given."""
    if not system.startswith("ours"):
        if peer_temperatures is not None:
            levels = [lv for lv in levels if lv.temperature in peer_temperatures]
        if peer_batches is not None:
            levels = [lv for lv in levels if lv.batch in peer_batches]
    return [lv for lv in levels if lv.batch == 1] if system == "hf_prompt_lookup" else levels


def run_order(systems: Sequence[str], levels: Sequence[Level], rounds: int, by_level: bool,
              few: Iterable[str] = (), few_rounds: int = 1,
              lockstep: Iterable[str] = ()) -> list[tuple[int, tuple[str, ...], list[Level]]]:
    """(round, systems of one worker process, its levels) in the order they run.

    ``by_level``: one process per level and system, the systems of a level run back to back
    (their order rotating with the round and the level), so the runs a same-round ratio pairs
    are minutes apart, not a whole round: a slow spell of a shared host then lands on both
    sides of a ratio. Otherwise one process per system and round, runs every level in turn.
    A system in ``few`` runs only in the first ``few_rounds`` rounds. The systems in
    ``lockstep`` that run in a round share one process, one step of each in turn (their
    ratios then pair steps a fraction of a second apart); they rotate as one unit, in the
    place of the first of them."""
    few, lock = set(few), set(lockstep)
    order = []
    for rnd in range(rounds):
        chosen = [s for s in systems if s not in few or rnd < few_rounds]
        together = tuple(s for s in chosen if s in lock)
        units: list[tuple[str, ...]] = []
        for s in chosen:
            unit = together if s in lock else (s,)
            if unit not in units:
                units.append(unit)
        if not by_level:
            k = rnd % len(units) if units else 0
            order += [(rnd, u, list(levels)) for u in units[k:] + units[:k]]
            continue
        for i, lv in enumerate(levels):
            k = (rnd + i) % len(units) if units else 0
            order += [(rnd, u, [lv]) for u in units[k:] + units[:k]]
    return order


def build_parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    """The harness's options; ``defaults`` (e.g. the engine-vs-vLLM script's) override the decode ones."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="ours_target_only,ours_spec,ours_suffix,ours_hybrid,hf_generate,"
                                         "hf_prompt_lookup,vllm_target_only,vllm_ngram")
    ap.add_argument("--batches", default="1,4,16,64", help="requests in flight per level")
    ap.add_argument("--temperatures", default="0", help="comma list, e.g. 0,1 (T=1 requests carry seeds)")
    ap.add_argument("--peer-temperatures", default=None,
                    help="comma list: the temperatures transformers and vLLM run at (default: all of --temperatures)")
    ap.add_argument("--peer-batches", default=None,
                    help="comma list: the batches transformers and vLLM run at (default: all of --batches)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order", choices=("lockstep", "levels", "systems"), default="lockstep",
                    help="lockstep: a process per level and round runs our systems one step of each in turn, a "
                         "process per peer, a level's runs back to back; levels: a process per system and level; "
                         "systems: a process per system and round, running every level")
    ap.add_argument("--few-rounds", default="hf_generate,hf_prompt_lookup",
                    help="systems that run only in the first --few round(s) (peers outside the headline ratios)")
    ap.add_argument("--few", type=int, default=1)
    ap.add_argument("--prompts-1", type=int, default=6, help="requests at batch 1 (interleaved math, code, chat)")
    ap.add_argument("--new-tokens-1", type=int, default=256)
    ap.add_argument("--new-tokens-c", type=int, default=128, help="new tokens per request at batch > 1")
    ap.add_argument("--requests-per-slot", type=float, default=1.0, help="requests at batch B = max(B, this x B)")
    ap.add_argument("--prompts-per-task", type=int, default=22)
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help="comma list of the eval sets the requests (and the --history requests) come from: "
                         "one task alone is that task's workload, every batch of it that task's requests")
    ap.add_argument("--threads", type=int, default=0, help="our engine's and generate()'s intra-op threads (0: all cores)")
    ap.add_argument("--static-steps", default="auto")
    ap.add_argument("--engine-dir", default=None,
                    help="engine directory: its drafter (ours_spec, ours_hybrid) and SPS/STS files (every ours row)")
    ap.add_argument("--sps", default=None, help="SPS table for our scheduled rows (overrides the engine directory's)")
    ap.add_argument("--suffix-max-drafts", type=int, default=None,
                    help="drafts per suffix proposal (default: the engine directory's, else 3)")
    ap.add_argument("--suffix-scope", default=None,
                    help="shared | request (default: the engine directory's, else shared)")
    ap.add_argument("--history", type=int, default=0,
                    help="earlier requests whose outputs the shared suffix index holds when a level starts (each "
                         "eval set's last prompts, which no level uses; 0: every level starts with an empty index)")
    ap.add_argument("--history-tokens", type=int, default=128, help="new tokens of each --history request")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--vllm-memory", type=float, default=0.3)
    ap.add_argument("--out-dir", default="docs/benchmarks")
    ap.add_argument("--name", default="decode")
    ap.add_argument("--title", default="Decode benchmark, side by side")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    if defaults:
        ap.set_defaults(**defaults)
    return ap


def main(argv: Sequence[str] | None = None, defaults: dict | None = None, command: str | None = None) -> dict | None:
    """Run the benchmark (or, with ``--worker``, one system's runs) and write the report."""
    from tqdm.auto import tqdm

    args = build_parser(defaults).parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return None
    try:
        systems = resolve_systems(args.systems)
        args.tasks = parse_tasks(args.tasks)
        levels = plan_levels([int(b) for b in args.batches.split(",") if b],
                             [float(t) for t in args.temperatures.split(",") if t], args.prompts_1, args.new_tokens_1,
                             args.new_tokens_c, args.requests_per_slot)
    except ValueError as exc:
        sys.exit(f"bench: {exc}")
    notes = []
    if any(s.startswith("vllm") for s in systems) and not vllm_importable(sys.executable):
        notes.append(f"vLLM is not importable from {sys.executable} (bash scripts/setup_vllm.sh, then run with "
                     ".venv-vllm/bin/python): the vLLM rows were not run and there is no `x vLLM` column.")
        systems = [s for s in systems if not s.startswith("vllm")]
    if not args.engine_dir and any(s in NEEDS_DRAFTER for s in systems):
        skipped = [s for s in systems if s in NEEDS_DRAFTER]
        notes.append(f"{', '.join(skipped)} not run: no engine directory with a drafter was given (--engine-dir; "
                     "build one with scripts/build_engine.sh).")
        systems = [s for s in systems if s not in NEEDS_DRAFTER]
    if any(s.startswith("ours") and s not in OURS_TARGET_ONLY for s in systems) and not (args.sps or args.engine_dir):
        notes.append("no SPS table (--sps or the engine directory's): our speculative rows verify fixed lengths.")
    print("systems:", ", ".join(systems), *(["\n" + n for n in notes]), flush=True)
    if not systems:
        sys.exit("bench: no system left to run")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    few = {ALIASES.get(x, x) for x in args.few_rounds.split(",") if x}
    peer_t = None if args.peer_temperatures is None else [float(t) for t in args.peer_temperatures.split(",") if t]
    raw: dict[str, list[dict]] = {s: [] for s in systems}
    tmp = out_dir / f".{args.name}.worker"
    command = command or " ".join(["python -m dspark.engine.sidebyside", *(argv if argv is not None else sys.argv[1:])])
    history_path = None
    if args.history > 0 and any(s in ("ours_suffix", "ours_hybrid", "ours_hybrid_no_slowdown") for s in systems):
        history_path = f"{tmp}.history.json"
        spec = {"systems": ["history"], "history": args.history, "history_tokens": args.history_tokens,
                "temperatures": sorted({lv.temperature for lv in levels}),
                **{k2: getattr(args, k2) for k2 in ("prompts_per_task", "data_root", "threads", "tasks")}}
        Path(f"{tmp}.spec.json").write_text(json.dumps(spec))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dspark.engine.sidebyside", "--worker", f"{tmp}.spec.json",
                        history_path], check=True)
        print(f"history: {args.history} requests x {args.history_tokens} tokens per temperature "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    report = None
    peer_b = None if args.peer_batches is None else [int(b) for b in args.peer_batches.split(",") if b]
    lock = [s for s in systems if s.startswith("ours")] if args.order == "lockstep" else []
    plan = run_order(systems, levels, args.rounds, args.order != "systems", few, args.few, lock)
    for rnd, group, lvs in tqdm(plan, desc="side by side", unit="run", file=sys.stdout):
        lvs = levels_for(group[0], lvs, peer_t, peer_b)  # a lockstep group is ours: every level
        if not lvs:
            continue
        # a lockstep worker builds its engines in this order, rotating by round (they share the packed weights,
        # whose separate copies once made the build order matter: cpu_decoder.shared_stack)
        k = rnd % len(group)
        spec = {"systems": list(group[k:] + group[:k]), "levels": [dataclasses.asdict(lv) for lv in lvs],
                **{k2: getattr(args, k2) for k2 in ("prompts_per_task", "data_root", "threads", "tasks",
                                                     "static_steps", "engine_dir", "sps", "suffix_max_drafts",
                                                     "suffix_scope", "vllm_kv_gib", "vllm_memory")},
                "history_path": history_path}
        Path(f"{tmp}.spec.json").write_text(json.dumps(spec))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dspark.engine.sidebyside", "--worker", f"{tmp}.spec.json",
                        f"{tmp}.out.json"], check=True)
        for system, res in json.loads(Path(f"{tmp}.out.json").read_text()).items():
            runs = raw[system]
            while len(runs) <= rnd:  # a round's levels gather in one entry, whichever process ran them
                runs.append({"system": system, "info": res["info"], "levels": []})
            runs[rnd]["levels"] += res["levels"]
            tps = ", ".join(f"{lv['batch']}@T{lv['temperature']:g} "
                            f"{sum(len(r['tokens']) for r in lv['request_records']) / lv['seconds']:.1f}"
                            for lv in res["levels"])
            tqdm.write(f"round {rnd + 1} {system}: {tps} tok/s", file=sys.stdout)
        tqdm.write(f"  ({time.perf_counter() - t:.0f} s)", file=sys.stdout)
        # the report so far after every run: a run cut short still leaves its finished rounds
        report = _report({s: r for s, r in raw.items() if r}, args, systems, notes, command)
        write_report(report, out_dir, args.name)
    for suffix in (".spec.json", ".out.json", ".history.json"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    print((out_dir / f"{args.name}.md").read_text())
    return report


def _report(raw: dict[str, list[dict]], args, systems: list[str], notes: list[str], command: str) -> dict:
    from .host import cpu_model

    results, task_results = summarise(raw)
    for row in results:  # vLLM's own speculation counters over the run, where it reports them (unchecked)
        if row["system"] == "vllm_ngram":
            lv = next((lv for lv in raw["vllm_ngram"][0]["levels"] if lv["batch"] == row["batch"]
                       and lv["temperature"] == row["temperature"]), {})
            row["vllm_spec_counters"] = lv.get("vllm_spec")
    ours = raw.get("ours_target_only") or next((r for s, r in raw.items() if s.startswith("ours")), None)
    threads = ours[0]["info"]["threads"] if ours else args.threads
    return {"title": args.title, "host": cpu_model(), "threads": threads, "command": command,
            "rounds": args.rounds, "systems": systems, "rounds_per_system": {s: len(r) for s, r in raw.items()},
            "notes": notes, "systems_info": {s: r[0]["info"] for s, r in raw.items()},
            "settings": {"order": args.order, "peer_batches": args.peer_batches, "engine_dir": args.engine_dir,
                         "sps": args.sps, "suffix_max_drafts": args.suffix_max_drafts,
                         "suffix_scope": args.suffix_scope, "prompts_per_task": args.prompts_per_task,
                         "history": args.history, "history_tokens": args.history_tokens, "tasks": args.tasks,
                         "hf_prompt_lookup_tokens": HF_LOOKUP_TOKENS, "vllm_ngram": VLLM_NGRAM},
            "results": results, "task_results": task_results}


if __name__ == "__main__":
    main()
