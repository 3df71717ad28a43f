"""The float16-MMA FP4 MoE kernel (atb_ops/cuda/fp4_moe_f16.py, built by NVRTC on the GPU): its own cases, and its
activation scaling (Triton: on the CPU through the interpreter). The cases it shares with fp4_moe_mma.py (random
tiles, split K and passes, DeepSeek-V4 shapes, CUDA-graph replay) are in test_fp4_moe_mma.py (``kind="f16"``).

Kernel cases run on the GPU (``cuda``): every output within one bfloat16 rounding (plus float32 summation noise) of
the exact float64 product (``check_close``); edge cases: one row, experts with no rows, ids outside [0, E) (zeros)
as int32, every byte value of the weights, scale bytes 1 .. 254 (the kernel's range: 0 and 255 are not taken), a
block of zeros, activations spread over 2^-60 .. 2^60, activations already rounded to FP8 (the
``numerics="reference"`` input).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import fp4_moe_f16 as ff  # noqa: E402

from test_fp4_moe_mma import _built, check_edge_rows  # noqa: E402
from test_gemm_decode import check_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("scale", [1.0, 2.0**-40, 2.0**60])
def test_scale_act_exact(scale):
    """x = natural_order(y) * s exactly for bfloat16 x (blocks with a wide spread of magnitudes, a zero block, a
    block with one nonzero value); s a power of two per 128-block, |y| <= 2^15 and its largest > 2^14 (2^14 folded
    into the stored scale); y in the kernel's K order (the inverse permutation restores x)."""
    g = torch.Generator().manual_seed(71)
    x = torch.randn(5, 768, generator=g) * torch.exp2(torch.randint(-12, 12, (5, 768), generator=g).float()) * scale
    x[1, 128:256] = 0
    x[2, 256:384] = 0
    x[2, 300] = -3.0 * scale
    x = x.to(DEV, torch.bfloat16)
    y, s = ff.scale_act(x)
    assert y.dtype == torch.float16 and s.dtype == torch.float32 and s.shape == (5, 6)
    s = s / 2.0**14
    assert bool((torch.frexp(s)[0] == 0.5).all())  # powers of two
    yn = ff.natural_order(y).float().view(5, 6, 128)
    back = (yn * s.unsqueeze(-1)).view(5, 768)
    assert torch.equal(back, x.float())
    amax = yn.abs().amax(-1)
    nz = x.float().view(5, 6, 128).abs().amax(-1) > 0
    assert bool((amax[nz] > 2.0**14).all() and (amax <= 2.0**15).all())
    assert float(s[1, 1]) == 1.0  # a zero block: scale 1
    # the permutation: code 32 j + 8 c + r at c * 64 + j * 8 + 2 (r % 4) + r // 4 within each 256
    ramp = torch.arange(256, dtype=torch.float32).to(DEV, torch.bfloat16).view(1, 256)
    yr, sr = ff.scale_act(ramp)
    k = torch.arange(256)
    r = k % 8
    pos = (k // 8 % 4) * 64 + (k // 32) * 8 + 2 * (r % 4) + r // 4
    at = yr.float().cpu()[0, pos] * sr.cpu()[0, k // 128] / 2.0**14  # code k's value, read where it should lie
    assert torch.equal(at, k.float())


def test_scale_act_rejects_k():
    with pytest.raises(ValueError, match="K = 384 is not a multiple of 256"):
        ff.scale_act(torch.zeros(2, 384, dtype=torch.bfloat16, device=DEV))


def test_scales_ok_range():
    """Scale bytes 1 .. 254 only (0: the kernel's scale would be 0 instead of 2^-127; 255: E8M0 NaN); the answer is
    cached per tensor and version (an in-place change is seen)."""
    s = torch.full((2, 256, 8), 127, dtype=torch.uint8, device=DEV)
    s[0, 0, 0], s[1, 1, 1] = 1, 254
    assert ff.scales_ok(s)
    for bad in (0, 255):
        s2 = s.clone()
        s2[1, 3, 2] = bad
        assert not ff.scales_ok(s2)
    s[0, 5, 5] = 0
    assert not ff.scales_ok(s)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", ["nt=1", "nt=2", "nt=1,mt=2"])
def test_fp4_moe_f16_edge_cases(cfg, monkeypatch):
    """M = 0, one row, ids outside [0, E) (zeros) as int32, every byte value of the weights, scale bytes 1 .. 254,
    a zero block, activations spread over 2^-60 .. 2^60 (each block scaled on its own), and x rounded to FP8 per
    128 first (what the model passes in reference numerics)."""
    _built("f16")
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", cfg)
    g = torch.Generator().manual_seed(63)
    wq, sq, x, ids2, k = check_edge_rows(ff, [1, 2, 60, 100, 120, 126, 127, 128, 129, 140, 150], g, zero_block=True)
    spread = torch.exp2(torch.randint(-60, 61, (9, k // 128), generator=g).float()).repeat_interleave(128, 1)
    x2 = (torch.randn(9, k, generator=g) * spread).to(DEV, torch.bfloat16)
    check_close(ff.grouped_matmul(x2, wq, ids2, sq), x2, wq, sq, "fp4", ids2)
    x3 = atb_ops.fp8_act_round(torch.randn(9, k, generator=g).to(DEV, torch.bfloat16), 128)
    check_close(ff.grouped_matmul(x3, wq, ids2, sq), x3, wq, sq, "fp4", ids2)


