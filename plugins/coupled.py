"""The coupled verify rule: the target's random choice fixed by (seed, position) alone.

Sampling by an exponential race: with ``E_v ~ Exp(1)`` independent per token id ``v``,
``argmax_v p(v) / E_v`` is a sample from ``p`` (``E_v / p(v)`` is exponential with rate
``p(v)``, and the smallest of independent exponentials is ``v`` with probability
``p(v) / sum p``); it is the Gumbel-max trick written without the logarithm of ``p``.
Here ``E_v`` is not drawn from a generator but computed, by an integer hash of
``(seed, position, token id)``, so every token of a request has its noise fixed in advance:

- the target's choice at position ``t`` is ``y_t = argmax_v p_t(v | y_<t) / E(seed, t, v)``,
  with ``p_t`` the request's processed distribution (temperature, top-k, top-p, exactly as
  ``reference.process_logits``; greedy rows take the argmax of the logits);
- the drafter draws its token for position ``t`` with the *same* noise,
  ``x_t = argmax_v q(v) / E(seed, t, v)`` (over its draft vocabulary, indexed by target id),
  which is an exact sample from ``q`` and equals ``y_t`` whenever the two distributions
  agree closely enough;
- verification accepts draft ``x_j`` exactly when it equals ``y_j`` and emits ``y_n`` at the
  first mismatch (or ``y_l`` as the bonus).

So the emitted sequence is ``y`` itself: a function of the seed, the prompt and the target,
whatever the drafter proposed, how many drafts the scheduler verified, whether the gate
drafted at all, and which requests shared the batch. Target-only decoding with the same
seed gives the same tokens. Each ``y_t`` is drawn from ``p_t(. | y_<t)`` with noise that no
earlier choice looked at, so the output distribution is exactly the target's. The price is
acceptance: two exact samplers sharing their noise agree less often than rejection sampling
(``reference.verify``) accepts, ``P(x = y) >= (1 - TV) / (1 + TV)`` against ``1 - TV``
(docs/benchmarks/seeded_sampling.md measures the cost).

The noise: a 32-bit key per (seed, position) from two rounds of an integer mixer, xor'ed
with a mixed token id, mixed again; its low 31 bits give ``w`` uniform in (0, 1) and
``E = -log1p(-w)``, which keeps the small values of ``E`` (the ones that decide a race)
exact to float32 precision. All integer work is int32 with wrap-around multiplication
(``test_seeded_sampling`` pins it to the same hash in Python integers), vectorised over rows
and tokens, on any device; rows are processed in chunks so the noise never occupies more
than a few MiB. On the CPU a race over whole rows runs as one kernel (``cpu_choice.py``), which
takes the logarithm of a few columns per row rather than all of them; greedy cells take their
argmax there too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from . import cpu_choice
from .reference import VerifyResult, check_verify_shapes, process_logits

__all__ = ["RACE_CANDIDATES", "RaceNoise", "race_noise", "race_sample", "race_sample_top", "round_key",
           "verify_coupled", "verify_coupled_packed"]

_M32 = 0xFFFFFFFF
# multipliers of a 32-bit xor-shift-multiply mixer (as int32: the second exceeds 2^31)
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)  # 2^32 / phi: spreads consecutive integers before mixing
_SEED_SALT = 0x5BD1E995
_POS_SALT = 0x27D4EB2F
CHUNK_ELEMENTS = 1 << 19  # rows * tokens of noise materialised at once (2 MiB of int32)
RACE_CANDIDATES = 64  # columns a coupled draft races among (``race_sample_top``)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place on int32 ``x``: a bijective 32-bit mixer (shifts are logical: masked)."""
    x ^= (x >> 16) & 0xFFFF
    x *= _MUL1
    x ^= (x >> 15) & 0x1FFFF
    x *= _MUL2
    x ^= (x >> 16) & 0xFFFF
    return x


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 with the same 32 bits."""
    x = x & _M32
    return torch.where(x >= (1 << 31), x - (1 << 32), x).to(torch.int32)


def _row_keys(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """key [n] int64 (>= 0), pos [n] int64 -> [n] int32: one mixed key per (key, position)."""
    lo = _mix32_(_as_int32(key) ^ _SEED_SALT)
    hi = _mix32_(_as_int32(key >> 32) * _GOLDEN + _SEED_SALT)
    k = _mix32_(lo ^ hi)
    p = _mix32_(_as_int32(pos) * _GOLDEN + _POS_SALT)
    return _mix32_(k ^ p)


_ID_MIX: dict[tuple[int, str], torch.Tensor] = {}


def _id_mix(ids: torch.Tensor | None, vocab: int, device: torch.device) -> torch.Tensor:
    """Mixed token ids [N] int32 (cached for the whole vocabulary ``0..vocab-1``)."""
    if ids is None:
        cache_key = (vocab, str(device))
        if cache_key not in _ID_MIX:
            _ID_MIX[cache_key] = _mix32_(torch.arange(vocab, device=device, dtype=torch.int32) * _GOLDEN)
        return _ID_MIX[cache_key]
    return _mix32_(ids.to(device=device, dtype=torch.int32) * _GOLDEN)


def _noise_from(keys: torch.Tensor, idm: torch.Tensor) -> torch.Tensor:
    """keys [n] int32, mixed ids [N] (shared by the rows) or [n, N] (per row) int32 -> E [n, N]
    float32, Exp(1) by inverse CDF."""
    h = _mix32_(keys.unsqueeze(-1) ^ (idm if idm.dim() == 2 else idm.unsqueeze(0)))
    w = (h & 0x7FFFFFFF).float().add_(0.5).mul_(2.0**-31).clamp_(max=1.0 - 2.0**-24)
    return torch.log1p(w.neg_()).neg_()


def race_noise(key: torch.Tensor, pos: torch.Tensor, vocab: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The race noise ``E [n, N]`` for rows (key [n], pos [n]) at token ids ``ids [N]``
    (default: all of ``0..vocab-1``). The same (key, position, id) always gives the same value."""
    dev = ids.device if ids is not None else key.device
    return _noise_from(_row_keys(key.to(dev).long(), pos.to(dev).long()), _id_mix(ids, vocab, dev))


