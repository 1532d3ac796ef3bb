"""Confidence scheduling must leave the sampled output distribution exactly the target's.

Two settings, both run through ``plugins.reference.verify``:

- the report's Appendix A counterexample (one request, K=2), where a retrospective global
  search (Algorithm 1 without its early stop) shifts the first token from (0.7, 0.3) to
  (0.85, 0.15) while the early-stopping scheduler keeps (0.7, 0.3);
- a multi-step Markov toy: bigram target and drafter over 5 tokens, a confidence that
  depends on the previous draft token (like the Markov head's), many small batches with
  different SPS tables, requests joining and leaving; the generated 3-grams are compared
  with the exact target distribution by a chi-square test. A negative control shows the
  same machinery rejects the retrospective search. The toy runs under both verify rules:
  rejection sampling (``reference.verify``) and the coupled rule (``plugins/coupled.py``),
  whose output must moreover be the same token for token under every policy.

Fixed seeds make every test deterministic; the thresholds are for p-values, so a correct
scheduler fails only if the seed happens to land in the 0.1% tail (it does not).
"""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from dspark.engine.scheduler import Algorithm1Scheduler, AsyncScheduler, NoSlowdownScheduler, VerifyLengthPolicy
from dspark.plugins.coupled import race_sample, verify_coupled
from dspark.plugins.reference import schedule_prefix, verify

from ..distribution import pooled_chisquare_pvalue

A, B = 0, 1
P_TARGET = torch.tensor([0.7, 0.3])
P_DRAFT = torch.tensor([0.5, 0.5])
SPS_APPENDIX_A = torch.tensor([0.0, 1.0, 0.5, 0.45])  # indexed by batch tokens; [0] unused


def _appendix_a_first_tokens(early_stop: bool, rounds: int, seed: int) -> torch.Tensor:
    """Simulate ``rounds`` independent single-request steps; -> first emitted token [rounds]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(P_DRAFT.expand(rounds, 2), 2, replacement=True, generator=g)  # [N, 2]
    c1 = torch.full((rounds,), 0.8)
    c2 = torch.where(x[:, 0] == A, torch.tensor(0.9), torch.tensor(0.0))  # depends on x1 (Markov head)
    conf = torch.stack([c1, c2], dim=1)
    # one request per step, so each round is its own batch of R = 1; schedule each distinct row once
    uniq, inverse = torch.unique(conf, dim=0, return_inverse=True)
    lens = torch.stack([schedule_prefix(u[None], SPS_APPENDIX_A, early_stop=early_stop)[0] for u in uniq])[inverse]
    out = verify(
        draft_tokens=x,
        draft_probs=P_DRAFT.expand(rounds, 2, 2).clone(),
        target_logits=P_TARGET.log().expand(rounds, 3, 2).clone(),
        verify_lens=lens,
        temperature=torch.ones(rounds),
        seed=torch.arange(rounds) + seed * 1_000_003,
        offset=torch.zeros(rounds, dtype=torch.long),
    )
    return out.output_tokens[:, 0]


def test_appendix_a_counterexample_without_early_stop_biases_output():
    """Vocab {A, B}, p_t = (0.7, 0.3), p_d = (0.5, 0.5), K = 2, c1 = 0.8, c2 = 0.9 if x1 = A else 0,
    SPS(1, 2, 3) = (1, 0.5, 0.45): the first emitted token must follow p_t."""
    rounds = 6000
    # the mechanism: without the stop, x1 = A is verified (l = 2) and x1 = B is not (l = 0)
    conf_a = torch.tensor([[0.8, 0.9]])
    conf_b = torch.tensor([[0.8, 0.0]])
    assert int(schedule_prefix(conf_a, SPS_APPENDIX_A, early_stop=False)[0]) == 2
    assert int(schedule_prefix(conf_b, SPS_APPENDIX_A, early_stop=False)[0]) == 0
    assert int(schedule_prefix(conf_a, SPS_APPENDIX_A, early_stop=True)[0]) == 0, \
        "Theta(1 draft) = 0.9 < Theta(0) = 1.0, so the early stop must verify nothing"

    first_retro = _appendix_a_first_tokens(early_stop=False, rounds=rounds, seed=1)
    n_a = int((first_retro == A).sum())
    p_target = stats.binomtest(n_a, rounds, 0.7).pvalue
    p_biased = stats.binomtest(n_a, rounds, 0.85).pvalue
    assert p_target < 1e-12, f"retrospective search should bias P(A) away from 0.7, got {n_a / rounds:.3f}"
    assert p_biased > 1e-3, f"retrospective search should give P(A) = 0.85 (report), got {n_a / rounds:.3f}"

    first_ours = _appendix_a_first_tokens(early_stop=True, rounds=rounds, seed=2)
    n_a = int((first_ours == A).sum())
    p_target = stats.binomtest(n_a, rounds, 0.7).pvalue
    assert p_target > 1e-3, f"early-stop scheduler must emit P(A) = 0.7, got {n_a / rounds:.3f} (p={p_target:.2g})"


# ---------------------------------------------------------------------------------------
# Multi-step Markov toy
# ---------------------------------------------------------------------------------------

V, K, L = 5, 3, 6  # vocab, drafts per step, tokens generated per request
START = 0


def _toy_models(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (target bigram [V, V], drafter bigram [V, V], confidence after each token [V])."""
    g = torch.Generator().manual_seed(seed)
    # Dirichlet rows from Gamma draws (sums of Exp(1)), with our own generator
    gam_t = -torch.log(torch.rand(V, V, generator=g)) - torch.log(torch.rand(V, V, generator=g))
    gam_d = -torch.log(torch.rand(V, V, generator=g))
    p_t = (gam_t / gam_t.sum(-1, keepdim=True)).double()  # rows = previous token
    p_d = (0.6 * gam_d / gam_d.sum(-1, keepdim=True) + 0.4 / V).double()  # a different model
    # the confidence of the draft after token v: strongly token dependent (a hard zero after
    # token 1, nearly zero after 3), so a scheduler that peeks at x_j through c_{j+1} would
    # under-verify tokens 1 and 3 and under-emit them
    conf = torch.tensor([0.95, 0.0, 0.9, 0.02, 0.97], dtype=torch.float64)
    return p_t, p_d, conf


