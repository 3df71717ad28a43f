"""Interleaved partial RoPE with optional YaRN frequency interpolation (ascend_dsv4/models/deepseek_v4/README.md
§2.0)."""

from __future__ import annotations

import math

import torch

from .._registry import register


def rope_inv_freq(
    rope_dim: int,
    base: float,
    factor: float = 1.0,
    original_seq_len: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """theta_i = base^(-2i/R), i < R/2, with YaRN when ``original_seq_len > 0`` (float32 [R/2])."""
    # always on the CPU (also under a meta-device context): the table is a constant, moved by apply_rope
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim))
    if original_seq_len > 0:

        def corr_dim(n_rot: float) -> float:
            return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


@register("apply_rope", "reference")
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    half = inv_freq.numel()
    rd = 2 * half
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device, torch.float32)  # [T, R/2]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -rd:].float().unflatten(-1, (half, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], out.to(x.dtype)], dim=-1)
