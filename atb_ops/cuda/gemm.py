"""Triton linears over FP8-block and packed-FP4 weights, and the grouped (per-expert) matmul over sorted rows.

``_gemm_kernel`` computes out[rows] = x[rows] @ W^T with the weight dequantised in the kernel:

- ``dense``: W tile loaded in its dtype;
- ``fp8_block``: e4m3 tile converted exactly to the compute dtype; the 128x128 block scale (float32, or E8M0
  decoded in the kernel) multiplies the tile's partial product (BN and BK divide 128, so one scale per tile);
- ``fp4``: bytes split into low (element 2c) and high (element 2c+1) e2m1 codes, decoded, multiplied by
  2^(E8M0 - 127) per 32 inputs; exact in bfloat16.

Accumulation is float32. For the grouped op, rows are sorted by expert (stable argsort) and cut into tiles
of BM rows that never cross an expert; the tile table (expert, first row, end row) is built on the device
with a static size ``ceil(M / BM) + min(E, M)`` (no host synchronisation; tiles past the end do nothing).
Dense ``linear`` stays on cuBLAS (torch.matmul), which is the ceiling for that case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import mma, dot_precision, pow2, tl_dtype

_FMT = {"dense": 0, "fp8_block": 1, "fp4": 2}


@triton.jit
def _e8m0(b):
    """float32 2^(b - 127) of E8M0 bytes (b = 0 is the subnormal 2^-127)."""
    b = b.to(tl.int32) & 0xFF
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_value(c):
    """float32 value of e2m1 codes c (0..15): magnitude [0, .5, 1, 1.5, 2, 3, 4, 6][c & 7], sign bit 8."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    p = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * p)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                 M, N, K, stride_we, stride_se,
                 FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, GROUPED: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CT: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
        rr = r0 + tl.arange(0, BM)
        rm = rr < r1
        rows = tl.load(order_ptr + rr, mask=rm, other=0).to(tl.int64)
    else:
        e = 0
        rr = pid_m * BM + tl.arange(0, BM)
        rm = rr < M
        rows = rr.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc = tl.zeros((BM, BN), tl.float32)
    if tl.max(rm.to(tl.int32), 0) > 0:
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(CT)
            if FMT == 0:
                wt = tl.load(w_base + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :],
                             other=0.0).to(CT)
                acc += mma(a, tl.trans(wt), PREC)
            elif FMT == 1:
                wt = tl.load(w_base + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :],
                             other=0.0).to(CT)
                ks = tl.cdiv(K, 128)
                sv = tl.load(s_base + (pid_n * BN // 128) * ks + k0 // 128)
                if SCALE_E8M0:
                    sv = _e8m0(sv)
                acc += mma(a, tl.trans(wt), PREC) * sv.to(tl.float32)
            else:
                kh = k0 // 2 + tl.arange(0, BK // 2)
                b = tl.load(w_base + n[:, None].to(tl.int64) * (K // 2) + kh[None, :],
                            mask=nm[:, None] & (kh < K // 2)[None, :], other=0).to(tl.int32) & 0xFF
                lo = _fp4_value(b & 0xF)
                hi = _fp4_value(b >> 4)
                wv = tl.reshape(tl.join(lo, hi), (BN, BK))
                kb = k0 // 32 + tl.arange(0, BK // 32)
                sc = _e8m0(tl.load(s_base + n[:, None].to(tl.int64) * (K // 32) + kb[None, :],
                                   mask=nm[:, None] & (kb < K // 32)[None, :], other=127))
                wv = tl.reshape(tl.reshape(wv, (BN, BK // 32, 32)) * sc[:, :, None], (BN, BK)).to(CT)
                acc += mma(a, tl.trans(wv), PREC)
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


def _compute_dtype(x: torch.Tensor, fmt: str, w: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.float32 or (fmt == "dense" and w.dtype != x.dtype):
        return torch.float32
    return x.dtype


def _check(fmt: str, k: int) -> None:
    if fmt not in _FMT:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {tuple(_FMT)}")
    if fmt == "fp4" and k % 32:
        raise ValueError(f"fp4 weights need an input size that is a multiple of 32, got {k}")


def _scale_arg(w_scale: torch.Tensor | None, w: torch.Tensor):
    if w_scale is None:
        return w, False
    if w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype):
        return w_scale.contiguous().view(torch.uint8), True
    return w_scale.float().contiguous(), False


def _tiles(m: int, n: int, k: int, fmt: str, compute: torch.dtype) -> tuple[int, int, int]:
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bk = 128 if fmt != "dense" else 64
    bn = 64 if m <= 64 else 128
    if compute == torch.float32:
        bk, bn = min(bk, 64), min(bn, 64)
    return bm, bn, bk


@register("linear", "cuda")
def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
    """y = x @ W^T, x [M, K]; dense weights on cuBLAS, fp8_block / fp4 through ``_gemm_kernel``."""
    if fmt == "dense":
        if w.dtype == x.dtype:
            return x @ w.t()
        return (x.float() @ w.float().t()).to(x.dtype)
    m, k = x.shape
    _check(fmt, k)
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    ct = _compute_dtype(x, fmt, w)
    bm, bn, bk = _tiles(m, n, k, fmt, ct)
    s, e8 = _scale_arg(w_scale, w)
    xc = x.contiguous()
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        xc, w.contiguous(), s, out, xc, xc, xc, xc, m, n, k, 0, 0, FMT=_FMT[fmt], SCALE_E8M0=e8, GROUPED=False,
        BM=bm, BN=bn, BK=bk, CT=tl_dtype(ct), PREC=dot_precision(ct), num_warps=4, num_stages=3)
    return out


def expert_tiles(expert_ids: torch.Tensor, n_experts: int, bm: int):
    """Device-side tile table of rows grouped by expert (no host synchronisation).

    Returns (order [M] rows sorted by expert (stable), tile_e, tile_r0, tile_r1 [ceil(M/bm) + min(E, M)]):
    tile i covers sorted rows tile_r0[i] .. tile_r1[i] - 1 of expert tile_e[i]; unused tiles have r0 = r1.
    """
    m = expert_ids.shape[0]
    dev = expert_ids.device
    ids = expert_ids.long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    row_start = torch.cumsum(counts, 0) - counts
    n_tiles = triton.cdiv(m, bm) + min(n_experts, m)
    t = torch.arange(n_tiles, device=dev)
    e = torch.searchsorted(tile_end, t, right=True)
    valid = e < n_experts
    ec = e.clamp(max=n_experts - 1)
    r0 = row_start[ec] + (t - tile_start[ec]) * bm
    r1 = torch.minimum(row_start[ec] + counts[ec], r0 + bm)
    r1 = torch.where(valid, r1, r0)
    return order, ec, r0, r1


@register("grouped_matmul", "cuda")
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor | None = None,
                   fmt: str = "dense") -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T; x [M, K], w [E, N, K] (fp4: [E, N, K/2]); float32 accumulation."""
    m, k = x.shape
    _check(fmt, k)
    n_exp, n = w.shape[0], w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    ct = _compute_dtype(x, fmt, w)
    rows_per_expert = m / max(1, min(n_exp, m))
    bm = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 48 else 64)
    _, bn, bk = _tiles(m if bm > 16 else 1, n, k, fmt, ct)
    order, te, r0, r1 = expert_tiles(expert_ids, n_exp, bm)
    s, e8 = _scale_arg(w_scale, w)
    wc = w.contiguous()
    _gemm_kernel[(te.shape[0], triton.cdiv(n, bn))](
        x.contiguous(), wc, s, out, order, te, r0, r1, m, n, k, wc.stride(0), s.stride(0) if w_scale is not None else 0,
        FMT=_FMT[fmt], SCALE_E8M0=e8, GROUPED=True, BM=bm, BN=bn, BK=bk, CT=tl_dtype(ct), PREC=dot_precision(ct),
        num_warps=4, num_stages=3)
    return out