def race_sample(probs: torch.Tensor, key: torch.Tensor, pos: torch.Tensor,
                ids: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: ``argmax_v probs[i, v] / E(key[i], pos[i], id_v)`` -> [n] int64.

    probs [n, N] (any non-negative weights; zeros never win while a row has mass); ``ids [N]``
    are the token ids of the columns (default ``0..N-1``). The result is an index into the columns.
    """
    return _race(probs, _row_keys(key.to(probs.device).long(), pos.to(probs.device).long()), ids)


def _race(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """``race_sample`` with the rows' mixed keys [n] int32 (``_row_keys``) already computed."""
    n, N = probs.shape
    out = torch.empty(n, dtype=torch.long, device=probs.device)
    if n == 0:
        return out
    idm = _id_mix(ids, N, probs.device)
    if probs.device.type == "cpu" and cpu_choice.available():  # one pass per row (cpu_choice.py)
        return cpu_choice.race_argmax(probs, keys, idm)
    # a few MiB at a time on the CPU (cache-sized); far more per launch on a GPU
    chunk = CHUNK_ELEMENTS if probs.device.type == "cpu" else CHUNK_ELEMENTS * 64
    step = max(1, chunk // max(N, 1))
    for s in range(0, n, step):
        e = _noise_from(keys[s:s + step], idm)
        out[s:s + step] = torch.div(probs[s:s + step].float(), e, out=e).argmax(-1)
    return out


def race_sample_top(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, pos: torch.Tensor,
                    ids: torch.Tensor | None = None, candidates: int = RACE_CANDIDATES) -> torch.Tensor:
    """The race among each row's ``candidates`` likeliest columns: [n] column indices.

    logits [n, N] and temperature [n] (> 0) define ``q = softmax(logits / T)``; ``ids [N]`` are the
    columns' token ids (default ``0..N-1``). The winner is an exact sample from ``q`` cut to its
    ``candidates`` most likely tokens, and it is ``race_sample``'s winner over all of ``q`` whenever
    that one is among them (a race won outside them has probability at most ``q``'s mass there).
    It hashes ``candidates`` noise values per row instead of ``N``: for drafts judged by the
    coupled rule, which reads the draws and never their law, that is all a draw needs."""
    keys = _row_keys(key.to(logits.device).long(), pos.to(logits.device).long())
    return _race_top(logits, temperature, keys, ids, candidates)


def _race_top(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None,
              candidates: int) -> torch.Tensor:
    """``race_sample_top`` with the rows' mixed keys [n] int32 already computed."""
    n, N = logits.shape
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    top, col = logits.float().topk(min(candidates, N), dim=-1)  # [n, m], in descending order
    weights = torch.exp((top - top[:, :1]) / temperature.to(top.device).float().unsqueeze(-1))
    tid = col if ids is None else ids.to(col.device)[col]
    e = _noise_from(keys.to(col.device), _id_mix(tid, N, col.device))
    return col.gather(1, torch.div(weights, e, out=e).argmax(-1, keepdim=True)).squeeze(1)


def round_key(seed: int, round_: int) -> int:
    """A noise key for one verify round of a request (rules that need fresh draft noise per
    round): a 63-bit integer from (seed, round), disjoint in practice from plain seeds."""
    return (int(seed) * 0x9E3779B97F4A7C15 + 0xD1B54A32D192ED03 * (int(round_) + 1)) % (1 << 63)


@dataclass
class RaceNoise:
    """Noise for the drafter's samples: row ``i`` draws its k-th draft (0-based) with the
    noise of ``(key[i], pos[i] + k)``, so with ``key`` = the request's seed and ``pos`` = the
    position of the first draft, a draft uses exactly the noise the coupled rule judges it with.

    The mixed keys of every (row, offset) are computed once, for ``KEY_SPAN`` offsets at a time,
    and reused by each draft position: per position they cost more than a small race itself."""

    key: torch.Tensor  # [R] int64
    pos: torch.Tensor  # [R] int64, sequence position of the first draft token
    # every row's drafts are judged by the coupled rule with this very noise, which reads the
    # draws and never the distributions they came from: a drafter may skip the distributions
    # and race among its likeliest candidates only (``draw_top``)
    coupled: bool = False
    _keys: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # [R, span] int32

    KEY_SPAN: ClassVar[int] = 16

    def keys_at(self, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Mixed keys [n] int32 of ``rows`` (indices into R; default all) at draft offset ``k``."""
        if self._keys is None or k >= self._keys.shape[1]:
            span = max(self.KEY_SPAN, k + 1)
            R = self.key.shape[0]
            offs = torch.arange(span, dtype=torch.long).repeat(R)
            pos = self.pos.long().repeat_interleave(span) + offs
            self._keys = _row_keys(self.key.long().repeat_interleave(span), pos).view(R, span)
        col = self._keys[:, k]
        return col if rows is None else col[rows.cpu()]

    def draw_top(self, logits: torch.Tensor, temperature: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None, candidates: int = RACE_CANDIDATES) -> torch.Tensor:
        """``race_sample_top`` of ``logits [n, N]`` at ``temperature [n]`` for ``rows`` (default all)
        at draft offset ``k``, columns at target ids ``ids`` -> column index per row [n]."""
        return _race_top(logits, temperature, self.keys_at(k, rows), ids, candidates)

    def draw(self, probs: torch.Tensor, k: int, rows: torch.Tensor | None = None,
             ids: torch.Tensor | None = None) -> torch.Tensor:
        """probs [n, N] for ``rows`` (indices into R; default all) at draft offset ``k``, columns
        at target ids ``ids`` (default ``0..N-1``) -> column index per row [n]."""
        return _race(probs, self.keys_at(k, rows).to(probs.device), ids)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [n, V], by the CPU kernel where it applies (``cpu_choice.py``)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_choice.available():
        return cpu_choice.argmax(logits)
    return logits.argmax(-1)


def verify_coupled(
    draft_tokens: torch.Tensor,  # [R, K] int64
    target_logits: torch.Tensor,  # [R, K+1, V] float
    verify_lens: torch.Tensor,  # [R] int64 in [0, K]
    temperature: torch.Tensor,  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None,  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None,  # [R] float, 1.0 = off
    seed: torch.Tensor | None = None,  # [R] int64 >= 0
    position: torch.Tensor | None = None,  # [R] int64: sequence position that target_logits[r, 0] predicts
) -> VerifyResult:
    """Coupled verification (module docstring): accept ``x_j`` while it equals the target's own
    choice ``y_j``; emit ``y_n`` at the first mismatch or ``y_l`` after ``l`` accepts.

    Same shapes, terms and result as ``reference.verify``, without draft probabilities (the
    rule never reads them). Greedy rows are identical under both rules. A draft outside
    ``[0, V)`` never equals a choice, so it is rejected. Only the cells ``j <= l[r]`` are
    read (``l + 1`` is never emitted; a ragged batch's padding is not looked at).

    Example (greedy, K=2, V=3): drafts [[2, 1]], target argmaxes [2, 0, 1], l=[2] ->
    num_accepted [1], output_tokens [[2, 0, -1]].
    """
    R, K, _ = check_verify_shapes(draft_tokens, target_logits, verify_lens)
    lens = verify_lens.to(target_logits.device)
    cells = torch.arange(K + 1, device=target_logits.device).unsqueeze(0) <= lens.unsqueeze(-1)
    return verify_coupled_packed(draft_tokens, target_logits[cells], verify_lens, temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, position=position)


def verify_coupled_packed(
    draft_tokens: torch.Tensor,  # [R, K] int64
    token_logits: torch.Tensor,  # [sum(l + 1), V] float: row r's logits at positions 0..l[r], row after row
    verify_lens: torch.Tensor,  # [R] int64 in [0, K]
    temperature: torch.Tensor,  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
) -> VerifyResult:
    """``verify_coupled`` on the logits of the verified cells alone, packed as the target
    computed them for the ragged rows ``[anchor, x_0 .. x_{l-1}]``: no padded grid is built.
    Greedy rows take one argmax per cell; sampled rows process and race-sample theirs."""
    R, K = draft_tokens.shape
    device = token_logits.device
    lens = verify_lens.long().to(device)
    if lens.shape != (R,) or bool(((lens < 0) | (lens > K)).any()):
        raise ValueError(f"verify_lens must be [R]={R} with entries in [0, {K}]")
    counts = lens + 1
    N = int(counts.sum())
    if token_logits.dim() != 2 or token_logits.shape[0] != N:
        raise ValueError(f"token_logits must be [sum(l + 1), V] = [{N}, V], got {tuple(token_logits.shape)}")
    seed = torch.zeros(R, dtype=torch.long) if seed is None else seed
    position = torch.zeros(R, dtype=torch.long) if position is None else position
    row = torch.repeat_interleave(torch.arange(R, device=device), counts)  # [N]: each cell's row
    col = torch.arange(N, device=device) - (torch.cumsum(counts, 0) - counts)[row]  # its position j
    greedy = (temperature <= 0).to(device)[row]
    flat = torch.empty(N, dtype=torch.long, device=device)
    if bool(greedy.all()):
        flat = _argmax(token_logits)
    else:
        g = greedy.nonzero(as_tuple=True)[0]
        if g.numel():
            flat[g] = _argmax(token_logits[g])
        s = (~greedy).nonzero(as_tuple=True)[0]
        r_s = row[s]
        r_cpu = r_s.cpu()
        sampled = token_logits if g.numel() == 0 else token_logits[s]  # all sampled: no copy of the logits
        p = process_logits(sampled, temperature.to(device)[r_s],
                           None if top_k is None else top_k.to(device)[r_s],
                           None if top_p is None else top_p.to(device)[r_s])
        flat[s] = race_sample(p, seed.cpu()[r_cpu], position.cpu()[r_cpu] + col[s].cpu())
    choice = torch.zeros(R, K + 1, dtype=torch.long, device=device)
    choice[row, col] = flat

    x = draft_tokens.to(device)
    in_range = torch.arange(K, device=device).unsqueeze(0) < lens.unsqueeze(-1)
    ok = (x == choice[:, :K]) & in_range
    n = torch.cumprod(ok.long(), dim=-1).sum(-1)  # [R]: the accepted prefix
    keep = torch.arange(K + 1, device=device).unsqueeze(0) <= n.unsqueeze(-1)
    out = torch.where(keep, choice, torch.full_like(choice, -1))
    return VerifyResult(num_accepted=n, output_tokens=out, num_emitted=n + 1)
