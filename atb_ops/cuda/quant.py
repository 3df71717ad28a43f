"""Triton FP8-e4m3 / FP4-e2m1 activation rounding (quantise -> dequantise), as :func:`atb_ops.fp8_act_round`
and :func:`atb_ops.fp4_act_round`: per block of the last dim, amax -> power-of-two (UE8M0) scale through the
exponent bits, scaled values clamped and rounded to nearest-even on the format's grid, multiplied back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import pdl, pdl_wait

FP8_MAX = 448.0
FP4_MAX = 6.0


@triton.jit
def _pow2_ceil(v):
    """2^ceil(log2(v)) for positive normal float32 v, from the exponent and mantissa bits."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    """Nearest FP8-e4m3 value of v in [-448, 448], ties to even, subnormals included (step 2^-9 below 2^-6).

    Written out in float32 arithmetic (the exponent from the bits, round-to-nearest-even through the 1.5 * 2^23
    trick) so that the CPU interpreter and the GPU give the same bits as torch's float8_e4m3fn cast."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = v / step
    return ((y + 12582912.0) - 12582912.0) * step


@triton.jit
def _round_fp4(v):
    """Nearest e2m1 value of v in [-6, 6], ties to the even code (0, 1, 2, 4 and 6 are even codes)."""
    a = tl.abs(v)
    mag = tl.where(a <= 0.25, 0.0,
          tl.where(a < 0.75, 0.5,
          tl.where(a <= 1.25, 1.0,
          tl.where(a < 1.75, 1.5,
          tl.where(a <= 2.5, 2.0,
          tl.where(a < 3.5, 3.0,
          tl.where(a <= 5.0, 4.0, 6.0)))))))
    return tl.where(v < 0, -mag, mag)


@triton.jit
def _act_round_kernel(x_ptr, y_ptr, n_blocks, amax_min, inv_max, FMT: tl.constexpr, BLOCK: tl.constexpr,
                      BR: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (b < n_blocks)[:, None]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), amax_min)
    s = _pow2_ceil(amax * inv_max)[:, None]
    if FMT == 8:
        q = _round_e4m3(tl.minimum(tl.maximum(x / s, -448.0), 448.0))
    else:
        q = _round_fp4(tl.minimum(tl.maximum(x / s, -6.0), 6.0))
    tl.store(y_ptr + offs, (q * s).to(y_ptr.dtype.element_ty), mask=m)


def _act_round(x: torch.Tensor, block: int, fmt: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    if block & (block - 1):
        raise ValueError(f"the CUDA activation rounding needs a power-of-two block, got {block}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n_blocks = xc.numel() // block
    if n_blocks:
        br = max(1, 2048 // block)
        amax_min, inv_max = (1e-4, 1.0 / FP8_MAX) if fmt == 8 else (FP4_MAX * 2.0**-126, 1.0 / FP4_MAX)
        _act_round_kernel[(triton.cdiv(n_blocks, br),)](xc, y, n_blocks, amax_min, inv_max, FMT=fmt, BLOCK=block,
                                                        BR=br, num_warps=4, **pdl())
    return y


@register("fp8_act_round", "cuda")
def fp8_act_round(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    return _act_round(x, block, 8)


@register("fp4_act_round", "cuda")
def fp4_act_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _act_round(x, block, 4)
