"""The speculative decoding engine: in-flight batching over a target and its proposers.

One ``step()`` reads admit -> prefill -> propose -> schedule -> verify -> commit -> emit:
1. admit queued requests into free slots (requests join between steps); every proposer
   (``engine/proposers/``) gets the prompt;
2. prefill: requests still reading their prompt run one chunk each (at most
   ``prefill_chunk`` tokens, and ``prefill_tokens`` over all of them, oldest first), so a
   long prompt or a burst of arrivals never stalls the running batch for more than one
   chunk; a request whose prompt is done gets its first token through the verify rule
   with zero drafts;
3. propose: each decoding request gets one proposal (``EngineConfig.proposers``): the suffix
   proposer's, the neural drafter's (unless the drafting gate, ``draft_gate.py``, predicts
   that a plain step is faster, or the request's suffix proposal already wins), or none;
4. schedule: the verify-length policy picks how many drafts each request verifies (``l_r``);
5. verify: the target runs the ragged batch ``[anchor, d_1..d_l]`` once and the verify rule
   accepts a prefix and emits a recovered or bonus token (lossless for greedy and sampled
   requests);
6. commit: accepted tokens enter the target's cache (rejected K/V are trimmed by length),
   the proposers and ``EngineStats``;
7. emit: tokens stream to each request's callback; finished requests leave (their slots
   are compacted).

``mode="target_only"`` is the same engine with the null proposer: every verify length 0,
plain decoding, the baseline for every speculative comparison.

Sampled requests are verified by one of two rules (``EngineConfig.sampling_rule``,
docs/runtime.md "Seeded sampling"): the coupled rule of ``plugins/coupled.py``, whose output
is a function of (seed, prompt, sampling parameters) alone, the same with any drafter or
none, in any batch, whatever the gate and the scheduler decided; or rejection sampling
(``plugins.reference.verify`` / the CUDA op), whose tokens also depend on the drafts and on
how many of them were verified. ``auto`` gives the coupled rule to requests that carry a seed
(a seed promises reproducible tokens) and rejection sampling to the others.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.plugins import coupled, ops
from dspark.plugins import reference as verify_ref

from .api import OutputCallback, RequestOutput, RequestValidationError, SamplingParams
from .draft_gate import DraftGate, gated_rows, least_recent
from .proposers import (DraftBatch, EngineStats, NeuralProposer, Proposer, SuffixConfig, SuffixProposer,
                        build_proposer)
from .proposers.registry import PROPOSERS
from .scheduler import SPS_SCHEDULERS, make_scheduler
from .sps import SpsTable
from .static_target import with_static_steps
from .target_runner import RaggedOutput, TargetRunner
from . import host_memory, threads

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    mode: str = "spec"  # spec | target_only (the null proposer, whatever ``proposers`` says)
    # drafting methods, "+"-joined: neural (the engine dir's drafter) | suffix | neural+suffix (hybrid)
    proposers: str = "neural"
    suffix: SuffixConfig = field(default_factory=lambda: SuffixConfig(max_drafts=3))  # the suffix proposer's settings
    suffix_sts: tuple[float, ...] | None = None  # STS temperatures of the suffix confidences (None: raw)
    scheduler: str = "fixed"  # fixed | threshold | algorithm1 | no_slowdown | async (engine/scheduler.py)
    threshold: float = 0.3  # for the static threshold policy
    max_batch: int = 64
    max_context: int = 2048
    prefill_chunk: int = 256  # most prompt tokens of one request per step
    # most prompt tokens of all requests per step (0: no limit): a burst of new requests then
    # prefills over several steps, oldest first, and the running ones decode in between
    prefill_tokens: int = 1024
    seed: int = 0  # seeds the seeds of requests that come without one
    # the verify rule of sampled requests: coupled (all) | rejection (all; a seed then does not
    # make tokens reproducible across batches) | auto (coupled with a seed, rejection without);
    # docs/runtime.md "Seeded sampling"
    sampling_rule: str = "coupled"
    static_steps: str = "auto"  # auto (CUDA graphs on a GPU, off on CPU) | graphs | eager | off: engine/static_target.py
    attention: str = "auto"  # auto (varlen kernel for fp32 on CPU) | varlen | sdpa: engine/target_runner.py
    layers: str = "auto"  # auto (one C++ call for the decoder stack where it fits) | fused | torch: engine/cpu_decoder.py
    # prompt chunks in the same target pass as the verify rows (with varlen attention, no static steps)
    fused_prefill: bool = True
    threads: int = 0  # intra-op threads (0: torch's default, one per usable core): engine/threads.py
    # on the CPU, keep freed host memory in the process (no page faults per step): engine/host_memory.py
    retain_host_memory: bool = True
    adaptive_drafting: bool = True  # skip the drafter on steps where it cannot pay (engine/draft_gate.py)
    record_rounds: bool = False  # keep per-round (verify len, accepted, confidences) for eval/calibration


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    callback: OutputCallback
    slot: int = -1
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    anchor: int | None = None
    steps: int = 0
    last_drafted: int = -1  # engine round of this request's latest draft (gate probes pick the oldest)
    last_suffix: int = -1  # engine round of this request's latest suffix lookup (the same, for the suffix gate)
    drafted: int = 0
    accepted: int = 0
    cancelled: bool = False
    finished: bool = False
    seed: int = 0
    coupled: bool = True  # verified by the coupled rule (else rejection sampling)
    t_submit: float = 0.0


@dataclass
class RoundRecord:
    request_id: str
    verify_len: int
    accepted: int
    conf_logits: list[float] | None


class SpecEngine:
    """Batched speculative decoding (implements ``engine.api.GenerationEngine``).

    ``drafter``: the trained drafter behind the ``neural`` proposer (None without one);
    ``EngineConfig.proposers`` names the drafting methods (``engine/proposers/``)."""

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, sps=None, sts_temperatures=None):
        self.cfg = config or EngineConfig()
        if self.cfg.prefill_chunk < 1 or self.cfg.prefill_tokens < 0:
            raise ValueError(f"need prefill_chunk >= 1 and prefill_tokens >= 0, got {self.cfg.prefill_chunk}, "
                             f"{self.cfg.prefill_tokens}")
        if self.cfg.mode not in ("spec", "target_only"):
            raise ValueError(f"mode must be spec or target_only, got {self.cfg.mode!r}")
        if self.cfg.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, "
                             f"got {self.cfg.sampling_rule!r}")
        names = parse_proposers(self.cfg.proposers) if self.cfg.mode == "spec" else ["none"]
        if "neural" in names and drafter is None:
            raise ValueError("speculative mode needs a drafter checkpoint (build one with scripts/build_engine.sh)")
        self.target = target
        self.max_context = self.cfg.max_context
        self.threads = threads.configure(self.cfg.threads)
        self.runner = TargetRunner(target, self.cfg.max_batch, max_context=self.cfg.max_context,
                                   attention=self.cfg.attention, layers=self.cfg.layers)
        if self.cfg.retain_host_memory and self.runner.device.type == "cpu":
            host_memory.retain_freed_memory()
        log.info("engine: %s, target %s, attention %s, layers %s, proposers %s", threads.describe(),
                 str(self.runner.dtype).removeprefix("torch."), "varlen" if self.runner.varlen else "sdpa",
                 "fused" if self.runner.stack is not None else "torch", "+".join(names))
        self.drafter = drafter if "neural" in names else None
        self.proposers: list[Proposer] = [
            build_proposer(n, max_slots=self.cfg.max_batch, drafter=self.drafter, sps=sps,
                           sts_temperatures=sts_temperatures if n == "neural" else self.cfg.suffix_sts,
                           suffix=self.cfg.suffix) for n in names]
        self.neural: NeuralProposer | None = next((p for p in self.proposers if isinstance(p, NeuralProposer)), None)
        self.suffix: SuffixProposer | None = next((p for p in self.proposers if isinstance(p, SuffixProposer)), None)
        self._by_name = {p.name: p for p in self.proposers}
        self.K = max(p.max_drafts for p in self.proposers)
        self.need_features = any(p.needs_features for p in self.proposers)
        self._use_static_steps()
        # prompt chunks ride in the verify pass where attention is packed (no padded grid) and no
        # fixed-shape steps are replayed (a mixed step fits no bucket)
        self._fused = self.cfg.fused_prefill and isinstance(self.runner, TargetRunner) and self.runner.varlen
        has_conf = self.suffix is not None or (self.neural is not None and self.neural.has_confidence)
        sched = self.cfg.scheduler if has_conf else "fixed"
        if sched in SPS_SCHEDULERS and sps is None:
            raise ValueError(f"scheduler {sched!r} needs an SPS table (dspark profile)")
        kwargs = {"sps": sps} if sched in SPS_SCHEDULERS else {}
        if sched == "threshold":
            kwargs = {"threshold": self.cfg.threshold}
        self.policy = make_scheduler(sched, **kwargs)
        self.gate = self._make_gate(sps, sched)
        self.suffix_gate = self._make_suffix_gate(sps, sched)
        self._suffix_looked: list[int] = []  # rows of this step's batch whose suffix lookups ran
        self.verify = ops.verify  # the CUDA kernel for CUDA tensors, the reference otherwise
        self.device = self.runner.device
        self._seeds = random.Random(self.cfg.seed)  # seeds for requests without one
        self._queue: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self.rounds: list[RoundRecord] = []
        self.stats = EngineStats()

    def _use_static_steps(self) -> None:
        """Decode steps at fixed shapes (``static_target.py``): CUDA graphs on a GPU."""
        self.runner = with_static_steps(self.runner, self.cfg.static_steps, self.cfg.max_batch, self.K,
                                        self.cfg.prefill_chunk)

    def _make_gate(self, sps, sched: str) -> DraftGate | None:
        """The cost-aware gate over the neural pass, with the hardware-aware schedulers and a known drafter cost."""
        if not (self.cfg.adaptive_drafting and self.neural is not None and sched in SPS_SCHEDULERS):
            return None
        cost = self.neural.cost()
        if not (isinstance(sps, SpsTable) and cost.known):
            log.info("adaptive drafting off: the SPS table has no drafter cost (dspark profile --checkpoint)")
            return None
        budget = {"probe_budget": HYBRID_PROBE_BUDGET} if self.suffix is not None else {}  # alone: the default
        return DraftGate(sps, max_tokens=self.cfg.max_batch * (self.K + 1), draft_time=cost.seconds,
                         catchup_time=cost.catchup_seconds, probe_rows=NEURAL_PROBE_ROWS,
                         probe_growth=NEURAL_PROBE_GROWTH, row_drafts=self.neural.max_drafts, **budget)

    def _make_suffix_gate(self, sps, sched: str) -> DraftGate | None:
        """The same gate over the suffix lookups (their host cost against their realised gain),
        with the hardware-aware schedulers: where suffix drafts do not pay (a large batch, T=1),
        the lookups stop too. One imaginary empty row of prior (a wrong lookup costs only host time),
        and lookups costing under 2% of a plain step always run (a small batch: skipping them can
        save little, while a skip that misses a match forgoes whole drafts)."""
        if not (self.cfg.adaptive_drafting and self.suffix is not None and sched in SPS_SCHEDULERS
                and isinstance(sps, SpsTable)):
            return None
        return DraftGate(sps, max_tokens=self.cfg.max_batch * (self.K + 1), draft_time=self.suffix.cost().seconds,
                         prior_rows=1.0, free_share=0.02, probe_budget=SUFFIX_PROBE_BUDGET,
                         row_drafts=self.suffix.max_drafts)

    # -- the neural drafter's runner and backlog bound (tests and tools reach the drafter here) ------
    @property
    def draft_runner(self):
        """The neural proposer's draft runner (``engine/draft_runner.py``), or None."""
        return self.neural.runner if self.neural is not None else None

    @draft_runner.setter
    def draft_runner(self, runner) -> None:
        if self.neural is None:
            raise ValueError("this engine has no neural proposer")
        self.neural.runner = runner

    @property
    def MAX_BACKLOG_TOKENS(self) -> int:  # noqa: N802 (the neural proposer's bound, by its old name)
        return self.neural.max_backlog_tokens if self.neural is not None else 0

    @MAX_BACKLOG_TOKENS.setter
    def MAX_BACKLOG_TOKENS(self, n: int) -> None:  # noqa: N802
        if self.neural is not None:
            self.neural.max_backlog_tokens = n

    # -- public API -------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback) -> None:
        if not prompt_ids:
            raise RequestValidationError("the prompt is empty")
        params.validate()
        if len(prompt_ids) + params.max_tokens + self.K + 1 > self.max_context:
            raise RequestValidationError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {self.max_context}")
        vocab = self.target.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestValidationError(f"prompt token ids must lie in [0, {vocab})")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = _Request(request_id, list(prompt_ids), params, on_output, seed=seed, t_submit=time.perf_counter(),
                       coupled=_is_coupled(self.cfg.sampling_rule, params.seed is not None))
        with self._wake:
            self._queue.append(req)
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            for r in list(self._queue) + self._active:
                if r.rid == request_id:
                    r.cancelled = True

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            for r in list(self._queue) + self._active:
                r.cancelled = True
        self._reap()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._active)

    def run_until_done(self) -> None:
        """Synchronous driver (tests, eval, benchmarks): step until every request finished."""
        while self.has_work():
            self.step()

    # -- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not (self._queue or self._active):
                    self._wake.wait(timeout=0.5)
                if not self._running:
                    return
            try:
                self.step()
            except Exception as exc:  # never let one bad step kill the server: fail the batch, keep serving
                log.exception("engine step failed")
                with self._lock:
                    victims = list(self._active)
                for r in victims:
                    self._finish(r, "error", error=f"engine step failed: {exc}")
                self._reap()

    def step(self) -> None:
        """admit -> prefill -> propose -> schedule -> verify -> commit -> emit (one engine step)."""
        with self._timed("step"):
            self._reap()
            self._admit()
            prefilling = [r for r in self._active if r.anchor is None and not r.finished]
            decoding = [r for r in self._active if r.anchor is not None and not r.finished]
            chunks = self._prefill_chunks(prefilling) if prefilling else []
            if chunks and not (decoding and self._fused):
                with self._timed("prefill"):
                    self._prefill(chunks, self._prefill_forward(chunks))
                chunks = []
            if decoding:
                temps = torch.tensor([r.params.temperature for r in decoding])
                fused = sum(n for _, n in chunks)  # prompt tokens in this step's target pass: part of its price
                batch = self._propose(decoding, temps, fused)
                lens = self._schedule(decoding, batch, fused)
                with self._timed("verify"):
                    res, out, prefill_out = self._verify_round(decoding, batch, lens, temps, chunks)
                self._commit(decoding, batch, lens, res, out)
                if chunks:
                    with self._timed("prefill"):
                        self._prefill(chunks, prefill_out)
            self.stats.steps += 1
            self._reap()

    @contextmanager
    def _timed(self, phase: str):
        """Add the wall time of the ``with`` body to ``stats.seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds[phase] += time.perf_counter() - start

    # -- phases ---------------------------------------------------------------------------------------
    def _admit(self) -> None:
        admitted = False
        with self._lock:
            while self._queue and len(self._active) < self.cfg.max_batch:
                r = self._queue.popleft()
                if r.cancelled:
                    self._finish(r, "cancelled")
                    continue
                r.slot = len(self._active)
                self.runner.set_length(r.slot, 0)
                for p in self.proposers:
                    p.reset(r.slot, r.prompt)
                self._active.append(r)
                admitted = True
        if admitted:  # their prompts' features are kept whole or windowed from the first chunk
            self._mark_idle()

    def _mark_idle(self) -> None:
        """Tell the neural proposer whether the gate is skipping it (it then keeps only a window of
        recent context); before the gate's first decision, whether that decision will be a probe of
        part of the batch, so that the first prompts of a large batch are windowed too. While it
        skips, only the next probes' candidates keep even the window: the ``PROBE_CANDIDATES *
        NEURAL_PROBE_ROWS`` requests that drafted least recently (the order probes pick rows in),
        and only from the window's length of steps before the next probe on (``steps_to_probe``):
        between probes no row keeps features, so no step builds or stores any."""
        if self.neural is None:
            return
        idle = self.gate is not None and self.gate.expects_skipping(len(self._active))
        self.neural.idle = idle
        self.neural.keep = None
        if idle and self.gate.steps_to_probe > self.neural.idle_context_tokens:
            self.neural.keep = frozenset()
        elif idle:
            live = [r for r in self._active if not r.finished]
            n = PROBE_CANDIDATES * NEURAL_PROBE_ROWS
            oldest = least_recent(range(len(live)), [r.last_drafted for r in live], n)
            self.neural.keep = frozenset(live[i].slot for i in oldest)

    def _prefill_chunks(self, reqs: list[_Request]) -> list[tuple[_Request, int]]:
        """(request, prompt tokens this step) in admission order, within ``prefill_tokens``;
        the oldest request always gets a chunk, so prefill never stalls."""
        budget = self.cfg.prefill_tokens or sum(len(r.prompt) for r in reqs)
        out = []
        for r in reqs:
            n = min(self.cfg.prefill_chunk, len(r.prompt) - r.prefilled, max(budget, 0 if out else 1))
            if n <= 0:
                break
            out.append((r, n))
            budget -= n
        return out

    @staticmethod
    def _chunk_tokens(chunks: list[tuple[_Request, int]]) -> list[list[int]]:
        return [r.prompt[r.prefilled:r.prefilled + n] for r, n in chunks]

    def _prefill_forward(self, chunks: list[tuple[_Request, int]]):
        """The target over this step's prompt chunks alone (no request is decoding, or fusing is off)."""
        return self.runner.forward([r.slot for r, _ in chunks], self._chunk_tokens(chunks),
                                   need_features=self.need_features, last_logits_only=True)

    def _prefill(self, chunks: list[tuple[_Request, int]], out) -> None:
        """Commit this step's prompt chunks (``out``: the target's output over them, last logits
        only): cache lengths, the proposers' context, and each finished prompt's first token."""
        reqs = [r for r, _ in chunks]
        toks = self._chunk_tokens(chunks)
        done = []
        for i, (r, t) in enumerate(zip(reqs, toks)):
            n = len(t)
            self.runner.set_length(r.slot, r.prefilled + n)
            r.prefilled += n
            if r.prefilled == len(r.prompt):
                done.append((i, r))
        self._commit_to_proposers([r.slot for r in reqs], [[]] * len(reqs), out, [len(t) for t in toks])
        if done:
            first = self._first_tokens([r for _, r in done], torch.stack([out.logits[i, 0] for i, _ in done]))
            self._commit_to_proposers([r.slot for _, r in done], [[tok] for tok in first])
            for (_, r), tok in zip(done, first):
                r.anchor = tok
                self._emit(r, [tok])
        self._settle(reqs)

    def _first_tokens(self, reqs: list[_Request], logits: torch.Tensor) -> list[int]:
        """Each request's first token from the prompt's last logits [n, V]: the verify path with
        zero drafts, by the coupled rule (the target's seeded choice at that position, an exact
        sample under either rule; the rejection rule's round randomness starts with round 0)."""
        n = len(reqs)
        batch = DraftBatch.empty(n, 0, source="none")
        lens = torch.zeros(n, dtype=torch.long)
        temps = torch.tensor([r.params.temperature for r in reqs])
        res = self._verify(reqs, batch, logits, lens, temps, coupled_only=True)
        return res.output_tokens[:, 0].tolist()

    def _commit_to_proposers(self, slots: list[int], tokens: list[list[int]], out: RaggedOutput | None = None,
                             counts: list[int] | None = None) -> None:
        """Tell every proposer, in one call, about the tokens committed to ``slots``. ``out``: the
        target's output over the ``counts[i]`` positions just run for row i (None: none ran), whose
        features go to the proposers that need them, built only for the rows each wants
        (``wants_features``; one device-to-host copy: a copy per request is a sync per request)."""
        for p in self.proposers:
            if not (p.needs_features and out is not None):
                p.commit_many(slots, tokens)
                continue
            wants = p.wants_features(slots)
            for want in (False, True):
                rows = [i for i, w in enumerate(wants) if w == want]
                if not rows:
                    continue
                n = [counts[i] for i in rows]
                feats = out.aux_rows(rows, max(n)).float().cpu() if want else None
                p.commit_many([slots[i] for i in rows], [tokens[i] for i in rows], feats, n)

    def _settle(self, reqs: list[_Request]) -> None:
        """End of a phase (its tokens were sent): the proposers' deferred work."""
        slots = [r.slot for r in reqs if not r.finished]
        self._mark_idle()
        for p in self.proposers:
            p.settle(slots)

    def _max_lens(self, reqs: list[_Request]) -> torch.Tensor:
        lengths = self.runner.lengths.tolist()  # one host copy: a tensor read per row costs microseconds
        caps = []
        for r in reqs:
            remaining = r.params.max_tokens - len(r.generated)
            room = self.max_context - int(lengths[r.slot]) - 2
            caps.append(max(0, min(self.K, remaining - 1, room)))
        return torch.tensor(caps, dtype=torch.long)

    def _neural_rows(self, reqs: list[_Request], suffix: DraftBatch | None, fused_tokens: int = 0,
                     budget: int | None = None) -> list[int]:
        """Rows of ``reqs`` that run the neural pass this step.

        A row whose suffix proposal already wins, i.e. expects at least as many accepted drafts
        (from its calibrated confidences) as the neural drafter's running estimate (its accepted
        drafts per row on past rounds: committed history), is left to the suffix proposal. Of the
        rest the gate decides how many draft (all, none, or on a probe the few that drafted least
        recently). A row whose neural context was dropped while the gate skipped it (outside the
        probe candidates, ``_mark_idle``) has nothing to draft from and waits until it has. Nothing
        here reads a neural draft."""
        if self.neural is None:
            return []
        if self.gate is not None and self.gate.skip_if_futile(len(reqs), fused_tokens, budget):
            return []  # no row's proposal or context matters
        rows = list(range(len(reqs)))
        if suffix is not None:
            bar = self._neural_estimate()
            expected = suffix.expected_accepts().tolist()
            # an empty suffix proposal leaves nothing to the suffix: such a row stays a candidate even
            # when the estimate is 0 (else one unlucky probe would switch the drafter off for good)
            rows = [i for i in rows if expected[i] < bar or expected[i] == 0.0]
        candidates, rows = rows, [i for i in rows if self.neural.has_context(reqs[i].slot)]
        if candidates and not rows and self.gate is not None:  # between probes no row keeps context
            self.gate.skip_step(len(candidates), len(reqs), fused_tokens, budget)
            return []
        return gated_rows(self.gate, rows, [r.last_drafted for r in reqs], batch_rows=len(reqs),
                          prompt_tokens=fused_tokens, budget=budget)

    def _neural_estimate(self) -> float:
        """The neural drafter's expected accepted drafts per drafted row: the gate's shrunk running
        average when it has one, else the mean over this engine's neural rounds so far (+inf
        before any, so that every row drafts until there is history)."""
        if self.gate is not None and self.gate.accepted is not None:
            return self.gate.accepted
        st = self.stats.by_proposer.get(self.neural.name)
        return st.accepted_per_round if st is not None and st.rounds else float("inf")

    def _propose(self, reqs: list[_Request], temps: torch.Tensor, fused_tokens: int = 0) -> DraftBatch:
        """Every row's proposal for this round (one row per request, width ``K`` at most);
        ``fused_tokens`` prompt tokens ride in the same target pass (the gates price them).

        Nothing is proposed in a step whose scheduler could verify no draft whatever the
        confidences (``VerifyLengthPolicy.draft_budget``: on a CPU beside many rows a draft can cost
        more than a token); in the others the gates weigh what at most that budget of drafts gains.

        The suffix proposer (deterministic) drafts every row first; the neural pass runs only for
        ``_neural_rows``. A row with both takes the suffix proposal where it expects more accepted
        drafts, unless the row is rejection-sampled: there the neural drafts were drawn at random
        and choosing by their confidences would let a draft decide its own verification, so the
        neural proposal stands (docs/runtime.md "Proposers and hybrid drafting")."""
        R = len(reqs)
        slots = [r.slot for r in reqs]
        suffix = None
        self._suffix_looked = []
        budget = self.policy.draft_budget(R, fused_tokens, limit=R * self.K)
        if budget == 0:
            if self.neural is not None:
                self.stats.skipped_draft_steps += 1
            return DraftBatch.empty(R, 0, source=self.proposers[0].name)
        if self.suffix is not None:
            looked = gated_rows(self.suffix_gate, list(range(R)), [r.last_suffix for r in reqs],
                                prompt_tokens=fused_tokens, budget=budget)
            if looked:
                with self._timed("suffix"):
                    drafts = self.suffix.propose([slots[i] for i in looked], temps[looked])
                suffix = _scatter(drafts, looked, R)
                for i in looked:
                    reqs[i].last_suffix = self.stats.decode_steps
            self._suffix_looked = looked
        rows = self._neural_rows(reqs, suffix, fused_tokens, budget)
        if self.neural is not None and not rows:
            self.stats.skipped_draft_steps += 1
        neural = None
        if rows:
            sub = [reqs[i] for i in rows]
            # without a rejection-sampled row among them the drafter returns no distributions
            # (``_draft_noise`` marks the noise coupled): only rejection sampling reads them
            with self._timed("neural"):
                proposal = self.neural.propose([r.slot for r in sub], temps[rows], _draft_noise(sub))
            neural = _scatter(proposal, rows, R)
            for r in sub:
                r.last_drafted = self.stats.decode_steps
        if suffix is None and neural is None:
            return DraftBatch.empty(R, 0, source=self.proposers[0].name)
        if suffix is None:
            return neural
        if neural is None:
            return suffix
        drafted = torch.zeros(R, dtype=torch.bool)
        drafted[rows] = True
        free = torch.tensor([not _by_rejection(r) for r in reqs], dtype=torch.bool)
        suffix_wins = suffix.expected_accepts() > neural.expected_accepts()
        use_neural = drafted & ~(free & suffix_wins)
        return DraftBatch.combine([suffix, neural], use_neural.long(), self.target.vocab_size)

    def _schedule(self, reqs: list[_Request], batch: DraftBatch, fused_tokens: int = 0) -> torch.Tensor:
        """Verify lengths [R]: the policy over the whole batch (its token count, with the
        ``fused_tokens`` prompt tokens fused into the same pass, sets the step's cost), each row
        capped by its drafts and by its request's room."""
        R = len(reqs)
        if batch.width == 0:
            return torch.zeros(R, dtype=torch.long)
        cap = torch.minimum(self._max_lens(reqs), batch.lens.cpu())
        return self.policy(batch.confidence.cpu().float(), cap, [r.rid for r in reqs],
                           prompt_tokens=fused_tokens).cpu()

    def _verify_round(self, reqs: list[_Request], batch: DraftBatch, lens: torch.Tensor, temps: torch.Tensor,
                      chunks: list[tuple[_Request, int]] = ()):
        """The target over ``[anchor, d_1..d_l]`` for every row, then the verify rule
        -> (result, the target's forward output, the output over ``chunks``). Prompt chunks
        given here run in the same pass (``_fused``)."""
        drafts = batch.tokens.cpu()
        toks = [[r.anchor] + drafts[i, : int(lens[i])].tolist() for i, r in enumerate(reqs)]
        slots = [r.slot for r in reqs]
        if chunks:
            out, prefill_out = self.runner.forward_mixed(slots + [r.slot for r, _ in chunks],
                                                         toks + self._chunk_tokens(chunks), len(reqs),
                                                         need_features=self.need_features)
        else:
            out, prefill_out = self.runner.forward(slots, toks, need_features=self.need_features), None
        return self._verify(reqs, batch, out.token_logits, lens, temps), out, prefill_out

    def _commit(self, reqs: list[_Request], batch: DraftBatch, lens: torch.Tensor, res, out: RaggedOutput) -> None:
        """Accepted tokens into the target's cache, the proposers and the stats; then emit."""
        # host lists up front: indexing a tensor per row costs microseconds, times 64 rows per step
        n_acc = res.num_accepted.cpu().tolist()
        lens_l = lens.tolist()
        # a step without proposals (every gate skipped) has nothing to tell the policy or the gates
        # but the suffix lookups it paid for
        has = [n > 0 for n in batch.lens.cpu().tolist()] if batch.width > 0 else [False] * len(reqs)
        if batch.width > 0:  # the policy chose this step's lengths (_schedule): tell it what they won
            self.policy.observe([r.rid for r in reqs], n_acc)
            if self.gate is not None and self.neural is not None:
                mine = [i for i in range(len(reqs)) if has[i] and batch.source_of(i) == self.neural.name]
                if mine:
                    self.gate.observe(len(mine), sum(lens_l[i] for i in mine), sum(n_acc[i] for i in mine))
        if self.suffix_gate is not None and self._suffix_looked:  # every row looked up paid for it
            mine = [i for i in self._suffix_looked if has[i] and batch.source_of(i) == self.suffix.name]
            self.suffix_gate.observe(len(self._suffix_looked), sum(lens_l[i] for i in mine), sum(n_acc[i] for i in mine))
        emitted = res.output_tokens.cpu().tolist()
        conf_logits = batch.conf_logits.cpu().tolist() if batch.conf_logits is not None else None
        conf = conf_logits if self.cfg.record_rounds else None
        self.stats.decode_steps += 1
        slots = [r.slot for r in reqs]
        news = [emitted[i][: n_acc[i] + 1] for i in range(len(reqs))]
        committed = [n + 1 for n in n_acc]  # each row's accepted drafts and its recovered / bonus token
        self.runner.advance_lengths(slots, committed)
        self._commit_to_proposers(slots, news, out, committed)
        for i, r in enumerate(reqs):
            n, l_ = n_acc[i], lens_l[i]
            new = news[i]
            r.steps += 1
            r.drafted += l_
            r.accepted += n
            source = batch.source_of(i) if has[i] else "none"
            self.stats.record_round(source, l_, n)
            if l_ > 0 and conf_logits is not None and source in self._by_name:
                self._by_name[source].observe(r.slot, conf_logits[i][:l_], l_, n)
            if self.cfg.record_rounds:
                self.rounds.append(RoundRecord(r.rid, l_, n, conf[i] if conf is not None and has[i] else None))
            r.anchor = new[-1]
            self._emit(r, new)
        self._settle(reqs)

    def _verify(self, reqs: list[_Request], batch: DraftBatch, token_logits: torch.Tensor, lens: torch.Tensor,
                temps: torch.Tensor, coupled_only: bool = False) -> verify_ref.VerifyResult:
        """Verify every row by its request's rule, on the target's logits of the verified tokens
        packed row after row (``token_logits [sum(lens + 1), V]``, as the ragged pass computed
        them): coupled rows (and greedy ones, the same under both rules) in one call on the
        packed logits, rejection-sampled rows in another on their padded grid; results merged in
        row order. ``coupled_only``: every row by the coupled rule (the first token)."""
        R = len(reqs)
        L = int(lens.max()) if R else 0
        drafts = batch.tokens[:, :L].cpu()
        dev = token_logits.device
        top_k = torch.tensor([r.params.top_k for r in reqs])
        top_p = torch.tensor([r.params.top_p for r in reqs])
        seed = torch.tensor([r.seed for r in reqs])
        by_rejection = torch.tensor([not coupled_only and _by_rejection(r) for r in reqs], dtype=torch.bool)
        n_rej = int(by_rejection.sum())
        position = torch.tensor([_next_position(r) for r in reqs])
        offset = torch.tensor([r.steps for r in reqs])
        cells = torch.repeat_interleave(torch.arange(R), lens + 1)  # the row of each packed logits row

        def rows_of(t: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
            return t if sel is None else t[sel.to(t.device)]

        def logits_of(sel: torch.Tensor | None) -> torch.Tensor:
            return token_logits if sel is None else token_logits[sel[cells].to(dev)]

        def run_coupled(sel: torch.Tensor | None):
            logits = logits_of(sel)
            return coupled.verify_coupled_packed(
                rows_of(drafts, sel).to(dev), logits.float(), rows_of(lens, sel).to(dev),
                rows_of(temps, sel).to(dev), top_k=rows_of(top_k, sel), top_p=rows_of(top_p, sel),
                seed=rows_of(seed, sel), position=rows_of(position, sel))

        def run_rejection(sel: torch.Tensor | None):
            sub_lens = rows_of(lens, sel)
            logits = logits_of(sel)
            cu = torch.zeros(len(sub_lens) + 1, dtype=torch.long)
            cu[1:] = torch.cumsum(sub_lens + 1, 0)
            grid = verify_ref.unpack_ragged(logits.float(), cu.to(dev), L + 1)  # [n, L+1, V]
            # a point-mass proposal is a one-hot draft distribution (engine/proposers/base.py)
            draft_probs = batch.verify_probs(token_logits.shape[-1], L).to(dev)
            return self.verify(
                rows_of(drafts, sel).to(dev), rows_of(draft_probs, sel), grid, sub_lens.to(dev),
                rows_of(temps, sel).to(dev), top_k=rows_of(top_k, sel).to(dev), top_p=rows_of(top_p, sel).to(dev),
                seed=rows_of(seed, sel), offset=rows_of(offset, sel))
        if n_rej == 0:
            return run_coupled(None)
        if n_rej == R:
            return run_rejection(None)
        a, b = run_coupled(~by_rejection), run_rejection(by_rejection)
        n = torch.empty(R, dtype=torch.long, device=dev)
        out = torch.empty(R, L + 1, dtype=torch.long, device=dev)
        for part, sel in ((a, ~by_rejection), (b, by_rejection)):
            n[sel.to(dev)] = part.num_accepted
            out[sel.to(dev)] = part.output_tokens
        return verify_ref.VerifyResult(num_accepted=n, output_tokens=out, num_emitted=n + 1)

    # -- output ---------------------------------------------------------------------------------------
    def _emit(self, r: _Request, tokens: list[int]) -> None:
        keep: list[int] = []
        reason = None
        stops = set(r.params.stop_token_ids)
        for t in tokens:
            keep.append(t)
            if t in stops:
                reason = "stop"
                break
            if len(r.generated) + len(keep) >= r.params.max_tokens:
                reason = "length"
                break
        if r.params.stop_strings and reason is None:
            keep, hit = self._cut_at_stop_string(r, keep)
            reason = "stop" if hit else None
        r.generated.extend(keep)
        self.stats.emitted_tokens += len(keep)
        if reason is not None:
            self._finish(r, reason, keep)
        else:
            self._send(r, keep, finished=False)

    def _cut_at_stop_string(self, r: _Request, keep: list[int]) -> tuple[list[int], bool]:
        tok = self.target.tokenizer
        tail = r.generated[-32:]
        for j in range(1, len(keep) + 1):
            text = tok.decode(tail + keep[:j])
            if any(s in text for s in r.params.stop_strings):
                return keep[:j], True
        return keep, False

    def _send(self, r: _Request, tokens: list[int], finished: bool, reason: str | None = None, error: str | None = None) -> None:
        try:
            r.callback(RequestOutput(request_id=r.rid, new_token_ids=tokens, finished=finished, finish_reason=reason,
                                     error=error, num_steps=r.steps, num_draft_tokens=r.drafted,
                                     num_accepted_tokens=r.accepted))
        except Exception:  # a broken client callback must not take the engine down
            log.exception("output callback of request %s failed; cancelling it", r.rid)
            r.cancelled = True

    def _finish(self, r: _Request, reason: str, tokens: list[int] | None = None, error: str | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        self._send(r, tokens or [], finished=True, reason=reason, error=error)

    def _reap(self) -> None:
        """Drop finished/cancelled requests and compact slots so rows 0..R-1 stay active."""
        with self._lock:
            for r in self._active:
                if r.cancelled and not r.finished:
                    self._finish(r, "cancelled")
            keep = [r for r in self._active if not r.finished]
            if len(keep) == len(self._active):
                return
            for r in self._active:
                if r.finished:
                    for p in self.proposers:
                        p.release(r.slot)
            # fill each freed slot below len(keep) with a request from above it: one cache copy
            # per departure, where shifting everyone down would copy every later request's cache
            n = len(keep)
            holes = sorted(set(range(n)) - {r.slot for r in keep})
            movers = sorted((r for r in keep if r.slot >= n), key=lambda r: r.slot)
            for hole, r in zip(holes, movers):
                self.runner.move_slot(r.slot, hole)
                for p in self.proposers:
                    p.move(r.slot, hole)
                r.slot = hole
            self._active = sorted(keep, key=lambda r: r.slot)


def load_engine(engine_dir: str | None = None, mode: str = "spec", scheduler: str = "algorithm1",
                device: str = "cpu", max_batch: int = 64, max_context: int = 2048,
                prefill_chunk: int = EngineConfig.prefill_chunk, prefill_tokens: int = EngineConfig.prefill_tokens,
                sampling_rule: str = EngineConfig.sampling_rule, proposers: str | None = None,
                suffix: dict | None = None, dtype: str = "float32"):
    """Build an engine from an engine directory (``dspark build`` output) or the embedded target.

    ``engine_dir`` holds ``engine.json`` naming the target profile, the drafter checkpoint
    directory, optionally ``sps.json`` / ``sts.json``, and the default ``proposers`` (with
    ``suffix`` settings, ``SuffixConfig`` fields); the ``proposers`` / ``suffix`` arguments
    override them. Without an engine directory only proposers that need no drafter
    (``suffix``) or ``mode="target_only"`` are possible.

    ``dtype``: the target's weights and KV cache, ``float32`` (the reference for lossless) or
    ``bfloat16`` (``TARGET_DTYPES``; on a CPU with AVX512-BF16 / AMX its matrix products run
    in bf16 with fp32 accumulation). The drafter stays float32; verification compares drafts
    with the bf16 target's own distribution, so a bf16 engine is lossless against bf16
    target-only decoding, not against the float32 target.
    """
    if dtype not in TARGET_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TARGET_DTYPES)}, got {dtype!r}")

    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.config import TargetProfile, load_target_profile
    from dspark.training.target import load_target

    drafter, sps, sts, meta = None, None, None, {}
    if engine_dir is None:
        if mode == "spec" and "neural" in parse_proposers(proposers or "neural"):
            raise ValueError("speculative mode needs an engine directory with a drafter (scripts/build_engine.sh)")
        profile = load_target_profile("smollm2-135m")
    else:
        root = Path(engine_dir)
        meta_path = root / "engine.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{root}: no engine.json (build it with scripts/build_engine.sh)")
        from .export.manifest import read_engine_json
        meta = read_engine_json(root)  # a clear one-line error for a file that is not JSON
        profile = TargetProfile(**meta["target_profile"])
    target = load_target(profile, device=device, dtype=getattr(torch, dtype))
    if engine_dir is not None and meta.get("format") == "dspark-engine":  # built by `dspark build`
        from .export.manifest import validate_engine_dir
        validate_engine_dir(engine_dir, target, files="runtime")
    names = proposers or meta.get("proposers", "neural")
    suffix_cfg = SuffixConfig(**{"max_drafts": 3, **meta.get("suffix", {}), **(suffix or {})})
    if engine_dir is not None:
        root = Path(engine_dir)
        if mode == "spec" and "neural" in parse_proposers(names):
            drafter, _, _ = load_checkpoint(root / meta.get("drafter_dir", "drafter"), target)
            drafter = drafter.to(device)
        if meta.get("sps"):
            from .sps import load_sps_table
            sps = load_sps_table(root / meta["sps"])
        if meta.get("sts"):
            from .sts import StsCalibration
            sts = StsCalibration.load(root / meta["sts"]).temperatures
    if scheduler in SPS_SCHEDULERS and sps is None:
        log.warning("no SPS table in %s: falling back to fixed-length verification", engine_dir)
        scheduler = "fixed"
    cfg = EngineConfig(mode=mode, scheduler=scheduler, max_batch=max_batch, max_context=max_context,
                       prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, sampling_rule=sampling_rule,
                       proposers=names, suffix=suffix_cfg)
    return SpecEngine(target, drafter, cfg, sps=sps, sts_temperatures=sts)


