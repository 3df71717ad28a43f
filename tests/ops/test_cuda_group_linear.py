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


@pytest.mark.parametrize("float_scale", [False, True])
@pytest.mark.parametrize("t,g", [(1, 8), (5, 2), (8, 1), (9, 4), (24, 3), (33, 2), (0, 2)])
def test_group_linear_fp8_matches_the_reference(t, g, float_scale):
    """FP8 weights (e4m3 [G, N, K], 128 x 128 block scales): up to 32 tokens the fp8_gemv kernel over every group in
    one launch (E8M0), more tokens the weight dequantised to BF16 for the batched GEMM (E8M0) or the reference (float32
    scales), on the CPU the reference; every path within the BF16 output's rounding of the reference op, which is
    the op over the dequantised BF16 matrix."""
    from quant.fp8_block import quant_fp8_block

    gen = torch.Generator().manual_seed(t + 7 * g)
    x = torch.randn(t, g, 384, generator=gen).to(torch.bfloat16)
    q, s = quant_fp8_block(torch.randn(g, 256, 384, generator=gen) * 0.1, scale_fmt=None if float_scale else "ue8m0")
    got = group_linear(x.to(DEV), q.to(DEV), s.to(DEV), "fp8_block")
    assert got.shape == (t, g, 256) and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = reference(x, q, s, "fp8_block")
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got.cpu().float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.cuda
def test_group_linear_fp8_takes_the_gemv_kernel_up_to_32_tokens(monkeypatch):
    from atb_ops.cuda import fp8_gemv
    from quant.fp8_block import quant_fp8_block

    calls = []
    real = fp8_gemv.group_linear
    monkeypatch.setattr(fp8_gemv, "group_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    q, s = quant_fp8_block(torch.randn(8, 1024, 512, device="cuda") * 0.1)
    for t in (1, 8, 9, 32, 33):
        group_linear(torch.randn(t, 8, 512, device="cuda").to(torch.bfloat16), q, s, "fp8_block")
    assert calls == [1, 8, 9, 32]
