"""atb_ops.linear(..., out_dtype=torch.float32): the float32-compute form of DeepSeek-V4's head and compressor
projections (a 16-bit input upcast exactly, float32 result). The reference runs linear(x.float(), ...); the CUDA
backend multiplies the BF16 input by the BF16-stored weight in one cuBLAS GEMM with a float32 output (the products
are exact in float32) -- on a GPU; under Triton's interpreter it takes the upcast path."""

from __future__ import annotations

import pytest
import torch

import atb_ops
from parallel.linear import Linear, stack_linears_, stacked_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16().to(DEV), torch.randn(n, k, generator=g).bfloat16().to(DEV))


def test_reference_is_the_upcast_then_the_op():
    x, w = _data(5, 64, 24)
    x, w = x.cpu(), w.cpu()
    got = atb_ops.linear(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, atb_ops.linear(x.float(), w))
    assert atb_ops.linear(x.float(), w, out_dtype=torch.float32).dtype == torch.float32  # float32 x: as is
    with pytest.raises(ValueError, match="out_dtype torch.float16 is not supported"):
        atb_ops.linear(x, w, out_dtype=torch.float16)


@pytest.mark.parametrize("m", [1, 8, 37])
def test_cuda_form_matches_the_float32_reference(m):
    pytest.importorskip("triton")
    fused = atb_ops.implementations("linear")["cuda"].float32_from_16bit
    x, w = _data(m, 256, 96, seed=m)
    got = fused(x, w)
    ref = x.double().cpu() @ w.double().cpu().t()  # the float32 products are exact: float32 sums vs float64
    assert got.dtype == torch.float32 and got.shape == (m, 96)
    assert float((got.double().cpu() - ref).norm() / ref.norm()) < 1e-6
    x3 = x.view(1, m, 256)  # leading dims kept
    assert fused(x3, w).shape == (1, m, 96)


def test_compute_fp32_linear_passes_its_input_as_is_and_gets_float32():
    lin = Linear(64, 16, torch.float32, compute_fp32=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 64).bfloat16().float())
    x = torch.randn(3, 64).bfloat16()
    assert lin.prepare_input(x) is x
    y = lin(x)
    assert y.dtype == torch.float32 and torch.equal(y, x.float() @ lin.weight.t())
    other = Linear(64, 8, torch.float32, compute_fp32=True)
    assert stack_linears_([lin, other])
    a, b = stacked_linear((lin, other), x)
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a, y)
