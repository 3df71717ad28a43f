"""Triton manifold-constrained hyper-connections: hc_pre (with Sinkhorn), hc_post, hc_head
(ascend_dsv4/models/deepseek_v4/README.md §2.2, §2.5).

Per collapse: the split-K skinny matmul (:mod:`._skinny`) gives the per-split partial sums of flat(x) @ fn^T and
sum(flat(x)^2) (float32 products, as the reference's float32 matmul); ``_split_kernel`` adds the splits up
(one load of all of a token's splits, a fixed reduction tree), scales them by rsqrt(mean + eps), turns one
token's mixes into pre / post / the Sinkhorn-normalised comb and writes u = sum_j pre_j x_j.
Its grid is (T, cdiv(d, BD) + 1): each of the first cdiv(d, BD) programs of a token sums the partials, computes
pre and writes one BD-chunk of u; the last one (hc_pre only) computes post and the Sinkhorn comb.
A decode step's handful of tokens thus spreads over several programs each, and the long dependent Sinkhorn chain
runs beside the u chunks instead of in front of them (one program per token before: on an H100 at T = 8,
d = 4096, hc_pre 10.8 -> 9.0-9.4 us a call, hc_head 8.6 -> 7.0-7.2 us; the Sinkhorn program is now the longest,
~4.5 us of the split kernel against ~2.1 us without it). u and post come from the same operations in the same
order as before (bitwise-identical results). For 4 streams (V4) the Sinkhorn iterations after the first run on 16
scalars in every thread (:func:`_sinkhorn4`): the tensor form's 2 (iters - 1) four-element sums each went through
cross-thread shuffles (the timings above are from before this form; it was measured only inside the decode step,
scripts/bench_results/decode_h100_session10.txt).

``hc_pre_norm`` / ``hc_head_norm`` (:func:`atb_ops.hc_pre_norm`: the block's collapse and its input RMSNorm, the
final collapse and the model's norm) run the same kernel in its NORM form, one launch fewer than the collapse and
the rms_norm kernel after it: one program a token holds the whole row (one [N, pow2(d)] tile up to d = 8192, else
chunk by chunk), rounds u to x's dtype and writes its norm; the Sinkhorn program beside it as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._skinny import skinny_matmul
from ._util import pow2, pdl_wait, pdl


def _mixes(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(partial sums of flat(x) @ fn^T float32 [S, T, BO] and of sum(flat(x)^2) [S, T] over the S K-splits, BO, S);
    _split_kernel adds the splits up (in split order) and applies the rsqrt scaling."""
    flat = x.view(x.shape[0], -1)
    m, ss = skinny_matmul(flat, fn.float().contiguous(), want_ss=True, partials=True)
    return m, ss, m.shape[2], m.shape[0]


@triton.jit
def _pick(v, idx, BO: tl.constexpr):
    """v[idx] for a register vector v [BO] and an index vector idx: a masked sum, no memory round trip."""
    o = tl.arange(0, BO)
    return tl.sum(tl.where(o[None, :] == idx[:, None], v[None, :], 0.0), 1)


@triton.jit
def _pick2(v, idx, BO: tl.constexpr):
    """v[idx] for an index matrix idx."""
    o = tl.arange(0, BO)
    return tl.sum(tl.where(o[None, None, :] == idx[:, :, None], v[None, None, :], 0.0), 2)