def _sps(kind: str, R: int) -> torch.Tensor:
    """SPS tables over batch tokens 0..R*(K+1) for batches of R requests."""
    b = torch.arange(R * (K + 1) + 1, dtype=torch.float64)
    if kind == "low":  # verifying is almost free
        return 1.0 / (1.0 + 0.01 * b)
    if kind == "high":  # verifying is expensive
        return 1.0 / (1.0 + 0.3 * b)
    if kind == "jagged":  # cliffs
        return 1.0 / (1.0 + 0.02 * b + 0.6 * (b > R + 2) + 0.2 * (b > R + 6))
    if kind == "appendix_a":  # like the report's Appendix A: one draft halves SPS, later ones are cheap
        return torch.where(b <= R, 1.0, 0.5 * 0.995 ** (b - R))
    raise ValueError(kind)


class _Retrospective(VerifyLengthPolicy):
    """Algorithm 1 without the early stop: the biased variant, used as a negative control."""

    def __init__(self, sps):
        self.sps = sps

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        return schedule_prefix(confidence, self.sps, cap, early_stop=False)


class _VerifyNothing(VerifyLengthPolicy):
    """Every verify length 0: target-only decoding."""

    def __init__(self, sps):
        pass

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        return torch.zeros(confidence.shape[0], dtype=torch.long)


def run_markov_toy(make_policy, n_batches: int, R: int, tables: list[str], seed: int,
                   rule: str = "rejection") -> torch.Tensor:
    """Generate L tokens for n_batches * R requests; -> tokens [n_batches * R, L].

    Odd requests join one step late; a request leaves its batch once it has L tokens. Under
    ``rule="coupled"`` request i drafts and verifies with the race noise of its seed at each
    token's position (the engine's coupled rule).
    """
    p_t, p_d, conf_table = _toy_models()
    tables = [_sps(kind, R) for kind in tables]
    n = n_batches * R
    batch_of = torch.arange(n) // R
    policies = [make_policy(tables[b % len(tables)]) for b in range(n_batches)]
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, L + K + 1), -1, dtype=torch.long)
    n_gen = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), START, dtype=torch.long)
    joins_at = (torch.arange(n) % 2).long()  # odd requests join at step 1
    step = 0
    while True:
        active = torch.nonzero((joins_at <= step) & (n_gen < L)).squeeze(1)
        if active.numel() == 0 and bool((joins_at <= step).all()):
            break
        if active.numel() == 0:
            step += 1
            continue
        m = active.numel()
        prev = torch.empty(m, K + 1, dtype=torch.long)  # token before draft j (j = K: before bonus)
        prev[:, 0] = last[active]
        drafts = torch.empty(m, K, dtype=torch.long)
        req_seed = active + seed * 10_000_019
        for j in range(K):
            if rule == "coupled":
                drafts[:, j] = race_sample(p_d[prev[:, j]], req_seed, n_gen[active] + j)
            else:
                drafts[:, j] = torch.multinomial(p_d[prev[:, j]], 1, generator=g).squeeze(1)
            prev[:, j + 1] = drafts[:, j]
        conf = conf_table[prev[:, :K]]  # [m, K]: c_j depends on x_{j-1}
        max_lens = (L - n_gen[active]).clamp(max=K)  # known before drafting: lossless
        # active is sorted and batches are contiguous blocks of R requests
        bsel, sizes = torch.unique_consecutive(batch_of[active], return_counts=True)
        lens_parts, ids = [], []
        for b, rows, c, ml in zip(bsel.tolist(), torch.split(active, sizes.tolist()),
                                  torch.split(conf, sizes.tolist()), torch.split(max_lens, sizes.tolist())):
            ids.append([f"req{i}" for i in rows.tolist()])
            lens_parts.append(policies[b](c, ml, ids[-1]))
        lens = torch.cat(lens_parts)
        if rule == "coupled":
            res = verify_coupled(drafts, p_t[prev].log(), lens, torch.ones(m), seed=req_seed, position=n_gen[active])
        else:
            res = verify(
                draft_tokens=drafts,
                draft_probs=p_d[prev[:, :K]],
                target_logits=p_t[prev].log(),
                verify_lens=lens,
                temperature=torch.ones(m),
                seed=req_seed,
                offset=torch.full((m,), step, dtype=torch.long),
            )
        for b, part, acc in zip(bsel.tolist(), ids, torch.split(res.num_accepted, sizes.tolist())):
            policies[b].observe(part, acc.tolist())  # the no-slowdown guard's credits
        cols = n_gen[active].unsqueeze(1) + torch.arange(K + 1)
        keep = torch.arange(K + 1).unsqueeze(0) < res.num_emitted.unsqueeze(1)
        out[active.unsqueeze(1).expand_as(cols)[keep], cols[keep]] = res.output_tokens[keep]
        n_gen[active] += res.num_emitted
        last[active] = out[active, n_gen[active] - 1]
        step += 1
    return out[:, :L]


