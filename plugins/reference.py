"""Reference implementation of the confidence-scheduled verify step.

This module fixes the semantics; the CUDA kernels, the PyTorch op, the TensorRT plugin,
the evaluation loop and the engine are all tested against it. Pure PyTorch, any device.

Terms (per request r, K = maximum number of draft tokens per request):

- draft tokens ``x[r, 0..K-1]``: proposed by the drafter, left to right.
- verify length ``l[r]`` in ``0..K``: how many of the drafts are checked this step
  (chosen by the scheduler; drafts past ``l[r]`` are ignored as if never proposed).
- accepted: the drafts ``x[r, :n]`` that pass the test, ``n <= l[r]``.
- recovered token: on the first rejection (position ``n < l[r]``) a token sampled from
  the residual ``norm(max(p_t - p_d, 0))`` (greedy: the target argmax).
- bonus token: when all ``l[r]`` verified drafts are accepted, a token sampled from the
  target distribution at position ``l[r]`` (greedy: its argmax).

So every request emits ``n + 1`` tokens per step: ``output_tokens[r, :n+1]`` holds the
accepted drafts followed by the recovered or bonus token; slots past that are ``-1``.
``accept_len`` in our metrics counts these ``n + 1`` tokens (bonus included).

Target logits are indexed so that ``target_logits[r, j]`` is the target's next-token
distribution *before* draft ``j`` (i.e. it judges ``x[r, j]``) and ``target_logits[r, l]``
gives the bonus. Rows with temperature 0 are greedy; others are sampled with the usual
temperature / top-k / top-p processing applied to the target logits, so the emitted
tokens follow exactly the processed target distribution.

Randomness is counter based: request r draws its uniforms from ``(seed[r], offset[r])``;
the same seed and offset give the same result on the same device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "VerifyResult",
    "process_logits",
    "verify",
    "schedule_prefix",
    "ranked_candidates",
    "verify_lens_of",
    "prefix_survival",
    "pack_ragged",
    "unpack_ragged",
]


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [R] int64, accepted drafts n_r (bonus/recovered not counted)
    output_tokens: torch.Tensor  # [R, K+1] int64, accepted drafts then one more token, -1 padded
    num_emitted: torch.Tensor  # [R] int64, n_r + 1


def process_logits(
    logits: torch.Tensor,  # [..., V]
    temperature: torch.Tensor,  # [...] broadcastable over leading dims; 0 = greedy
    top_k: torch.Tensor | None = None,  # [...] int, 0 = off
    top_p: torch.Tensor | None = None,  # [...] float, 1.0 = off
) -> torch.Tensor:
    """Turn raw logits into the probabilities a request actually samples from.

    Greedy rows (temperature 0) become a one-hot on the argmax, so that the same
    acceptance rule covers greedy and sampled requests. Computed in fp32.
    """
    logits = logits.float()
    lead = logits.shape[:-1]
    temperature = temperature.float().reshape(temperature.shape + (1,) * (len(lead) - temperature.dim()))
    greedy = (temperature <= 0).expand(lead)
    scaled = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(-1)
    if top_k is not None and bool((top_k > 0).any()):
        k = top_k.long().reshape(top_k.shape + (1,) * (len(lead) - top_k.dim())).expand(lead)
        k = torch.where(k > 0, k.clamp(max=logits.shape[-1]), torch.full_like(k, logits.shape[-1]))
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and bool((top_p < 1.0).any()):
        p = top_p.float().reshape(top_p.shape + (1,) * (len(lead) - top_p.dim())).expand(lead)
        # stable: tied logits keep index order, so the result is the same on every device
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept);
        # top_p >= 1 keeps everything (the cumulative sum can round to 1 before the tail)
        mass_before = probs_sorted.cumsum(-1) - probs_sorted
        drop_sorted = (mass_before >= p.unsqueeze(-1)) & (p.unsqueeze(-1) < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if not bool(greedy.any()):  # all sampled: no one-hot rows to build ([..., V] of them is costly)
        return probs
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(greedy.unsqueeze(-1), onehot, probs)


def _uniforms(seed: torch.Tensor, offset: torch.Tensor, count: int, device: torch.device) -> torch.Tensor:
    """Per-request uniforms in [0, 1): [R, count] from a generator keyed by (seed, offset)."""
    rows = []
    for s, o in zip(seed.tolist(), offset.tolist()):
        g = torch.Generator(device="cpu")
        g.manual_seed((int(s) * 0x9E3779B97F4A7C15 + int(o)) % (2**63))
        rows.append(torch.rand(count, generator=g, dtype=torch.float64))
    if not rows:
        return torch.empty(0, count, dtype=torch.float64, device=device)
    return torch.stack(rows).to(device)


def _sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [R, V] (unnormalised ok), u [R] in [0,1) -> [R] int64."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, (u.unsqueeze(-1) * total).contiguous(), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def check_verify_shapes(draft_tokens: torch.Tensor, target_logits: torch.Tensor, verify_lens: torch.Tensor,
                        draft_probs: torch.Tensor | None = None, check_range: bool = True) -> tuple[int, int, int]:
    """(R, K, V) of a verify call, after checking that drafts [R, K], logits [R, K+1, V],
    lengths [R] and, when given, draft probabilities [R, K, V] fit together (one message per
    mismatch, shared by every verify rule and the CUDA op). ``check_range`` also checks that
    the lengths lie in [0, K]; the op skips it (it would cost a host sync) and clamps instead."""
    R, K = draft_tokens.shape
    V = target_logits.shape[-1]
    if target_logits.dim() != 3 or target_logits.shape[:2] != (R, K + 1):
        raise ValueError(f"target_logits must be [R, K+1, V] = [{R}, {K + 1}, V], got {tuple(target_logits.shape)}")
    if verify_lens.shape != (R,):
        raise ValueError(f"verify_lens must be [R]={R}, got {tuple(verify_lens.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (R, K, V):
        raise ValueError(f"draft_probs must be [R, K, V] = [{R}, {K}, {V}], got {tuple(draft_probs.shape)}")
    if check_range and bool(((verify_lens < 0) | (verify_lens > K)).any()):
        raise ValueError(f"verify_lens must lie in [0, {K}]")
    return R, K, V


def verify(
    draft_tokens: torch.Tensor,  # [R, K] int64
    draft_probs: torch.Tensor | None,  # [R, K, V] float, probabilities the drafts were sampled from
    target_logits: torch.Tensor,  # [R, K+1, V] float
    verify_lens: torch.Tensor,  # [R] int64 in [0, K]
    temperature: torch.Tensor,  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None,  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None,  # [R] float, 1.0 = off
    seed: torch.Tensor | None = None,  # [R] int64
    offset: torch.Tensor | None = None,  # [R] int64 (e.g. the request's step counter)
) -> VerifyResult:
    """Lossless speculative verification for a ragged batch (greedy and sampled rows mixed).

    Accept draft j while ``u_j < min(1, p_t(x_j) / p_d(x_j))`` for ``j < l``; on the first
    rejection emit a sample from ``norm(max(p_t - p_d, 0))``; if all ``l`` are accepted emit
    a bonus sample from ``p_t`` at position ``l``. Greedy rows (temperature 0) accept while
    the draft equals the target argmax and emit the argmax. ``draft_probs`` may be None when
    every row is greedy. A draft token outside ``[0, V)`` inside the verified prefix is
    rejected (never emitted).

    Example (greedy, K=2, V=3): drafts [[2, 1]], target argmaxes [2, 0, 1], l=[2] ->
    num_accepted [1], output_tokens [[2, 0, -1]].
    """
    R, K, V = check_verify_shapes(draft_tokens, target_logits, verify_lens, draft_probs)
    device = target_logits.device
    greedy = temperature <= 0
    if draft_probs is None:
        if not bool(greedy.all()):
            raise ValueError("draft_probs is required for sampled (temperature > 0) rows")
        draft_probs = torch.nn.functional.one_hot(draft_tokens.clamp(0, V - 1), V).float()

    p_t = process_logits(target_logits, temperature.unsqueeze(-1),
                         None if top_k is None else top_k.unsqueeze(-1),
                         None if top_p is None else top_p.unsqueeze(-1))  # [R, K+1, V]
    p_d = draft_probs.float()
    seed = torch.zeros(R, dtype=torch.long) if seed is None else seed
    offset = torch.zeros(R, dtype=torch.long) if offset is None else offset
    u = _uniforms(seed.cpu(), offset.cpu(), K + 1, device)  # [R, K+1]: K accept tests + 1 final sample

    rows = torch.arange(R, device=device)
    valid = (draft_tokens >= 0) & (draft_tokens < V)  # [R, K]
    x = draft_tokens.clamp(0, V - 1)
    pt_x = p_t[:, :K].gather(-1, x.unsqueeze(-1)).squeeze(-1).double()  # [R, K]
    pd_x = p_d.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()  # [R, K]
    ratio = torch.where(pd_x > 0, pt_x / pd_x.clamp(min=1e-300), torch.zeros_like(pt_x))
    ok_sampled = u[:, :K] < ratio.clamp(max=1.0)
    ok_greedy = x == target_logits[:, :K].argmax(-1)
    ok = torch.where(greedy.unsqueeze(-1), ok_greedy, ok_sampled)
    in_range = torch.arange(K, device=device).unsqueeze(0) < verify_lens.unsqueeze(-1)
    ok = ok & in_range & valid
    # accepted prefix length: index of the first failure (or l if none)
    n = torch.cumprod(ok.long(), dim=-1).sum(-1)  # [R]

    rejected = n < verify_lens
    p_t_n = p_t[rows, n]  # [R, V] target distribution at the stopping position
    p_d_n = p_d[rows, n.clamp(max=K - 1)] if K > 0 else torch.zeros_like(p_t_n)
    residual = torch.clamp(p_t_n - p_d_n, min=0)
    # p_t == p_d leaves no residual mass; rejection then has probability 0, fall back to p_t
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_t_n)
    final_dist = torch.where((rejected & ~greedy).unsqueeze(-1), residual, p_t_n)
    final = _sample_from(final_dist, u[:, K])
    final = torch.where(greedy, target_logits[rows, n].argmax(-1), final)

    out = torch.full((R, K + 1), -1, dtype=torch.long, device=device)
    keep = torch.arange(K + 1, device=device).unsqueeze(0) < n.unsqueeze(-1)
    out[:, :K] = torch.where(keep[:, :K], x, out[:, :K])
    out[rows, n] = final
    return VerifyResult(num_accepted=n, output_tokens=out, num_emitted=n + 1)


# tau adds survival values rounded to this grid (2^-36): every partial sum up to 2^17 batch
# tokens is then exact in float64, so a parallel scan (the CUDA kernel) returns the same
# bits as this sequential loop. The rounding (< 1.5e-11) is far below any SPS effect.
TAU_GRID = 2.0**36


def prefix_survival(confidence: torch.Tensor) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i]: probability that drafts 1..j all survive. [R, K] -> [R, K]."""
    return torch.cumprod(confidence.double().clamp(0.0, 1.0), dim=-1)


