"""cpu_linear.linear: the CPU inference form of ``x @ W^T + b`` must be the same product as F.linear."""
import pytest
import torch
import torch.nn.functional as F

from dspark.training import cpu_gemm, cpu_linear
from dspark.training.cpu_linear import linear


@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (1, 1, 7, 48)])
def test_matches_linear_without_grad(shape):
    torch.manual_seed(0)
    w, x, b = torch.randn(1000, 48), torch.randn(*shape), torch.randn(1000)
    with torch.no_grad():
        got, got_b = linear(x, w), linear(x, w, b)
    assert got.shape == (*shape[:-1], 1000)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_b, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_trainable_inputs_keep_linear_and_its_gradient():
    torch.manual_seed(0)
    w = torch.randn(300, 16)
    x = torch.randn(4, 16, requires_grad=True)
    assert not cpu_linear.uses_kernel(x, w)
    linear(x, w).square().sum().backward()
    g = x.grad.clone()
    x.grad = None
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=0, atol=0)


@pytest.mark.skipif(not cpu_gemm.available(), reason="no AVX-512 or no C++ toolchain here")
def test_inference_runs_on_the_kernel_with_one_packed_copy_per_weight_kept_current(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_LINEAR", raising=False)
    w = torch.randn(64, 32)
    with torch.no_grad():
        assert cpu_linear.uses_kernel(torch.randn(500, 32), w)
        assert not cpu_linear.uses_kernel(torch.randn(3, 32, dtype=torch.bfloat16), w.bfloat16())
        x = torch.randn(5, 32)
        assert torch.equal(linear(x, w), cpu_gemm.gemm(x, cpu_gemm.pack(w)))
        assert cpu_linear.packed(w) is cpu_linear.packed(w)  # packed once
        w.mul_(2)  # an in-place change (an optimizer step) is seen: the weight is packed again
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    key = id(w)
    del w
    assert key not in cpu_linear._packed  # the packed copy goes with its weight


def test_flinear_mode_is_plain_f_linear_and_a_bad_mode_is_refused(monkeypatch):
    w, x = torch.randn(64, 16), torch.randn(3, 16)
    monkeypatch.setenv("DSPARK_CPU_LINEAR", "flinear")
    with torch.no_grad():
        assert not cpu_linear.uses_kernel(x, w)
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    monkeypatch.setenv("DSPARK_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="DSPARK_CPU_LINEAR"):
        cpu_linear.linear(x, w)