def _target_trigram(p_t: torch.Tensor, first: int) -> torch.Tensor:
    """Exact P(y_first, y_first+1, y_first+2) (0-based positions) from START: [V, V, V] flat."""
    dist = torch.zeros(V, dtype=torch.float64)
    dist[START] = 1.0
    pt = p_t.double()
    for _ in range(first + 1):
        dist = dist @ pt
    joint = dist[:, None, None] * pt[:, :, None] * pt[None, :, :]
    return joint.reshape(-1)


def _chi2_pvalue(cells: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of observed cell indices [n] against cell probabilities [C]."""
    return pooled_chisquare_pvalue(torch.bincount(cells, minlength=probs.numel()), probs)


def _trigram_cells(tokens: torch.Tensor) -> torch.Tensor:
    return tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]


ALL_TABLES = ["low", "high", "jagged", "appendix_a"]


@pytest.fixture(scope="module")
def toy_target():
    p_t, _, _ = _toy_models()
    return {"first": _target_trigram(p_t, 0), "last": _target_trigram(p_t, L - 3)}


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
@pytest.mark.parametrize("policy", ["algorithm1", "no_slowdown", "async"])
def test_markov_toy_scheduled_output_matches_target_trigram_distribution(policy, rule, toy_target):
    make = {"algorithm1": Algorithm1Scheduler, "no_slowdown": NoSlowdownScheduler, "async": AsyncScheduler}[policy]
    tokens = run_markov_toy(make, n_batches=400, R=8, tables=ALL_TABLES, seed=11, rule=rule)
    assert bool((tokens >= 0).all()), "every request must have generated L tokens"
    for window, start in (("first", 0), ("last", L - 3)):
        p = _chi2_pvalue(_trigram_cells(tokens[:, start:start + 3]), toy_target[window])
        assert p > 1e-3, f"{policy}/{rule}: {window} 3 tokens deviate from the target bigram chain (chi2 p={p:.2g})"


def test_markov_toy_coupled_output_is_target_only_decoding_under_every_policy():
    """The coupled rule emits the target's own seeded choices: the retrospective search, which
    biases rejection sampling, and the scheduled policies all give target-only's tokens."""
    alone = run_markov_toy(_VerifyNothing, n_batches=50, R=8, tables=ALL_TABLES, seed=11, rule="coupled")
    for make in (Algorithm1Scheduler, NoSlowdownScheduler, AsyncScheduler, _Retrospective):
        tokens = run_markov_toy(make, n_batches=50, R=8, tables=ALL_TABLES, seed=11, rule="coupled")
        assert torch.equal(tokens, alone), f"{make.__name__}: coupled output differs from target-only decoding"


def test_markov_toy_chi_square_detects_retrospective_search_bias():
    """Negative control: the same machinery, at a similar size, rejects Algorithm 1 without its stop.

    One request per batch and the Appendix A table: the retrospective search then verifies
    x_1 exactly when c_2 = conf[x_1] is high, so tokens followed by a low confidence (1, 3)
    are under-emitted at the first position.
    """
    p_t, _, _ = _toy_models()
    tokens = run_markov_toy(_Retrospective, n_batches=400, R=1, tables=["appendix_a"], seed=11)
    p = _chi2_pvalue(tokens[:, 0], p_t[START])
    assert p < 1e-6, f"the chi-square test should have the power to see the retrospective bias (p={p:.2g})"
