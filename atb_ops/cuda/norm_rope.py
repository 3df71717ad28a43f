"""Triton RMSNorm, interleaved partial RoPE (forward and inverse), the two fused (with the KV row write) and
clamped SwiGLU.

Same math as :func:`atb_ops.rms_norm`, :func:`atb_ops.apply_rope`, :func:`atb_ops.swiglu`: float32 inside,
one pass over the data, the result cast to the input dtype (float32 for swiglu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import pow2, sm_count, pdl_wait, pdl


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit column stride; a view where the layout allows (the column halves of a
    stacked GEMM's output are), a copy otherwise."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, sx, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    if HAS_W:
        y = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32) * y
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@register("rms_norm", "cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """One program per row of the last dim n: y = w * x * rsqrt(mean(x^2) + eps) in float32; x may be a
    row-strided view (a column slice of a stacked GEMM's output), y is contiguous."""
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // max(n, 1)
    if rows == 0 or n == 0:
        return y
    xr = _rows(x)
    w = weight.contiguous() if weight is not None else xr
    _rms_norm_kernel[(rows,)](xr, w, y, n, xr.stride(0), float(eps), HAS_W=weight is not None, BLOCK=pow2(n),
                              num_warps=4 if n <= 4096 else 8, **pdl())
    return y


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, f_ptr, y_ptr, G, D, R, sin_sign, BG: tl.constexpr, BP: tl.constexpr,
                 BH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    gm = g < G
    row = (t * G + g.to(tl.int64)) * D
    P = D - R
    if BP > 0:  # pass-through channels: copied
        c = tl.arange(0, BP)
        cm = gm[:, None] & (c < P)[None, :]
        tl.store(y_ptr + row[:, None] + c[None, :], tl.load(x_ptr + row[:, None] + c[None, :], mask=cm), mask=cm)
    i = tl.arange(0, BH)  # pair index: channels P + 2i, P + 2i + 1
    im = i < R // 2
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + i, mask=im, other=0.0)
    cs = tl.cos(ang)[None, :]
    sn = (tl.sin(ang) * sin_sign)[None, :]
    m = gm[:, None] & im[None, :]
    pe = row[:, None] + P + 2 * i[None, :]
    a = tl.load(x_ptr + pe, mask=m, other=0.0)
    b = tl.load(x_ptr + pe + 1, mask=m, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    tl.store(y_ptr + pe, (af * cs - b * sn).to(a.dtype), mask=m)
    tl.store(y_ptr + pe + 1, (af * sn + b * cs).to(a.dtype), mask=m)


@register("apply_rope", "cuda")
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] viewed as [T, G, D]; one program per (token, block of G rows): the cos / sin of the R/2
    angles pos * theta_i computed once (float32), pairs (P + 2i, P + 2i + 1) of the last R channels rotated,
    the first P = D - R channels copied."""
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel() == 0:
        return y
    g = xc.numel() // (t_count * d)
    f = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    pos = positions.to(x.device).contiguous()
    r = 2 * f.numel()
    bp = pow2(d - r) if d > r else 0
    bg = max(1, min(pow2(g), 4096 // max(bp, r, 1)))
    # few tokens: smaller row blocks, so that the launch has about two programs per SM (the indexer's query at 8
    # tokens x 64 heads x 128 ran as 8 programs of 64 rows: 11 us; scripts/bench_results/decode_h100_session7.txt)
    while bg > 4 and t_count * triton.cdiv(g, bg) < 2 * sm_count(x.device):
        bg //= 2
    _rope_kernel[(t_count, triton.cdiv(g, bg))](xc, pos, f, y, g, d, r, -1.0 if inverse else 1.0,
                                                 BG=bg, BP=bp, BH=pow2(r // 2), num_warps=4, **pdl())
    return y


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, rows_ptr, G, n, R, sx, s_tok, eps, HAS_W: tl.constexpr,
                      TO_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # (token, row of the token) = (row // G, row % G)
    t = row // G
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)  # _rms_norm_kernel's expression, then its rounding to x's dtype
    if HAS_W:
        y = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32) * y
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    # the pairs (2p, 2p + 1) in registers; pair p is RoPE pair i = p - (n - R) / 2 of the last R channels
    a, b = tl.split(tl.reshape(y, (BLOCK // 2, 2)))
    i = tl.arange(0, BLOCK // 2) - (n - R) // 2
    rot = (i >= 0) & (i < R // 2)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + i, mask=rot, other=0.0)
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    a2 = tl.where(rot, a * cs - b * sn, a)  # _rope_kernel's expressions
    b2 = tl.where(rot, a * sn + b * cs, b)
    y = tl.reshape(tl.join(a2, b2), (BLOCK,)).to(x_ptr.dtype.element_ty)
    dst = tl.load(rows_ptr + t).to(tl.int64) if TO_ROWS else t
    tl.store(y_ptr + dst * s_tok + (row % G) * n + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                  inv_freq: torch.Tensor, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None):
    """:func:`atb_ops.rms_norm_rope` in one launch, one program per row of the last dim n (per token and head):
    the norm (as :func:`rms_norm`, rounded to x's dtype), the rotation of the last R channels' pairs (as
    :func:`apply_rope`), the store to y or to ``out``'s rows ``out_rows[t]`` (cast to out's dtype). Layouts the
    kernel does not take (n - R odd, an ``out`` whose rows are not contiguous) run the two kernels in sequence."""
    n = x.shape[-1]
    f = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    r = 2 * f.numel()
    if (n - r) % 2 or r > n or (out is not None and not out[:1].is_contiguous()):
        from ..ops import rms_norm_rope_in_sequence

        return rms_norm_rope_in_sequence(x, weight, eps, positions, inv_freq, out, out_rows)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    rows = x.numel() // max(n, 1)
    if rows == 0 or n == 0:
        return y if out is None else None
    xr = _rows(x)
    g = rows // x.shape[0]
    w = weight.contiguous() if weight is not None else xr
    dst = out_rows.contiguous() if out is not None else positions
    _norm_rope_kernel[(rows,)](xr, w, positions.to(x.device).contiguous(), f, y, dst, g, n, r, xr.stride(0),
                               y.stride(0), float(eps), HAS_W=weight is not None, TO_ROWS=out is not None,
                               BLOCK=pow2(n), num_warps=4 if n <= 4096 else 8, **pdl())
    return y if out is None else None


rms_norm.rope_epilogue = rms_norm_rope  # atb_ops.rms_norm_rope runs the fused kernel


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, s_ptr, y_ptr, c, sg, su, limit, CLAMP: tl.constexpr, SCALE: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < c
    g = tl.load(g_ptr + r * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * su + offs, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if SCALE:
        h = h * tl.load(s_ptr + r).to(tl.float32)
    tl.store(y_ptr + r * c + offs, h.to(y_ptr.dtype.element_ty), mask=m)


@register("swiglu", "cuda")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, row_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elementwise silu(min(g, limit)) * clamp(u, -limit, limit) in float32 (no clamp when limit <= 0), times
    row_scale[row] if given (its shape checked by :func:`atb_ops.swiglu`), stored as out_dtype (float32 by default):
    one launch.
    gate and up may be row-strided views (the two halves of one [T, 2I] GEMM output)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    y = torch.empty(gate.shape, dtype=out_dtype or torch.float32, device=gate.device)
    if y.numel():
        g, u = _rows(gate), _rows(up)
        c = g.shape[1]
        s = row_scale.reshape(-1).contiguous() if row_scale is not None else g
        block = min(1024, pow2(c))
        _swiglu_kernel[(g.shape[0], triton.cdiv(c, block))](g, u, s, y, c, g.stride(0), u.stride(0), float(limit),
                                                              CLAMP=limit > 0, SCALE=row_scale is not None,
                                                              BLOCK=block, **pdl())
    return y


swiglu.fuses_row_scale = True  # atb_ops.swiglu passes row_scale / out_dtype through (one launch)
