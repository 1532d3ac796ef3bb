"""The CPU choice kernels (plugins/cpu_choice.py) pick what torch picks: the argmax and the race's winner."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dspark.plugins import coupled, cpu_choice

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not cpu_choice.available(), reason="no C++ toolchain for the CPU choice kernels")


def _torch_race(probs: torch.Tensor, key: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor | None,
                monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(cpu_choice, "available", lambda: False)
        return coupled.race_sample(probs, key, pos, ids)


def _rows(g: torch.Generator, n: int, V: int) -> torch.Tensor:
    """Sampling distributions of every shape a verify step meets: flat, peaked, top-k cut, one
    token, no mass at all."""
    scale = torch.rand(n, 1, generator=g) * 12.0 + 0.2
    probs = torch.softmax(torch.randn(n, V, generator=g) * scale, -1)
    probs[1, :] = 0.0
    probs[2, V // 2:] = 0.0  # mass on the first half only (a top-k cut)
    probs[3] = 0.0
    probs[3, V - 1] = 1.0  # a point mass on the last column
    probs[4] = probs[4] * (torch.rand(V, generator=g) < 0.01)  # a sparse top-p-like support
    return probs


@pytest.mark.parametrize("V", [49_152, 1_000, 7])
def test_the_kernel_picks_the_torch_race_winner_on_every_row(V, monkeypatch):
    g = torch.Generator().manual_seed(V)
    n = 200
    probs = _rows(g, n, V)
    key, pos = torch.randint(0, 2**62, (n,), generator=g), torch.randint(0, 8192, (n,), generator=g)
    got = coupled.race_sample(probs, key, pos)
    want = _torch_race(probs, key, pos, None, monkeypatch)
    assert torch.equal(got, want)
    assert int(got[1]) == 0, "a row without mass takes column 0, as torch.argmax of zeros"
    assert int(got[3]) == V - 1


def test_the_kernel_races_columns_under_their_own_token_ids(monkeypatch):
    """A drafter's vocabulary subset: column c carries the noise of token ``ids[c]``."""
    g = torch.Generator().manual_seed(3)
    n, N = 300, 2_048
    probs = torch.softmax(torch.randn(n, N, generator=g) * 2.0, -1)
    ids = torch.randperm(49_152, generator=g)[:N]
    key, pos = torch.randint(0, 2**40, (n,), generator=g), torch.randint(0, 4096, (n,), generator=g)
    assert torch.equal(coupled.race_sample(probs, key, pos, ids), _torch_race(probs, key, pos, ids, monkeypatch))
    shuffled = coupled.race_sample(probs, key, pos, ids.flip(0))
    assert not torch.equal(shuffled, coupled.race_sample(probs, key, pos, ids)), "ids must select the noise"


def test_bad_shapes_are_refused_in_one_line():
    keys = coupled._row_keys(torch.arange(2), torch.arange(2))
    idm = coupled._id_mix(None, 5, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="mixed ids must be"):
        cpu_choice.race_argmax(torch.rand(2, 6), keys, idm)
    with pytest.raises(RuntimeError, match="keys must be"):
        cpu_choice.race_argmax(torch.rand(3, 5), keys, idm)


@pytest.mark.parametrize("V", [49_152, 17, 1])
def test_the_argmax_kernel_is_torch_argmax_ties_and_nans_included(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(40, V, generator=g)
    x[1] = 0.0  # all tied: the first column
    x[2, V // 2] = float("inf")
    x[3, V - 1] = float("nan")  # NaN counts as largest
    x[4, V // 3] = float("nan")
    x[4, V - 1] = float("nan")  # the first NaN wins
    x[5] = float("-inf")
    x[6, : V // 2] = 5.0  # a tie between many columns: the first
    for rows in (x, x.to(torch.bfloat16).float()):
        assert torch.equal(cpu_choice.argmax(rows), rows.argmax(-1))


def test_greedy_cells_of_the_packed_rule_use_the_kernel_and_agree_with_torch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([0, 3, 1])
    logits = torch.randn(int((lens + 1).sum()), 500, generator=g)
    drafts = torch.randint(0, 500, (3, 3), generator=g)
    temps = torch.tensor([0.0, 0.0, 0.8])
    calls = []
    real = cpu_choice.argmax
    monkeypatch.setattr(cpu_choice, "argmax", lambda x: calls.append(x.shape) or real(x))
    got = coupled.verify_coupled_packed(drafts, logits, lens, temps, seed=torch.tensor([1, 2, 3]))
    assert calls, "greedy cells go through the kernel"
    monkeypatch.setattr(cpu_choice, "available", lambda: False)
    want = coupled.verify_coupled_packed(drafts, logits, lens, temps, seed=torch.tensor([1, 2, 3]))
    assert torch.equal(got.output_tokens, want.output_tokens)
    assert torch.equal(got.num_accepted, want.num_accepted)


def test_the_benchmark_compares_both_sides_on_the_same_tokens_and_writes_its_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("_bench_cpu_choice", ROOT / "scripts" / "bench_cpu_choice.py")
    bench_cpu_choice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cpu_choice)
    records = bench_cpu_choice.run([(2, 1, 1.0), (2, 0, 0.0)], rounds=2, iters=1)
    assert [r["same_tokens"] for r in records] == [True, True]
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["speedup"] > 0 for r in records)
    bench_cpu_choice.write(records, tmp_path, 2, "python scripts/bench_cpu_choice.py")
    md = (tmp_path / "cpu_choice.md").read_text()
    assert "| 2 | 1 | 1 |" in md and "| 2 | 0 | 0 |" in md
    assert (tmp_path / "cpu_choice.json").exists()