SAMPLING_RULES = ("coupled", "rejection", "auto")
TARGET_DTYPES = ("float32", "bfloat16")  # load_engine(dtype=...)


# The neural gate's probes (engine/draft_gate.py): 2 rows, so that from 3 rows up the engine keeps a skipped drafter's
# context to a window from the first step on (a first probe at 4 rows does not ingest four whole prompts), and an
# interval that quadruples while probes lose: a batch of requests decodes a few hundred steps, in which doubling
# from 4 probes a drafter that never pays six times (by step 252) and quadrupling three (by step 84).
NEURAL_PROBE_ROWS = 2
NEURAL_PROBE_GROWTH = 4.0
# While the neural gate skips, the requests of this many coming probes keep a context window; the others' features
# are not stored at all: per-row host work each step for context that no coming probe would read
PROBE_CANDIDATES = 2
# The share of a run the neural gate may spend probing a drafter that does not pay, beside the suffix proposer
# (alone: DraftGate's default). The suffix proposer drafts the predictable stretches a probe looks for, so a fifth
# of the default: a 2-row probe is cheap against a 64-row step, and the default would let probes come every few
# dozen steps there.
HYBRID_PROBE_BUDGET = 0.001
# The share of a run the suffix gate may spend probing lookups that do not pay. A probe's price is its lookups and
# the verify tokens it adds; a drafted step also costs the host its scheduling and bookkeeping, which the SPS table
# does not price (about 2 ms beside 64 rows on a 2-core CPU, as much as a draft): at the default budget, probes came
# every 4-5 steps at batch 64 and cost that batch about 0.5%.
SUFFIX_PROBE_BUDGET = 0.001


