"""cpu_gemm: the packed CPU product agrees with F.linear, and each output row is the same bits
whatever else is in the call (row count, tile position, k blocks, thread count)."""
import pytest
import torch
import torch.nn.functional as F

from dspark.training import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no AVX-512 or no C++ toolchain here")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 130])
@pytest.mark.parametrize("n, k", [(1, 16), (7, 33), (64, 1), (65, 576), (130, 15), (1000, 48), (40, 800)])
def test_agrees_with_f_linear(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = cpu_gemm.pack(w)
    width = p.data.shape[2]  # the kernel's panel: 64 columns with AVX-512, 32 with AVX2
    assert width in (32, 64) and p.data.shape[:2] == ((n + width - 1) // width, k) and p.n == n
    tol = dict(rtol=1e-5, atol=2e-6 * k ** 0.5)
    torch.testing.assert_close(cpu_gemm.gemm(x, p), F.linear(x, w), **tol)
    torch.testing.assert_close(cpu_gemm.gemm(x, p, b), F.linear(x, w, b), **tol)


@pytest.mark.parametrize("n, k", [(49, 576), (130, 1537), (9, 7), (200, 800)])
def test_a_row_is_the_same_bits_in_any_batch(n, k):
    """800 and 1537 span several k blocks: the partial sums carried between them are exact."""
    g = torch.Generator().manual_seed(n + k)
    x, b = torch.randn(80, k, generator=g), torch.randn(n, generator=g)
    w = cpu_gemm.pack(torch.randn(n, k, generator=g))
    alone = torch.cat([cpu_gemm.gemm(x[i:i + 1], w, b) for i in range(80)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 11, 16, 33, 64, 80):  # every tile shape and position
        for start in (0, 80 - rows):
            got = cpu_gemm.gemm(x[start:start + rows], w, b)
            assert torch.equal(got, alone[start:start + rows]), f"{rows} rows from {start}: a row changed"


def test_the_thread_count_does_not_change_a_bit():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 200, generator=g), cpu_gemm.pack(torch.randn(3000, 200, generator=g))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.gemm(x, w)
        torch.set_num_threads(2)
        two = cpu_gemm.gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_strided_input_is_read_as_its_values_and_bad_input_is_refused():
    x, w = torch.randn(4, 32), torch.randn(10, 32)
    p = cpu_gemm.pack(w)
    torch.testing.assert_close(cpu_gemm.gemm(x.t().contiguous().t(), p), F.linear(x, w))
    torch.testing.assert_close(cpu_gemm.gemm(x, cpu_gemm.pack(w.t().contiguous().t())), F.linear(x, w))
    with pytest.raises(RuntimeError, match="same K and n columns"):
        cpu_gemm.gemm(torch.randn(4, 31), p)
    with pytest.raises(RuntimeError, match="same K and n columns"):
        cpu_gemm.gemm(x, cpu_gemm.PackedWeight(p.data, 100))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_gemm.gemm(x.double(), p)
    assert cpu_gemm.gemm(torch.randn(0, 32), p).shape == (0, 10)
