"""cpu_linear.linear: the CPU inference form of ``x @ W^T + b`` must be the same product as F.linear."""
import pytest
import torch
import torch.nn.functional as F

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
