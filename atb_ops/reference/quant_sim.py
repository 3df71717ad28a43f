"""Activation fake-quantisation exactly as the official DeepSeek-V4 kernels do it
(ascend_dsv4/models/deepseek_v4/README.md §2.0, §6.2)."""

from __future__ import annotations

import torch

from .._registry import register

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by code 0..7
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal float32 x, via the exponent bits (as the official kernel)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    e = exp - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


@register("fp8_act_round", "reference")
def fp8_act_round(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = pow2_ceil(amax * (1.0 / FP8_MAX))
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2).to(x.dtype)


def round_fp4(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest e2m1 value, ties to the even code."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=v.device)
    a = v.abs()
    hi = torch.bucketize(a, grid).clamp(max=7)  # first grid index >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    mag = torch.where(take_hi, grid[hi], grid[lo])
    return torch.copysign(mag, v)


@register("fp4_act_round", "reference")
def fp4_act_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    s = pow2_ceil(amax * (1.0 / FP4_MAX))
    q = round_fp4((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)


def _hadamard_matrix(n: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@register("hadamard", "reference")
def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two size, got {n}")
    h = _hadamard_matrix(n, x.device)
    return ((x.float() @ h) * n**-0.5).to(x.dtype)
