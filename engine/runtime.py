"""The speculative decoding engine: in-flight batching over a target and a drafter.

One ``step()``:
1. admit queued requests into free slots (requests join between steps);
2. prefill: requests still reading their prompt run one chunk each (at most
   ``prefill_chunk`` tokens, and ``prefill_tokens`` over all of them, oldest first), so a
   long prompt or a burst of arrivals never stalls the running batch for more than one
   chunk; a request whose prompt is done samples its first token from the target;
3. decode: unless the drafting gate (``draft_gate.py``) predicts that a plain step is
   faster on this hardware, the drafter proposes a block for every decoding request, the verify-length
   policy picks how many drafts each request verifies (``l_r``), the target runs the
   ragged batch ``[anchor, d_1..d_l]`` once, and the verify rule accepts a prefix and
   emits a recovered or bonus token (lossless for greedy and sampled requests);
4. accepted tokens are committed (rejected K/V are trimmed by length), streamed to each
   request's callback, and finished requests leave (their slots are compacted).

``mode="target_only"`` is the same engine with every verify length 0: plain decoding,
the baseline for every speculative comparison.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.plugins import coupled
from dspark.plugins import reference as verify_ref

from .api import OutputCallback, RequestOutput, RequestValidationError, SamplingParams
from .draft_gate import DraftGate
from .draft_runner import make_draft_runner
from .scheduler import make_scheduler
from .sps import SpsTable
from .static_target import with_static_steps
from .target_runner import TargetRunner
from . import threads

log = logging.getLogger(__name__)


def _verify_fn():
    """The plugins op when present (CUDA kernels), else the reference."""
    try:
        from dspark.plugins import ops
        return ops.verify
    except ImportError:
        return verify_ref.verify


@dataclass
class EngineConfig:
    mode: str = "spec"  # spec | target_only
    scheduler: str = "fixed"  # fixed | threshold | algorithm1 | async
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
    threads: int = 0  # intra-op threads (0: torch's default, one per usable core): engine/threads.py
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
    pending_aux: torch.Tensor | None = None  # features of committed positions awaiting their next token
    # (features, next tokens) of committed positions not yet in the drafter's cache: it reads
    # them only when it drafts, so steps the gate skips (and prefill) leave them here
    ctx_backlog: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    backlog_tokens: int = 0
    steps: int = 0
    last_drafted: int = -1  # engine round of this request's latest draft (gate probes pick the oldest)
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
    """Batched speculative decoding (implements ``engine.api.GenerationEngine``)."""

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
        if self.cfg.mode == "spec" and drafter is None:
            raise ValueError("speculative mode needs a drafter checkpoint (build one with scripts/build_engine.sh)")
        self.target = target
        self.max_context = self.cfg.max_context
        self.threads = threads.configure(self.cfg.threads)
        self.runner = TargetRunner(target, self.cfg.max_batch, max_context=self.cfg.max_context,
                                   attention=self.cfg.attention)
        log.info("engine: %s, attention %s", threads.describe(), "varlen" if self.runner.varlen else "sdpa")
        self.drafter = drafter if self.cfg.mode == "spec" else None
        self.draft_runner = make_draft_runner(drafter, self.cfg.max_batch) if self.drafter is not None else None
        self.K = drafter.cfg.block_size if self.drafter is not None else 0
        self._use_static_steps()
        has_conf = self.drafter is not None and getattr(self.drafter, "confidence", None) is not None
        sched = self.cfg.scheduler if has_conf else "fixed"
        if sched in ("algorithm1", "async") and sps is None:
            raise ValueError(f"scheduler {sched!r} needs an SPS table (dspark profile)")
        kwargs = {"sps": sps} if sched in ("algorithm1", "async") else {}
        if sched == "threshold":
            kwargs = {"threshold": self.cfg.threshold}
        self.policy = make_scheduler(sched, **kwargs)
        self.gate = self._make_gate(sps, sched)
        self.sts = None if sts_temperatures is None else torch.as_tensor(sts_temperatures, dtype=torch.float32)
        self.verify = _verify_fn()
        self.device = self.runner.device
        self._seeds = random.Random(self.cfg.seed)  # seeds for requests without one
        self._queue: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self.rounds: list[RoundRecord] = []
        self.stats = {"steps": 0, "rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "emitted_tokens": 0,
                      "accepted_per_position": [0] * max(self.K, 1), "verify_len_hist": [0] * (self.K + 1),
                      "batch_size_sum": 0, "skipped_draft_steps": 0}

    def _use_static_steps(self) -> None:
        """Decode steps at fixed shapes (``static_target.py``): CUDA graphs on a GPU."""
        self.runner = with_static_steps(self.runner, self.cfg.static_steps, self.cfg.max_batch, self.K,
                                        self.cfg.prefill_chunk)

    def _make_gate(self, sps, sched: str) -> DraftGate | None:
        """The cost-aware drafting gate, with the hardware-aware schedulers and a drafter-cost table."""
        if not (self.cfg.adaptive_drafting and self.drafter is not None and sched in ("algorithm1", "async")):
            return None
        if not (isinstance(sps, SpsTable) and sps.has_draft_cost):
            log.info("adaptive drafting off: the SPS table has no drafter cost (dspark profile --checkpoint)")
            return None
        return DraftGate(sps, max_tokens=self.cfg.max_batch * (self.K + 1))

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
        self._reap()
        self._admit()
        prefilling = [r for r in self._active if r.anchor is None and not r.finished]
        if prefilling:
            self._prefill(prefilling)
        decoding = [r for r in self._active if r.anchor is not None and not r.finished]
        if decoding:
            self._decode(decoding)
        self.stats["steps"] += 1
        self._reap()

    # -- phases ---------------------------------------------------------------------------------------
    def _admit(self) -> None:
        with self._lock:
            while self._queue and len(self._active) < self.cfg.max_batch:
                r = self._queue.popleft()
                if r.cancelled:
                    self._finish(r, "cancelled")
                    continue
                r.slot = len(self._active)
                self.runner.set_length(r.slot, 0)
                if self.draft_runner is not None:
                    self.draft_runner.reset(r.slot)
                self._active.append(r)

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

    def _prefill(self, reqs: list[_Request]) -> None:
        chunks = self._prefill_chunks(reqs)
        reqs = [r for r, _ in chunks]
        toks = [r.prompt[r.prefilled:r.prefilled + n] for r, n in chunks]
        out = self.runner.forward([r.slot for r in reqs], toks, need_features=self.drafter is not None,
                                  last_logits_only=True)
        done = []
        # one device-to-host copy for the whole batch: a copy per request is a sync per request
        aux_host = out.aux.float().cpu() if self.drafter is not None else None
        for i, (r, t) in enumerate(zip(reqs, toks)):
            n = len(t)
            self.runner.set_length(r.slot, r.prefilled + n)
            r.prefilled += n
            if aux_host is not None:
                aux = aux_host[i, :n].clone()  # own its memory: the backlog outlives this batch
                if r.pending_aux is not None:
                    aux = torch.cat([r.pending_aux, aux])
                # every position but the last knows its next token already
                nxt = torch.tensor(r.prompt[r.prefilled - aux.shape[0] + 1:r.prefilled])
                self._to_backlog(r, aux[:-1], nxt)
                r.pending_aux = aux[-1:]
            if r.prefilled == len(r.prompt):
                done.append((i, r, n))
        if done:
            logits = torch.stack([out.logits[i, 0] for i, _, _ in done])
            first = self._sample_first([r for _, r, _ in done], logits)
            for (i, r, n), tok in zip(done, first):
                r.anchor = tok
                if self.drafter is not None:
                    self._to_backlog(r, r.pending_aux, torch.tensor([tok]))
                    r.pending_aux = None
                self._emit(r, [tok])
        self._flush_over_bound(reqs)

    MAX_BACKLOG_TOKENS = 256  # bounds the memory of features held for a drafter that is not drafting

    def _to_backlog(self, r: _Request, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Queue committed features for the drafter's context (``_flush_over_bound`` bounds them)."""
        r.ctx_backlog.append((aux, next_tokens))
        r.backlog_tokens += aux.shape[0]

    def _flush_over_bound(self, reqs: list[_Request]) -> None:
        """Append the backlogs past ``MAX_BACKLOG_TOKENS`` in one batch, at the end of a phase:
        after its tokens were sent, so no token waits for the drafter's context pass."""
        if self.drafter is not None:
            over = [r for r in reqs if not r.finished and r.backlog_tokens >= self.MAX_BACKLOG_TOKENS]
            self._flush_draft_context(over)

    def _flush_draft_context(self, reqs: list[_Request]) -> None:
        """Bring the drafter's cache up to date for ``reqs`` (one batched append of their backlogs)."""
        rows = []
        for r in reqs:
            if r.ctx_backlog:
                aux = torch.cat([a for a, _ in r.ctx_backlog])
                nxt = torch.cat([t for _, t in r.ctx_backlog])
                rows.append((r.slot, aux, nxt))
                r.ctx_backlog.clear()
                r.backlog_tokens = 0
        if rows:
            self.draft_runner.append(rows)

    def _sample_first(self, reqs: list[_Request], logits: torch.Tensor) -> list[int]:
        """Each request's first token from the prompt's last logits [n, V]: its target choice
        at that position (``plugins/coupled.py``), under either rule an exact sample."""
        res = coupled.verify_coupled(
            torch.zeros(len(reqs), 0, dtype=torch.long, device=logits.device), logits.float().unsqueeze(1),
            torch.zeros(len(reqs), dtype=torch.long, device=logits.device),
            torch.tensor([r.params.temperature for r in reqs], device=logits.device),
            top_k=torch.tensor([r.params.top_k for r in reqs]), top_p=torch.tensor([r.params.top_p for r in reqs]),
            seed=torch.tensor([r.seed for r in reqs]), position=torch.tensor([_next_position(r) for r in reqs]))
        return res.output_tokens[:, 0].tolist()

    def _max_lens(self, reqs: list[_Request]) -> torch.Tensor:
        caps = []
        for r in reqs:
            remaining = r.params.max_tokens - len(r.generated)
            room = self.max_context - int(self.runner.lengths[r.slot]) - 2
            caps.append(max(0, min(self.K, remaining - 1, room)))
        return torch.tensor(caps, dtype=torch.long)

    def _rows_to_draft(self, reqs: list[_Request]) -> list[int]:
        """Indices of ``reqs`` that draft this step: all, none (the gate skips), or on a gate probe
        the few that drafted least recently."""
        if self.draft_runner is None or self.K == 0:
            return []
        R = len(reqs)
        n = R if self.gate is None else self.gate.rows_to_draft(R)
        if n == R:
            return list(range(R))
        return sorted(sorted(range(R), key=lambda i: reqs[i].last_drafted)[:n])

    def _draft(self, reqs: list[_Request], rows: list[int], anchors: torch.Tensor, temps: torch.Tensor):
        """Drafts for ``reqs[rows]`` and every request's verify length (0 outside ``rows``)
        -> (lens [R], drafts [R, K], the proposal, per-row raw confidence logits or None)."""
        R = len(reqs)
        sub = [reqs[i] for i in rows]
        idx = torch.tensor(rows)
        self._flush_draft_context(sub)
        prop = self.draft_runner.propose([r.slot for r in sub], anchors[idx], temps[idx].to(self.device),
                                         _draft_noise(sub))
        conf_rows: list[list[float] | None] = [None] * R
        confidence = torch.zeros(R, self.K)  # rows that do not draft verify nothing (cap 0 below)
        if prop.conf_logits is not None:
            cl = prop.conf_logits.float().cpu()
            if self.cfg.record_rounds:
                for i, c in zip(rows, cl):
                    conf_rows[i] = c.tolist()
            if self.sts is not None:
                cl = cl / self.sts[: cl.shape[1]].clamp(min=1e-4)
            confidence[idx] = torch.sigmoid(cl)
        else:
            confidence[idx] = 1.0
        cap = torch.zeros(R, dtype=torch.long)
        cap[idx] = self._max_lens(sub)
        # the policy sees the whole batch: its token count sets the step's cost
        lens = self.policy(confidence, cap, [r.rid for r in reqs]).cpu()
        drafts = torch.zeros(R, self.K, dtype=torch.long)
        drafts[idx] = prop.tokens.cpu()
        for r in sub:
            r.last_drafted = self.stats["rounds"]
        return lens, drafts, prop, conf_rows

    def _decode(self, reqs: list[_Request]) -> None:
        R = len(reqs)
        slots = [r.slot for r in reqs]
        anchors = torch.tensor([r.anchor for r in reqs], device=self.device)
        temps = torch.tensor([r.params.temperature for r in reqs])
        rows = self._rows_to_draft(reqs)
        drafting = bool(rows)
        if drafting:
            lens, drafts, prop, conf_rows = self._draft(reqs, rows, anchors, temps)
        else:
            lens, drafts, conf_rows = torch.zeros(R, dtype=torch.long), torch.zeros(R, 0, dtype=torch.long), [None] * R
            if self.draft_runner is not None:
                self.stats["skipped_draft_steps"] += 1
        L = int(lens.max()) if R else 0
        toks = [[r.anchor] + drafts[i, : int(lens[i])].tolist() for i, r in enumerate(reqs)]
        out = self.runner.forward(slots, toks, need_features=self.drafter is not None)
        target_logits = out.logits[:, : L + 1].float()
        if target_logits.shape[1] < L + 1:
            target_logits = torch.nn.functional.pad(target_logits, (0, 0, 0, L + 1 - target_logits.shape[1]))
        res = self._verify(reqs, drafts[:, :L], prop if drafting else None, rows, target_logits, lens, temps)
        n_acc = res.num_accepted.cpu().tolist()
        if drafting and self.gate is not None:
            self.gate.observe(len(rows), int(lens.sum()), sum(n_acc))
        emitted = res.output_tokens.cpu()
        aux_host = out.aux[:, : L + 1].float().cpu() if self.drafter is not None else None  # one copy, one sync
        self.stats["rounds"] += 1
        self.stats["batch_size_sum"] += R
        for i, r in enumerate(reqs):
            n, l_ = n_acc[i], int(lens[i])
            new = emitted[i, : n + 1].tolist()
            base = int(self.runner.lengths[r.slot])
            self.runner.set_length(r.slot, base + n + 1)
            r.steps += 1
            r.drafted += l_
            r.accepted += n
            self.stats["draft_tokens"] += l_
            self.stats["accepted_tokens"] += n
            self.stats["verify_len_hist"][l_] += 1
            for k in range(n):
                self.stats["accepted_per_position"][k] += 1
            if self.cfg.record_rounds:
                self.rounds.append(RoundRecord(r.rid, l_, n, conf_rows[i]))
            if aux_host is not None:
                self._to_backlog(r, aux_host[i, : n + 1].clone(), torch.tensor(new))
            r.anchor = new[-1]
            self._emit(r, new)
        self._flush_over_bound(reqs)

    def _verify(self, reqs: list[_Request], drafts: torch.Tensor, prop, rows: list[int], target_logits: torch.Tensor,
                lens: torch.Tensor, temps: torch.Tensor) -> verify_ref.VerifyResult:
        """Verify every row by its request's rule: coupled rows (and greedy ones, the same under
        both rules) in one call, rejection-sampled rows in another; results merged in row order."""
        R, L = drafts.shape
        dev = target_logits.device
        top_k = torch.tensor([r.params.top_k for r in reqs])
        top_p = torch.tensor([r.params.top_p for r in reqs])
        seed = torch.tensor([r.seed for r in reqs])
        by_rejection = torch.tensor([not r.coupled and r.params.temperature > 0 for r in reqs], dtype=torch.bool)
        n_rej = int(by_rejection.sum())
        position = torch.tensor([_next_position(r) for r in reqs])
        offset = torch.tensor([r.steps for r in reqs])

        def rows_of(t: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
            return t if sel is None else t[sel.to(t.device)]

        def run_coupled(sel: torch.Tensor | None):
            return coupled.verify_coupled(
                rows_of(drafts, sel).to(dev), rows_of(target_logits, sel), rows_of(lens, sel).to(dev),
                rows_of(temps, sel).to(dev), top_k=rows_of(top_k, sel), top_p=rows_of(top_p, sel),
                seed=rows_of(seed, sel), position=rows_of(position, sel))

        def run_rejection(sel: torch.Tensor | None):
            draft_probs = _verify_probs(prop, rows, R, L, temps, target_logits)
            return self.verify(
                rows_of(drafts, sel).to(dev), None if draft_probs is None else rows_of(draft_probs, sel),
                rows_of(target_logits, sel), rows_of(lens, sel).to(dev), rows_of(temps, sel).to(dev),
                top_k=rows_of(top_k, sel).to(dev), top_p=rows_of(top_p, sel).to(dev), seed=rows_of(seed, sel),
                offset=rows_of(offset, sel))
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
        self.stats["emitted_tokens"] += len(keep)
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
            # fill each freed slot below len(keep) with a request from above it: one cache copy
            # per departure, where shifting everyone down would copy every later request's cache
            n = len(keep)
            holes = sorted(set(range(n)) - {r.slot for r in keep})
            movers = sorted((r for r in keep if r.slot >= n), key=lambda r: r.slot)
            for hole, r in zip(holes, movers):
                self.runner.move_slot(r.slot, hole)
                if self.draft_runner is not None:
                    self.draft_runner.move(r.slot, hole)
                r.slot = hole
            self._active = sorted(keep, key=lambda r: r.slot)


def load_engine(engine_dir: str | None = None, mode: str = "spec", scheduler: str = "algorithm1",
                device: str = "cpu", max_batch: int = 64, max_context: int = 2048,
                prefill_chunk: int = EngineConfig.prefill_chunk, prefill_tokens: int = EngineConfig.prefill_tokens,
                sampling_rule: str = EngineConfig.sampling_rule):
    """Build an engine from an engine directory (``dspark build`` output) or the embedded target.

    ``engine_dir`` holds ``engine.json`` naming the target profile, the drafter checkpoint
    directory and optionally ``sps.json`` / ``sts.json``. With ``engine_dir=None`` only
    ``mode="target_only"`` is possible (there is no drafter to load).
    """

    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.config import TargetProfile, load_target_profile
    from dspark.training.target import load_target

    drafter, sps, sts = None, None, None
    if engine_dir is None:
        if mode == "spec":
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
    target = load_target(profile, device=device)
    if engine_dir is not None and meta.get("format") == "dspark-engine":  # built by `dspark build`
        from .export.manifest import validate_engine_dir
        validate_engine_dir(engine_dir, target, files="runtime")
    if engine_dir is not None:
        root = Path(engine_dir)
        if mode == "spec":
            drafter, _, _ = load_checkpoint(root / meta.get("drafter_dir", "drafter"), target)
            drafter = drafter.to(device)
        if meta.get("sps"):
            from .sps import load_sps_table
            sps = load_sps_table(root / meta["sps"])
        if meta.get("sts"):
            from .sts import StsCalibration
            sts = StsCalibration.load(root / meta["sts"]).temperatures
    if scheduler in ("algorithm1", "async") and sps is None:
        log.warning("no SPS table in %s: falling back to fixed-length verification", engine_dir)
        scheduler = "fixed"
    cfg = EngineConfig(mode=mode, scheduler=scheduler, max_batch=max_batch, max_context=max_context,
                       prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, sampling_rule=sampling_rule)
    return SpecEngine(target, drafter, cfg, sps=sps, sts_temperatures=sts)


SAMPLING_RULES = ("coupled", "rejection", "auto")


def _is_coupled(rule: str, seeded: bool) -> bool:
    """Whether a request is verified by the coupled rule under ``EngineConfig.sampling_rule``."""
    return rule == "coupled" or (rule == "auto" and seeded)


def _next_position(r: _Request) -> int:
    """The sequence position of the request's next token (its first draft, or its first token)."""
    return len(r.prompt) + len(r.generated)


def _draft_noise(reqs: list[_Request]) -> coupled.RaceNoise:
    """The drafter's noise: coupled requests draft with the noise their target choices use
    (seed, position); rejection-sampled ones with fresh noise per round, since that rule needs
    drafts independent of everything already decided."""
    keys = [r.seed if r.coupled else coupled.round_key(r.seed, r.steps) for r in reqs]
    return coupled.RaceNoise(torch.tensor(keys, dtype=torch.long),
                             torch.tensor([_next_position(r) for r in reqs], dtype=torch.long))


def _verify_probs(prop, rows: list[int], R: int, L: int, temps: torch.Tensor,
                  target_logits: torch.Tensor) -> torch.Tensor | None:
    """Draft distributions [R, L, V] for verification, or None when every request is greedy
    (verification takes None as one-hot at the drafts). Rows that did not draft, and greedy
    rows of a proposal without distributions, verify nothing: their entries are never read."""
    if not bool((temps > 0).any()):
        return None
    if L == 0 or prop.probs is None:
        return target_logits.new_zeros(R, L, target_logits.shape[-1])
    probs = prop.probs[:, :L].float()
    if len(rows) < R:
        full = probs.new_zeros((R,) + probs.shape[1:])
        full[torch.tensor(rows, device=full.device)] = probs
        probs = full
    return probs
