"""Triton RMSNorm, interleaved partial RoPE (forward and inverse) and clamped SwiGLU.

Same math as :func:`atb_ops.rms_norm`, :func:`atb_ops.apply_rope`, :func:`atb_ops.swiglu`: float32 inside,
one pass over the data, the result cast to the input dtype (float32 for swiglu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import pow2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    if HAS_W:
        y = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32) * y
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@register("rms_norm", "cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """One program per row of the last dim n: y = w * x * rsqrt(mean(x^2) + eps) in float32."""
    n = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // max(n, 1)
    if rows == 0 or n == 0:
        return y
    w = weight.contiguous() if weight is not None else xc
    _rms_norm_kernel[(rows,)](xc, w, y, n, float(eps), HAS_W=weight is not None, BLOCK=pow2(n),
                              num_warps=4 if n <= 4096 else 8)
    return y


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, f_ptr, y_ptr, G, D, R, sin_sign, BG: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    d = tl.arange(0, BD)
    gm = g < G
    dm = d < D
    mask = gm[:, None] & dm[None, :]
    base = t * G * D + g[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + base, mask=mask, other=0.0)
    j = d - (D - R)  # index inside the rope slice (negative: pass-through channel)
    is_rope = (j >= 0) & dm
    even = (j % 2) == 0
    partner = tl.where(even, d + 1, d - 1)
    p = tl.load(x_ptr + t * G * D + g[:, None].to(tl.int64) * D + partner[None, :],
                mask=mask & is_rope[None, :], other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    f = tl.load(f_ptr + j // 2, mask=is_rope, other=0.0)
    ang = pos * f
    c = tl.cos(ang)
    s = tl.sin(ang) * sin_sign
    xf = x.to(tl.float32)
    rot = xf * c[None, :] + tl.where(even, -p * s[None, :], p * s[None, :])
    out = tl.where(is_rope[None, :], rot.to(x.dtype), x)
    tl.store(y_ptr + base, out, mask=mask)


@register("apply_rope", "cuda")
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] viewed as [T, G, D]; one program per (token, block of G rows); pairs (2i, 2i+1) of the
    last R = 2 len(inv_freq) channels rotated by +-pos * theta_i (float32), the other channels copied."""
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel() == 0:
        return y
    g = xc.numel() // (t_count * d)
    f = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    pos = positions.to(x.device).contiguous()
    bd = pow2(d)
    bg = max(1, min(pow2(g), 4096 // bd))
    _rope_kernel[(t_count, triton.cdiv(g, bg))](xc, pos, f, y, g, d, 2 * f.numel(), -1.0 if inverse else 1.0,
                                                 BG=bg, BD=bd, num_warps=4)
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    tl.store(y_ptr + offs, g / (1.0 + tl.exp(-g)) * u, mask=m)


@register("swiglu", "cuda")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Elementwise silu(min(g, limit)) * clamp(u, -limit, limit) in float32 (no clamp when limit <= 0)."""
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](g, u, y, n, float(limit), CLAMP=limit > 0, BLOCK=block)
    return y
