"""cpu_linear.linear: the CPU inference form of ``x @ W^T + b`` must be the same product as F.linear."""
import pytest
import torch
import torch.nn.functional as F

from dspark.training import cpu_linear
from dspark.training.cpu_linear import linear


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (1, 1, 7, 48)])
def test_matches_linear_without_grad(shape):
    torch.manual_seed(0)
    w, x = torch.randn(1000, 48), torch.randn(*shape)
    with torch.no_grad():
        got = linear(x, w)
    assert got.shape == (*shape[:-1], 1000)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_trainable_inputs_keep_linear_and_its_gradient():
    torch.manual_seed(0)
    w = torch.randn(300, 16)
    x = torch.randn(4, 16, requires_grad=True)
    linear(x, w).square().sum().backward()
    g = x.grad.clone()
    x.grad = None
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=0)


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_LINEAR", raising=False)
    cpu_linear.reset_choices()
    yield
    cpu_linear.reset_choices()


def _measure(plain: float, transposed: float, rows: int = 3) -> bool | None:
    """Run linear() until the shape's choice is made, with each form costing the given seconds."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 16), torch.randn(rows, 16)
    timed: list[str] = []
    forms = {"plain": plain, "transposed": transposed}
    real_plain, real_transposed = cpu_linear.F.linear, cpu_linear.transposed_linear
    clock = {"now": 0.0, "pending": None}

    def timer():
        if clock["pending"] is not None:
            clock["now"] += forms[clock["pending"]]
            clock["pending"] = None
        return clock["now"]

    def plain_fn(*a, **k):
        clock["pending"] = "plain"
        timed.append("plain")
        return real_plain(*a, **k)

    def transposed_fn(*a, **k):
        clock["pending"] = "transposed"
        timed.append("transposed")
        return real_transposed(*a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_linear.F, "linear", plain_fn)
        mp.setattr(cpu_linear, "transposed_linear", transposed_fn)
        with torch.no_grad():
            for _ in range(2 * cpu_linear.TRIALS):
                assert cpu_linear.transposed_pays(rows, 16, 64) is None
                torch.testing.assert_close(cpu_linear.linear(x, w, timer=timer), real_plain(x, w))
    assert timed == ["plain", "transposed"] * cpu_linear.TRIALS  # the forms alternate
    return cpu_linear.transposed_pays(rows, 16, 64)


def test_the_faster_form_is_chosen_per_shape_after_timed_trials(fresh_choices):
    assert _measure(plain=2.0, transposed=1.0) is True
    assert cpu_linear.transposed_pays(4, 16, 64) is True  # 3 and 4 rows share a bucket
    assert cpu_linear.transposed_pays(2, 16, 64) is None  # other buckets are measured on their own
    cpu_linear.reset_choices()
    assert _measure(plain=1.0, transposed=2.0) is False
    cpu_linear.reset_choices()
    assert _measure(plain=1.05, transposed=1.0) is False  # within the margin: F.linear stays


def test_an_environment_variable_fixes_the_choice(monkeypatch, fresh_choices):
    w, x = torch.randn(64, 16), torch.randn(3, 16)
    for mode in ("flinear", "transposed"):
        monkeypatch.setenv("DSPARK_CPU_LINEAR", mode)
        with torch.no_grad():
            torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert cpu_linear.transposed_pays(3, 16, 64) is None  # nothing measured
    monkeypatch.setenv("DSPARK_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="DSPARK_CPU_LINEAR"):
        cpu_linear.linear(x, w)
