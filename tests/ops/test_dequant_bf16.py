"""FP8-block weights (E8M0 scales) dequantised to bfloat16 by atb_ops/cuda/dequant_bf16.py, and the linear path
that then calls cuBLAS (prefill-sized fp8 linears, atb_ops/cuda/gemm.py). Triton's interpreter on the CPU, the GPU
where there is one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import dequant_bf16, gemm  # noqa: E402
from quant.fp8_block import dequant_fp8_block, quant_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, g, scale_fmt="ue8m0"):
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)  # blocks of very different magnitudes
    q, s = quant_fp8_block(w, scale_fmt=scale_fmt)
    return q.to(DEV), s.to(DEV)


@pytest.mark.parametrize("n,k", [(200, 384), (128, 256), (1, 130), (0, 128)])
def test_dequant_fp8_bf16_is_exact(n, k):
    """Every element equals quant's float32 dequantisation (representable in bfloat16: e4m3 x 2^k), edge tiles,
    a partial scale block and an empty weight included; the e4m3 extremes and zeros are in the data."""
    g = torch.Generator().manual_seed(41)
    q, s = _weight(n, k, g)
    if n:
        q[0, :4] = torch.tensor([448.0, -448.0, 0.0, 2.0**-9]).to(torch.float8_e4m3fn)  # max, min, zero, subnormal
    got = dequant_bf16.dequant_fp8_bf16(q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    want = dequant_fp8_block(q.cpu(), s.cpu(), dtype=torch.float32)
    assert torch.equal(got.float().cpu(), want)


def test_eligible_only_e8m0():
    g = torch.Generator().manual_seed(42)
    q, s = _weight(128, 128, g)
    assert dequant_bf16.eligible(q, s)
    q32, s32 = _weight(128, 128, g, scale_fmt=None)
    assert s32.dtype == torch.float32 and not dequant_bf16.eligible(q32, s32)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_linear_dq_path(scale_fmt, monkeypatch):
    """Rows at or past DQ_LINEAR_ROWS: dequantise + matmul with E8M0 scales (the tiled kernel with float32 ones);
    within the existing tolerance of the reference op either way, and the dq result equals bf16 x @ W^T."""
    monkeypatch.setattr(gemm, "DQ_LINEAR_ROWS", 16)
    g = torch.Generator().manual_seed(43)
    q, s = _weight(200, 384, g, scale_fmt)
    x = torch.randn(70, 384, generator=g).to(DEV, torch.bfloat16)
    calls = []
    real = dequant_bf16.dequant_fp8_bf16
    monkeypatch.setattr(dequant_bf16, "dequant_fp8_bf16", lambda *a: calls.append(1) or real(*a))
    got = atb_ops.implementations("linear")["cuda"](x, q, s, "fp8_block")
    assert len(calls) == (1 if scale_fmt else 0)
    ref = atb_ops.implementations("linear")["reference"](x, q, s, "fp8_block")
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    if scale_fmt:
        w = dequant_fp8_block(q.cpu(), s.cpu(), dtype=torch.float32).to(DEV, torch.bfloat16)
        assert torch.equal(got, x @ w.t())
    calls.clear()
    monkeypatch.setattr(gemm, "DQ_LINEAR_ROWS", 1024)  # below the threshold: the tiled kernel
    atb_ops.implementations("linear")["cuda"](x, q, s, "fp8_block")
    assert not calls


def test_dq_rows_env(monkeypatch):
    """ATB_CUDA_DQ_ROWS sets the threshold at each call; a bad value names the variable."""
    monkeypatch.delenv("ATB_CUDA_DQ_ROWS", raising=False)
    assert gemm.dq_rows() == gemm.DQ_LINEAR_ROWS
    monkeypatch.setenv("ATB_CUDA_DQ_ROWS", "512")
    assert gemm.dq_rows() == 512
    for bad in ("0", "-3", "many", "1.5"):
        monkeypatch.setenv("ATB_CUDA_DQ_ROWS", bad)
        with pytest.raises(ValueError, match="ATB_CUDA_DQ_ROWS"):
            gemm.dq_rows()
