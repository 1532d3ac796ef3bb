"""CUDA kernels (plugins/csrc via dspark.plugins.ops) against the reference, on a GPU.

Run on a CUDA host: ``pytest tests/gpu -m gpu`` (scripts/gpu_check.sh does it on the H200).
Greedy and the scheduler must be bit-identical; sampling must follow the same (exact,
enumerated) distribution and be reproducible for a fixed (seed, offset).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dspark.plugins import ops, reference

from ..distribution import chisquare_pvalue, exact_verify_outcomes

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected everywhere, run only where a GPU is
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    assert ops.load_extension(verbose=False), f"CUDA extension failed to build: {ops._state['error']}"


def _greedy_batch(R: int, K: int, V: int, dtype: torch.dtype, seed: int, ties: bool = False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(R, K + 1, V, generator=g, device=DEV).to(dtype)
    if ties:  # several maxima per row: the first index must win
        logits[..., V // 3] = logits[..., V // 2] = logits.float().amax(-1).to(dtype)
    arg = logits.float().argmax(-1)  # [R, K+1]
    drafts = arg[:, :K].clone()
    flip = torch.rand(R, K, generator=g, device=DEV) < 0.2  # reject about one draft in five
    drafts[flip] = (drafts[flip] + 1) % V
    lens = torch.randint(0, K + 1, (R,), generator=g, device=DEV)
    return drafts, logits, lens


# --------------------------------------------------------------------------------------
# Greedy: bit-identical
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,K,V", [(1, 7, 151936), (7, 1, 111), (64, 7, 32000), (300, 15, 1000), (5, 0, 4097)])
def test_greedy_is_bit_identical_to_the_reference(R: int, K: int, V: int, dtype: torch.dtype) -> None:
    drafts, logits, lens = _greedy_batch(R, K, V, dtype, seed=R * 31 + K)
    temp = torch.zeros(R, device=DEV)
    got = ops.verify(drafts, None, logits, lens, temp)
    ref = reference.verify(drafts, None, logits, lens, temp)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(got.output_tokens, ref.output_tokens)
    assert torch.equal(got.num_emitted, ref.num_emitted)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_ties_and_unaligned_rows(dtype: torch.dtype) -> None:
    # V = 4099: rows start off 16-byte boundaries, the kernels take the scalar path
    drafts, logits, lens = _greedy_batch(33, 5, 4099, dtype, seed=3, ties=True)
    temp = torch.zeros(33, device=DEV)
    got, ref = ops.verify(drafts, None, logits, lens, temp), reference.verify(drafts, None, logits, lens, temp)
    assert torch.equal(got.output_tokens, ref.output_tokens)


def test_greedy_rows_in_a_mixed_batch_are_bit_identical() -> None:
    R, K, V = 64, 7, 32000
    drafts, logits, lens = _greedy_batch(R, K, V, torch.bfloat16, seed=11)
    p_d = torch.softmax(torch.randn(R, K, V, device=DEV), -1)
    temp = torch.where(torch.arange(R, device=DEV) % 2 == 0, 0.0, 0.8)
    got = ops.verify(drafts, p_d, logits, lens, temp, seed=torch.arange(R, device=DEV))
    ref = reference.verify(drafts, p_d, logits, lens, temp, seed=torch.arange(R, device=DEV))
    even = slice(0, None, 2)
    assert torch.equal(got.output_tokens[even], ref.output_tokens[even])
    odd = got.output_tokens[1::2]
    n = got.num_accepted[1::2]
    assert ((odd.gather(1, n.unsqueeze(1)) >= 0) & (odd.gather(1, n.unsqueeze(1)) < V)).all()


# --------------------------------------------------------------------------------------
# Sampling: distribution-identical, reproducible
# --------------------------------------------------------------------------------------
P_T = np.array([[0.50, 0.20, 0.20, 0.10], [0.05, 0.60, 0.25, 0.10], [0.25, 0.25, 0.25, 0.25]])
P_D = np.array([[0.25, 0.25, 0.40, 0.10], [0.10, 0.70, 0.00, 0.20]])


def _run_sampled(n: int, l: int, dtype: torch.dtype, temperature: float = 1.0, offset: int = 0):
    K, V = P_D.shape
    g = torch.Generator(device=DEV).manual_seed(7 + l)
    p_d = torch.tensor(P_D, dtype=torch.float32, device=DEV).expand(n, K, V).contiguous()
    drafts = torch.multinomial(p_d.reshape(-1, V), 1, generator=g).reshape(n, K)
    logits = (temperature * torch.tensor(P_T, device=DEV).log()).float().expand(n, K + 1, V).contiguous().to(dtype)
    return ops.verify(drafts, p_d, logits, torch.full((n,), l, device=DEV), torch.full((n,), temperature, device=DEV),
                      seed=torch.arange(n, device=DEV), offset=torch.full((n,), offset, device=DEV))


@pytest.mark.parametrize("l", [0, 1, 2])
def test_sampling_follows_the_enumerated_distribution(l: int) -> None:
    res = _run_sampled(40000, l, torch.float32)
    counts = Counter(tuple(r[:m]) for r, m in zip(res.output_tokens.tolist(), res.num_emitted.tolist()))
    assert chisquare_pvalue(counts, exact_verify_outcomes(P_T, P_D, l)) > 1e-4


def test_sampling_with_temperature_and_bf16_logits() -> None:
    res = _run_sampled(40000, 2, torch.bfloat16, temperature=0.7)
    counts = Counter(tuple(r[:m]) for r, m in zip(res.output_tokens.tolist(), res.num_emitted.tolist()))
    p_t = torch.softmax(torch.tensor(0.7 * np.log(P_T)).to(torch.bfloat16).double() / 0.7, -1).numpy()
    assert chisquare_pvalue(counts, exact_verify_outcomes(p_t, P_D, 2)) > 1e-4


def test_sampling_matches_the_reference_distribution_at_full_vocab() -> None:
    # V = 151936: a peaked target, a draft that disagrees; compare recovered / bonus tokens
    R, K, V = 4096, 1, 151936
    base = torch.full((V,), -30.0, device=DEV)
    base[[5, 77, 1000, 151935]] = torch.tensor([2.0, 1.5, 1.0, 0.5], device=DEV)
    logits = base.expand(R, K + 1, V).contiguous().to(torch.bfloat16)
    p_d = torch.zeros(R, K, V, device=DEV)
    p_d[..., 77] = 0.7
    p_d[..., 5] = 0.3
    drafts = torch.where(torch.rand(R, K, device=DEV) < 0.7, 77, 5)
    args = (drafts, p_d, logits, torch.ones(R, dtype=torch.long, device=DEV), torch.ones(R, device=DEV))
    got = ops.verify(*args, seed=torch.arange(R, device=DEV))
    ref = reference.verify(*args, seed=torch.arange(R, device=DEV))
    keys = sorted(set(map(tuple, got.output_tokens.tolist())) | set(map(tuple, ref.output_tokens.tolist())))
    c_got, c_ref = Counter(map(tuple, got.output_tokens.tolist())), Counter(map(tuple, ref.output_tokens.tolist()))
    table = np.array([[c_got[k] for k in keys], [c_ref[k] for k in keys]], dtype=float) + 0.5
    from scipy.stats import chi2_contingency

    assert chi2_contingency(table).pvalue > 1e-4
    assert set(got.output_tokens[:, 0].tolist()) <= {5, 77, 1000, 151935}


def test_missing_draft_probs_means_deterministic_drafts() -> None:
    n, K, V = 40000, 2, 4
    drafts = torch.tensor([[2, 1]], device=DEV).expand(n, K).contiguous()
    logits = torch.tensor(P_T, device=DEV).log().float().expand(n, K + 1, V).contiguous()
    res = ops.verify(drafts, None, logits, torch.full((n,), K, device=DEV), torch.ones(n, device=DEV),
                     seed=torch.arange(n, device=DEV))
    counts = Counter(tuple(r[:m]) for r, m in zip(res.output_tokens.tolist(), res.num_emitted.tolist()))
    one_hot = np.eye(V)[[2, 1]]
    assert chisquare_pvalue(counts, exact_verify_outcomes(P_T, one_hot, K)) > 1e-4


def test_fixed_seed_and_offset_reproduce_and_offsets_change_the_draw() -> None:
    a = _run_sampled(4096, 2, torch.float16, offset=3)
    b = _run_sampled(4096, 2, torch.float16, offset=3)
    c = _run_sampled(4096, 2, torch.float16, offset=4)
    assert torch.equal(a.output_tokens, b.output_tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.output_tokens, c.output_tokens)


def test_top_k_rows_are_computed_by_the_reference() -> None:
    R, K, V = 16, 3, 500
    g = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(R, K + 1, V, generator=g, device=DEV)
    p_d = torch.softmax(torch.randn(R, K, V, generator=g, device=DEV), -1)
    drafts = torch.multinomial(p_d.reshape(-1, V), 1, generator=g).reshape(R, K)
    top_k = torch.where(torch.arange(R, device=DEV) < 8, 20, 0)
    args = (drafts, p_d, logits, torch.full((R,), K, device=DEV), torch.ones(R, device=DEV))
    got = ops.verify(*args, top_k=top_k, seed=torch.arange(R, device=DEV))
    ref = reference.verify(*args, top_k=top_k, seed=torch.arange(R, device=DEV))
    assert torch.equal(got.output_tokens[:8], ref.output_tokens[:8])


# --------------------------------------------------------------------------------------
# Scheduler: bit-identical
# --------------------------------------------------------------------------------------
def _sps(n: int, seed: int, kind: str = "decay") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    B = torch.arange(n + 1, dtype=torch.float64)
    if kind == "flat":
        s = torch.ones(n + 1, dtype=torch.float64)
    elif kind == "steps":  # jagged, non-unimodal
        s = 1.0 / (1 + (B // 64)) + 0.05 * torch.rand(n + 1, generator=g, dtype=torch.float64)
    else:
        s = 1.0 / (1 + B / 400.0) * (1 + 0.02 * torch.rand(n + 1, generator=g, dtype=torch.float64))
    s[0] = 0
    return s


CONF_CASES = ["random", "ties", "zeros", "ones", "mixed"]


def _conf(R: int, K: int, case: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if case == "random":
        c = torch.rand(R, K, generator=g, dtype=torch.float64)
    elif case == "ties":
        c = torch.full((R, K), 0.75, dtype=torch.float64)
    elif case == "zeros":
        c = torch.zeros(R, K, dtype=torch.float64)
    elif case == "ones":
        c = torch.ones(R, K, dtype=torch.float64)
    else:
        c = torch.rand(R, K, generator=g, dtype=torch.float64)
        c[torch.rand(R, K, generator=g) < 0.2] = 0.0
        c[torch.rand(R, K, generator=g) < 0.2] = 1.0
        c[torch.rand(R, K, generator=g) < 0.1] = 0.5
    return c.to(dtype).to(DEV)


@pytest.mark.parametrize("case", CONF_CASES)
@pytest.mark.parametrize("R,K", [(1, 7), (3, 1), (100, 7), (1024, 7), (1024, 15), (300, 15)])
@pytest.mark.parametrize("kind", ["decay", "flat", "steps"])
def test_scheduler_is_bit_identical(case: str, R: int, K: int, kind: str) -> None:
    for dtype in (torch.float32, torch.float64):
        conf = _conf(R, K, case, seed=R + K, dtype=dtype)
        sps = _sps(R * (K + 1) + 3, seed=R, kind=kind)
        for early in (True, False):
            got = ops.schedule_prefix(conf, sps, None, early)
            ref = reference.schedule_prefix(conf, sps, None, early)
            assert torch.equal(got.cpu(), ref.cpu()), (case, R, K, kind, dtype, early)


def test_scheduler_with_caps_and_a_short_table() -> None:
    R, K = 200, 7
    conf = _conf(R, K, "mixed", 1, torch.float32)
    caps = torch.randint(-1, K + 2, (R,), device=DEV)
    for n in (R - 1, R, R + 5, R * 3):
        sps = _sps(n, seed=n)
        assert torch.equal(ops.schedule_prefix(conf, sps, caps).cpu(), reference.schedule_prefix(conf, sps, caps).cpu())


def test_compiled_scheduler_takes_exactly_the_contracts_candidates() -> None:
    """The kernel's R*K limit is contract.py's: R*K = limit runs, one more candidate is refused."""
    from dspark.plugins.contract import SCHEDULE_MAX_CANDIDATES

    K = 8
    R = SCHEDULE_MAX_CANDIDATES // K
    sps = _sps(R * (K + 1) + 3, seed=0).to(DEV)
    conf = _conf(R, K, "mixed", 2, torch.float32)
    assert torch.equal(torch.ops.dspark.schedule_prefix(conf, sps, None, True).cpu(),
                       reference.schedule_prefix(conf, sps.cpu(), None, True).cpu())
    over = _conf(R + 1, K, "mixed", 3, torch.float32)
    with pytest.raises(RuntimeError, match=f"exceeds the scheduler kernel's {SCHEDULE_MAX_CANDIDATES} candidates"):
        torch.ops.dspark.schedule_prefix(over, sps, None, True)


def test_appendix_a_on_the_gpu() -> None:
    sps = torch.tensor([0.0, 1.0, 0.5, 0.45], dtype=torch.float64)
    for c2, early, want in [(0.9, True, 0), (0.0, True, 0), (0.9, False, 2), (0.0, False, 0)]:
        conf = torch.tensor([[0.8, c2]], device=DEV)
        assert ops.schedule_prefix(conf, sps, early_stop=early).tolist() == [want]