def _is_coupled(rule: str, seeded: bool) -> bool:
    """Whether a request is verified by the coupled rule under ``EngineConfig.sampling_rule``."""
    return rule == "coupled" or (rule == "auto" and seeded)


def _by_rejection(r: _Request) -> bool:
    """Whether a request's drafts are verified by rejection sampling (else the coupled rule, or greedy)."""
    return not r.coupled and r.params.temperature > 0


def _next_position(r: _Request) -> int:
    """The sequence position of the request's next token (its first draft, or its first token)."""
    return len(r.prompt) + len(r.generated)


def _draft_noise(reqs: list[_Request]) -> coupled.RaceNoise:
    """The drafter's noise: coupled requests draft with the noise their target choices use
    (seed, position); rejection-sampled ones with fresh noise per round, since that rule needs
    drafts independent of everything already decided. Without a rejection-sampled row no draft
    distribution is read, so the noise is marked ``coupled`` (the drafter then skips them)."""
    keys = [r.seed if r.coupled else coupled.round_key(r.seed, r.steps) for r in reqs]
    return coupled.RaceNoise(torch.tensor(keys, dtype=torch.long),
                             torch.tensor([_next_position(r) for r in reqs], dtype=torch.long),
                             coupled=not any(_by_rejection(r) for r in reqs))