def ranked_candidates(confidence: torch.Tensor, max_lens: torch.Tensor | None = None
                      ) -> tuple[list[int], list[float]]:
    """Algorithm 1's walk order over ``confidence [R, K]``: the candidates (r, j) with
    ``a[r, j] > 0`` and ``j < max_lens[r]``, in descending ``a`` (ties: lower r, then lower j,
    so each request's candidates come in order of j) -> (their rows, their ``a`` rounded to
    multiples of ``1 / TAU_GRID``). Host lists: a step has a few dozen candidates, which a
    Python sort orders in microseconds where tensor ops cost a launch each."""
    R, K = confidence.shape
    a = prefix_survival(confidence.cpu()).tolist()  # CPU cumprod: sequential, same bits everywhere
    caps = [K] * R if max_lens is None else max_lens.long().cpu().clamp(0, K).tolist()
    # sorting (-a, r, j) is the stable descending order of a over the (r, j) row-major order
    ranked = sorted((-x, r, j) for r, row in enumerate(a) for j, x in enumerate(row[:caps[r]]) if x > 0)
    # exact-sum grid for tau; round() is round-half-even, as torch.round
    return [r for _, r, _ in ranked], [round(-x * TAU_GRID) / TAU_GRID for x, _, _ in ranked]


def verify_lens_of(rows: list[int], admitted: int, R: int) -> torch.Tensor:
    """Verify lengths [R] int64 when the first ``admitted`` candidates of a walk (their ``rows``,
    in ``ranked_candidates`` order) are admitted: a request's candidates come in order of j, so
    its verify length is how many of them were admitted."""
    lens = [0] * R
    for r in rows[:admitted]:
        lens[r] += 1
    return torch.tensor(lens, dtype=torch.long)