@triton.jit
def _u_chunk(x_ptr, t, d, d0, pre, j, N: tl.constexpr, BD: tl.constexpr):
    """u[t, d0:d0 + BD] = sum_j pre_j x[t, j, d0:d0 + BD] in float32, its columns and their mask."""
    dd = d0 + tl.arange(0, BD)
    dm = dd < d
    xv = tl.load(x_ptr + t * N * d + j[:, None] * d + dd[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    return tl.sum(pre[:, None] * xv, 0), dd, dm


@triton.jit
def _split_kernel(m_ptr, ss_ptr, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, d, iters, hc_eps, norm_eps,
                  T, S, w_ptr, out_eps, N: tl.constexpr, BO: tl.constexpr, SP: tl.constexpr, FULL: tl.constexpr,
                  BD: tl.constexpr, NORM: tl.constexpr = False, ONE: tl.constexpr = False, BR: tl.constexpr = 1,
                  PDL: tl.constexpr = False):
    """Program (t, c): c < cdiv(d, BD) writes u[t, c BD:(c + 1) BD]; c == cdiv(d, BD) (launched only when FULL)
    writes post[t] and comb[t]. Every program re-derives the token's mixes from the partials (the same load and
    fixed reduction tree in each, so all programs see the same bits). With NORM the grid is (T, 1 + FULL):
    program (t, 0) computes the whole row u[t] rounded to u's dtype and writes RMSNorm(u[t]) * w (``out_eps``; as
    the rms_norm kernel computes it): with ONE as one [N, BR] tile (BR = pow2(d)), else chunk by chunk (u written,
    the sum of squares added per chunk, then the row normed in place); program (t, 1) (FULL) writes post and comb."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c_id = tl.program_id(1)
    j = tl.arange(0, N)
    # the S split-K partials of this token in one load each, summed by a fixed tree (was a loop of S dependent
    # loads per mix: latency-bound at S = 64)
    s = tl.arange(0, SP)
    sm = s < S
    mix = tl.sum(tl.load(m_ptr + (s[:, None] * T + t) * BO + tl.arange(0, BO)[None, :], mask=sm[:, None], other=0.0), 0)
    r = tl.rsqrt(tl.sum(tl.load(ss_ptr + s * T + t, mask=sm, other=0.0), 0) / (N * d) + norm_eps)
    d0 = c_id * BD
    if NORM:
        u_prog = c_id == 0
    else:
        u_prog = d0 < d
    if u_prog:
        s0 = tl.load(scale_ptr)
        pre = tl.sigmoid(_pick(mix, j, BO) * r * s0 + tl.load(base_ptr + j)) + hc_eps
        if NORM and ONE:  # the whole row in one tile: u, its norm and the store from registers
            u, dd, dm = _u_chunk(x_ptr, t, d, 0, pre, j, N, BR)
            uf = tl.where(dm, u.to(u_ptr.dtype.element_ty).to(tl.float32), 0.0)
            y = tl.load(w_ptr + dd, mask=dm, other=0.0) * (uf * tl.rsqrt(tl.sum(uf * uf, 0) / d + out_eps))
            tl.store(u_ptr + t * d + dd, y.to(u_ptr.dtype.element_ty), mask=dm)
        elif NORM:
            sq = tl.zeros((BD,), tl.float32)
            for c0 in range(0, d, BD):
                u, dd, dm = _u_chunk(x_ptr, t, d, c0, pre, j, N, BD)
                ub = u.to(u_ptr.dtype.element_ty)
                tl.store(u_ptr + t * d + dd, ub, mask=dm)
                uf = tl.where(dm, ub.to(tl.float32), 0.0)
                sq += uf * uf
            rs = tl.rsqrt(tl.sum(sq, 0) / d + out_eps)
            tl.debug_barrier()  # the row's stores visible to the program's own loads
            for c0 in range(0, d, BD):
                dd = c0 + tl.arange(0, BD)
                dm = dd < d
                uf = tl.load(u_ptr + t * d + dd, mask=dm, other=0.0).to(tl.float32)
                y = tl.load(w_ptr + dd, mask=dm, other=0.0) * (uf * rs)
                tl.store(u_ptr + t * d + dd, y.to(u_ptr.dtype.element_ty), mask=dm)
        else:
            u, dd, dm = _u_chunk(x_ptr, t, d, d0, pre, j, N, BD)
            tl.store(u_ptr + t * d + dd, u.to(u_ptr.dtype.element_ty), mask=dm)
    elif FULL:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = 2.0 * tl.sigmoid(_pick(mix, N + j, BO) * r * s1 + tl.load(base_ptr + N + j))
        tl.store(post_ptr + t * N + j, post)
        cidx = 2 * N + j[:, None] * N + j[None, :]  # comb[a, b] = mixes[2N + a N + b]
        c = _pick2(mix, cidx, BO) * r * s2 + tl.load(base_ptr + cidx)
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = c / tl.sum(c, 1)[:, None] + hc_eps
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        if N == 4:  # the rest of the chain on 16 scalars held by every thread (no cross-thread sums)
            tl.store(comb_ptr + t * N * N + j[:, None] * N + j[None, :], c)
            tl.debug_barrier()  # the block's stores visible to its own loads
            _sinkhorn4(comb_ptr + t * N * N, iters, hc_eps)
        else:
            for _ in range(iters - 1):
                c = c / (tl.sum(c, 1)[:, None] + hc_eps)
                c = c / (tl.sum(c, 0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + j[:, None] * N + j[None, :], c)


@triton.jit
def _norm4(a, b, c, d, eps):
    """a, b, c, d / (a + b + c + d + eps), the sum as tl.sum's tree adds four values."""
    s = (a + b) + (c + d) + eps
    return a / s, b / s, c / s, d / s


@triton.jit
def _sinkhorn4(p, iters, eps):
    """The (iters - 1) row- then column-normalisations of a 4 x 4 comb at p (row-major), in place: as scalars,
    every thread doing the whole chain (the tensor form spent each of its 2 (iters - 1) sums on cross-thread
    shuffles: the longest program of the split kernel)."""
    c00, c01, c02, c03 = tl.load(p + 0), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    c10, c11, c12, c13 = tl.load(p + 4), tl.load(p + 5), tl.load(p + 6), tl.load(p + 7)
    c20, c21, c22, c23 = tl.load(p + 8), tl.load(p + 9), tl.load(p + 10), tl.load(p + 11)
    c30, c31, c32, c33 = tl.load(p + 12), tl.load(p + 13), tl.load(p + 14), tl.load(p + 15)
    for _ in range(iters - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    tl.debug_barrier()  # every thread has read the comb before any overwrites it
    tl.store(p + 0, c00)
    tl.store(p + 1, c01)
    tl.store(p + 2, c02)
    tl.store(p + 3, c03)
    tl.store(p + 4, c10)
    tl.store(p + 5, c11)
    tl.store(p + 6, c12)
    tl.store(p + 7, c13)
    tl.store(p + 8, c20)
    tl.store(p + 9, c21)
    tl.store(p + 10, c22)
    tl.store(p + 11, c23)
    tl.store(p + 12, c30)
    tl.store(p + 13, c31)
    tl.store(p + 14, c32)
    tl.store(p + 15, c33)


def _split_bd(d: int) -> int:
    """The u chunk of one _split_kernel program: 1024 (d = 4096 -> 4 chunks), pow2(d) for a smaller d. The chunk
    shapes the [N, BD] tile's register layout and with it how the compiled u = sum_j pre_j x_j is rounded: 1024 is
    the chunk of the former one-program-per-token loop, so u stays bitwise as it was on a GPU (BD = 512 changed a
    few bf16 u elements by one ulp at d = 4096 on an H100), and it was also the fastest of 256 / 512 / 1024 there."""
    return min(pow2(d), 1024)


NORM_ONE_MAX = 8192  # the widest row the fused norm holds as one tile (wider rows: chunk by chunk)


def _one_row(d: int) -> tuple[bool, int, int]:
    """(ONE, BR, num_warps) of the fused-norm split kernel: the row as one tile where pow2(d) <= NORM_ONE_MAX (8 warps:
    a [4, 4096] float32 tile is 64 values a thread), else chunk by chunk (4 warps, as hc_pre). The launcher takes 4
    warps whatever this says where the grid also runs the Sinkhorn program (hc_pre_norm)."""
    one = pow2(d) <= NORM_ONE_MAX
    return one, pow2(d) if one else 1, 8 if one else 4


def _check_streams(x: torch.Tensor) -> int:
    n = x.shape[-2]
    if n & (n - 1):
        raise ValueError(f"the CUDA hc kernels need a power-of-two number of streams, got {n}")
    return n


def _collapse(x, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, full: bool, weight=None,
              eps: float = 0.0):
    """The skinny mixes and the split kernel: (u or rms_norm(u, weight, eps) [T, d] x.dtype, post [T, N] fp32,
    comb [T, N, N] fp32), post / comb None unless ``full`` (hc_pre; hc_head otherwise). With ``weight`` the kernel's
    NORM form: one row program a token (in place of cdiv(d, BD); at a decode step's few tokens it still ends
    within the Sinkhorn program's time) writes the normed row, one launch fewer than the rms_norm after it."""
    n = _check_streams(x)
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    y = torch.empty(t_count, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t_count, n, dtype=torch.float32, device=x.device) if full else None
    comb = torch.empty(t_count, n, n, dtype=torch.float32, device=x.device) if full else None
    if t_count == 0:
        return y, post, comb
    mixes, ss, bo, splits = _mixes(xc, fn)
    bd = _split_bd(d)
    norm = weight is not None
    rows = 1 if norm else triton.cdiv(d, bd)
    one, br, warps = _one_row(d) if norm else (False, 1, 4)
    # 4 warps where a Sinkhorn program shares the grid (hc_pre_norm): 4.9 us a call against 6.5 at 8 warps, the
    # decode step ~1 % shorter (H200, session 31: scripts/bench_results/h200_session31.txt)
    warps = 4 if full else warps
    _split_kernel[(t_count, rows + int(full))](
        mixes, ss, xc, scale.float().contiguous(), base.float().contiguous(), y, post if full else y,
        comb if full else y, d, int(iters), float(hc_eps), float(norm_eps), t_count, splits,
        weight.float().contiguous() if norm else y, float(eps), N=n, BO=bo, SP=pow2(splits), FULL=full, BD=bd,
        NORM=norm, ONE=one, BR=br, num_warps=warps, **pdl())
    return y, post, comb


@register("hc_pre", "cuda")
def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """x [T, N, d] -> (u [T, d] x.dtype, post [T, N] fp32, comb [T, N, N] fp32); see :func:`atb_ops.hc_pre`."""
    return _collapse(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True)


def hc_pre_norm(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float, weight, eps: float):
    """:func:`atb_ops.hc_pre_norm` in the split kernel: (rms_norm(u, weight, eps), post, comb)."""
    return _collapse(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True, weight, eps)


hc_pre.norm_epilogue = hc_pre_norm  # atb_ops.hc_pre_norm runs it


@register("hc_head", "cuda")
def hc_head(x, fn, base, scale, hc_eps: float, norm_eps: float):
    """x [T, N, d] -> sum_j (sigmoid(m_j scale + base_j) + hc_eps) x_j, [T, d] x.dtype."""
    return _collapse(x, fn, base, scale, 0, hc_eps, norm_eps, False)[0]


def hc_head_norm(x, fn, base, scale, hc_eps: float, norm_eps: float, weight, eps: float):
    """:func:`atb_ops.hc_head_norm` in the split kernel: rms_norm(hc_head(x, ...), weight, eps)."""
    return _collapse(x, fn, base, scale, 0, hc_eps, norm_eps, False, weight, eps)[0]


hc_head.norm_epilogue = hc_head_norm  # atb_ops.hc_head_norm runs it


@triton.jit
def _post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, d, N: tl.constexpr, BD: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = dd < d
    k = tl.arange(0, N)
    y = tl.load(y_ptr + t * d + dd, mask=dm, other=0.0).to(tl.float32)
    out = tl.load(post_ptr + t * N + k)[:, None] * y[None, :]  # [k, BD]
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + (t * N + j) * d + dd, mask=dm, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * N * N + j * N + k)  # comb[j, k]
        out += cj[:, None] * xj[None, :]
    tl.store(out_ptr + t * N * d + k[:, None] * d + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=dm[None, :])


@register("hc_post", "cuda")
def hc_post(y, x, post, comb):
    """out_k = post_k y + sum_j comb[j, k] x_j, [T, N, d] in x.dtype (float32 inside)."""
    n = _check_streams(x)
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if t_count == 0:
        return out
    bd = min(pow2(d), 512)
    _post_kernel[(t_count, triton.cdiv(d, bd))](y.contiguous(), xc, post.float().contiguous(),
                                                comb.float().contiguous(), out, d, N=n, BD=bd, num_warps=4, **pdl())
    return out
