"""small_gemm: the CPU small-row product agrees with F.linear, and each output row is the same
bits whatever else is in the call (row count, tile position, thread count)."""
import pytest
import torch
import torch.nn.functional as F

from dspark.training import small_gemm

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="no AVX-512 / AVX2+FMA or no C++ toolchain here")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n, k", [(1, 16), (7, 33), (37, 576), (130, 15), (1000, 48)])
def test_agrees_with_f_linear(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(small_gemm.small_gemm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(small_gemm.small_gemm(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("n, k", [(49, 576), (130, 1537), (9, 7)])
def test_a_row_is_the_same_bits_in_any_batch(n, k):
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(64, k, generator=g), torch.randn(n, k, generator=g)
    alone = torch.cat([small_gemm.small_gemm(x[i:i + 1], w) for i in range(64)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 11, 16, 33, 64):  # every tile shape and position
        for start in (0, 64 - rows):
            got = small_gemm.small_gemm(x[start:start + rows], w)
            assert torch.equal(got, alone[start:start + rows]), f"{rows} rows from {start}: a row changed"


def test_the_thread_count_does_not_change_a_bit():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 200, generator=g), torch.randn(3000, 200, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm.small_gemm(x, w)
        torch.set_num_threads(2)
        two = small_gemm.small_gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_strided_input_is_read_as_its_values_and_bad_input_is_refused():
    x, w = torch.randn(4, 32), torch.randn(10, 32)
    torch.testing.assert_close(small_gemm.small_gemm(x.t().contiguous().t(), w), F.linear(x, w))
    with pytest.raises(RuntimeError, match="x \\[M, K\\], w \\[N, K\\]"):
        small_gemm.small_gemm(torch.randn(4, 31), w)
    with pytest.raises(RuntimeError, match="float32"):
        small_gemm.small_gemm(x.double(), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        small_gemm.small_gemm(x, torch.randn(32, 10).t())