def schedule_prefix(
    confidence: torch.Tensor,  # [R, K] per-position confidences c in [0, 1]
    sps: torch.Tensor,  # [N+1] steps/s indexed by batch tokens B (sps[0] unused); B > N is infeasible
    max_lens: torch.Tensor | None = None,  # [R] int, cap per request (e.g. drafts available)
    early_stop: bool = True,
) -> torch.Tensor:
    """Report Algorithm 1: choose per-request verify lengths [R] maximising tau * SPS(B).

    Candidates (r, j) with a[r, j] > 0 are visited in descending a (ties: lower r, then
    lower j, so a request's prefix is always admitted in order). Each admission adds one
    batch token and a[r, j] expected accepts. We keep going while the throughput
    ``Theta = tau * SPS(B)`` strictly improves and STOP at the first candidate that does
    not improve it. The stop is what makes scheduling lossless: the decision to verify
    draft j is then taken from confidences of drafts before j only (a[r, j] depends on
    x_{j-1} through the Markov feature, never on x_j). ``early_stop=False`` gives the
    retrospective global search of the report's Appendix A, which biases the output
    distribution; it exists only so tests can demonstrate that.

    Bit-reproducible: a is the left-to-right float64 product computed on the CPU, and tau
    adds the a values rounded to multiples of 2^-36 (``TAU_GRID``) so that every partial
    sum is exact and the CUDA kernel's parallel scan gives the same bits.
    """
    R, K = confidence.shape
    sps = sps.double().cpu()
    n_max = sps.numel() - 1
    lens = torch.zeros(R, dtype=torch.long)
    if R == 0 or R > n_max:
        return lens.to(confidence.device)
    cand_r, cand_q = ranked_candidates(confidence, max_lens)
    batch, tau = R, float(R)
    sps_l = sps.tolist()
    best = tau * sps_l[batch]
    admitted = 0  # the best choice admits the first ``admitted`` candidates
    for i, ar in enumerate(cand_q):
        batch += 1
        tau += ar
        theta = tau * sps_l[batch] if batch <= n_max else float("-inf")
        if theta > best:
            best = theta
            admitted = i + 1
        elif early_stop or batch > n_max:
            break
    return verify_lens_of(cand_r, admitted, R).to(confidence.device)


def pack_ragged(padded: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L, ...] padded rows + [R] lengths -> (packed [sum(lens), ...], cu_lens [R+1])."""
    keep = torch.arange(padded.shape[1], device=padded.device).unsqueeze(0) < lens.unsqueeze(-1)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long, device=lens.device)
    cu[1:] = lens.cumsum(0)
    return padded[keep], cu


def unpack_ragged(packed: torch.Tensor, cu_lens: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """Inverse of pack_ragged: -> [R, width, ...] padded with ``fill``."""
    R = cu_lens.numel() - 1
    out = packed.new_full((R, width) + tuple(packed.shape[1:]), fill)
    lens = cu_lens[1:] - cu_lens[:-1]
    keep = torch.arange(width, device=packed.device).unsqueeze(0) < lens.unsqueeze(-1)
    out[keep] = packed
    return out
