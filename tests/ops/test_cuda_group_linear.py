"""CUDA group_linear (one strided-batched GEMM writing the token-major output in place) against the reference
einsum: random shapes, a transposed-view weight, no tokens, mixed dtypes (the reference's float32 path)."""

import pytest
import torch

from atb_ops.cuda.group_linear import group_linear
from atb_ops.reference.linear import group_linear as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("t,g,k,n,transposed", [(5, 3, 16, 8, False), (1, 8, 64, 32, True), (0, 4, 16, 8, False),
                                                (33, 2, 48, 24, True)])
def test_group_linear_matches_the_reference(t, g, k, n, transposed):
    gen = torch.Generator().manual_seed(t + g + k)
    x = torch.randn(t, g, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(g, k, n, generator=gen).to(torch.bfloat16).transpose(1, 2) if transposed else \
        torch.randn(g, n, k, generator=gen).to(torch.bfloat16)
    got = group_linear(x.to(DEV), w.to(DEV))
    assert got.shape == (t, g, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = reference(x, w)
    if DEV == "cpu":  # the same CPU bmm over the same operands
        assert torch.equal(got, want)
    else:  # cuBLAS may pick another kernel for the strided output: float32 accumulation either way
        assert torch.allclose(got.cpu().float(), want.float(), rtol=2**-7, atol=1e-3)


def test_group_linear_mixed_dtypes_take_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 16, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 8, 16, generator=gen)
    assert torch.equal(group_linear(x, w), reference(x, w))
