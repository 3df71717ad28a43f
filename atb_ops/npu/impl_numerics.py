"""``fp8_act_round`` / ``fp4_act_round`` composed on the device without FP8/FP4 dtypes (Atlas A2/A3 have none).

Only ``numerics="reference"`` calls them (reproducing the official DeepSeek-V4 activation rounding). A value
``v`` (already divided by its power-of-two block scale and clamped to the format's range) is rounded to the
format's grid by ``round_half_even(|v| / ulp) * ulp`` with the ulp of ``|v|``'s binade: e4m3 has 3 mantissa bits
and a minimum normal exponent of -6 (subnormal step 2^-9); e2m1 has 1 mantissa bit and a minimum normal
exponent of 0 (values 0, .5, 1, 1.5, 2, 3, 4, 6). Ties go to the even quotient, which is the even code.
"""

from __future__ import annotations

import torch

from .optable import candidate


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive v."""
    m, e = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))


def _round_grid(v: torch.Tensor, mant_bits: int, min_exp: int) -> torch.Tensor:
    a = v.abs()
    _, e = torch.frexp(a)  # floor(log2 a) = e - 1 for a > 0
    ulp = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=min_exp) - mant_bits)
    return torch.copysign(torch.round(a / ulp) * ulp, v)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


@candidate("fp8_act_round", "composed", "torch ops on the device (e4m3 grid rounding, no FP8 dtype)")
def fp8_act_round(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    xb = _blocks(x, block)
    s = _pow2_ceil(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0)
    q = _round_grid((xb / s).clamp(-448.0, 448.0), 3, -6)
    return (q * s).flatten(-2).to(x.dtype)


@candidate("fp4_act_round", "composed", "torch ops on the device (e2m1 grid rounding, no FP4 dtype)")
def fp4_act_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    s = _pow2_ceil(xb.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126) / 6.0)
    q = _round_grid((xb / s).clamp(-6.0, 6.0), 1, 0)
    return (q * s).flatten(-2).to(x.dtype)