def parse_proposers(spec: str) -> list[str]:
    """``"neural+suffix"`` -> ``["suffix", "neural"]``: known, distinct names, the suffix proposer first
    (it drafts every row before the neural pass is decided); ``none`` alone or not at all."""
    names = [n.strip() for n in spec.split("+") if n.strip()]
    unknown = [n for n in names if n not in PROPOSERS]
    if not names or unknown:
        raise ValueError(f"proposers must be '+'-joined names from {', '.join(PROPOSERS)}, got {spec!r}")
    if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        raise ValueError(f"proposers: each name once, and none only alone, got {spec!r}")
    return sorted(names, key=lambda n: n != "suffix")


def _scatter(batch: DraftBatch, rows: list[int], R: int) -> DraftBatch:
    """``batch`` (one row per entry of ``rows``) as an ``R``-row batch; other rows have no drafts."""
    if len(rows) == R:
        return batch
    idx = torch.tensor(rows)
    K = batch.width
    tokens = torch.zeros(R, K, dtype=torch.long)
    tokens[idx] = batch.tokens.cpu()
    lens = torch.zeros(R, dtype=torch.long)
    lens[idx] = batch.lens.cpu()
    conf = torch.zeros(R, K)
    conf[idx] = batch.confidence.cpu().float()
    logits = None
    if batch.conf_logits is not None:
        logits = torch.zeros(R, K)
        logits[idx] = batch.conf_logits.cpu().float()
    probs = None
    if batch.probs is not None:
        probs = batch.probs.new_zeros((R,) + tuple(batch.probs.shape[1:]))
        probs[idx.to(probs.device)] = batch.probs
    return DraftBatch(tokens=tokens, lens=lens, confidence=conf, probs=probs, conf_logits=logits, source=batch.source)
