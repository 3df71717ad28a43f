"""Triton manifold-constrained hyper-connections: hc_pre (with Sinkhorn), hc_post, hc_head
(ascend_dsv4/models/deepseek_v4/README.md §2.2, §2.5).

Per collapse: the split-K skinny matmul (:mod:`._skinny`) gives the per-split partial sums of flat(x) @ fn^T and
sum(flat(x)^2) (float32 products, as the reference's float32 matmul); ``_split_kernel`` adds the splits up
(one load of all of a token's splits, a fixed reduction tree), scales them by rsqrt(mean + eps), turns one
token's mixes into pre / post / the Sinkhorn-normalised comb and writes u = sum_j pre_j x_j.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._skinny import skinny_matmul
from ._util import pow2


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
def _split_kernel(m_ptr, ss_ptr, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, d, iters, hc_eps, norm_eps,
                  T, S, N: tl.constexpr, BO: tl.constexpr, SP: tl.constexpr, FULL: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    # the S split-K partials of this token in one load each, summed by a fixed tree (was a loop of S dependent
    # loads per mix: latency-bound at S = 64)
    s = tl.arange(0, SP)
    sm = s < S
    mix = tl.sum(tl.load(m_ptr + (s[:, None] * T + t) * BO + tl.arange(0, BO)[None, :], mask=sm[:, None], other=0.0), 0)
    r = tl.rsqrt(tl.sum(tl.load(ss_ptr + s * T + t, mask=sm, other=0.0), 0) / (N * d) + norm_eps)
    s0 = tl.load(scale_ptr)
    pre = tl.sigmoid(_pick(mix, j, BO) * r * s0 + tl.load(base_ptr + j)) + hc_eps
    if FULL:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = 2.0 * tl.sigmoid(_pick(mix, N + j, BO) * r * s1 + tl.load(base_ptr + N + j))
        tl.store(post_ptr + t * N + j, post)
        cidx = 2 * N + j[:, None] * N + j[None, :]  # comb[a, b] = mixes[2N + a N + b]
        c = _pick2(mix, cidx, BO) * r * s2 + tl.load(base_ptr + cidx)
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = c / tl.sum(c, 1)[:, None] + hc_eps
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, 1)[:, None] + hc_eps)
            c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + j[:, None] * N + j[None, :], c)
    for d0 in range(0, d, BD):
        dd = d0 + tl.arange(0, BD)
        dm = dd < d
        xv = tl.load(x_ptr + t * N * d + j[:, None] * d + dd[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        tl.store(u_ptr + t * d + dd, tl.sum(pre[:, None] * xv, 0).to(u_ptr.dtype.element_ty), mask=dm)


def _check_streams(x: torch.Tensor) -> int:
    n = x.shape[-2]
    if n & (n - 1):
        raise ValueError(f"the CUDA hc kernels need a power-of-two number of streams, got {n}")
    return n


@register("hc_pre", "cuda")
def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """x [T, N, d] -> (u [T, d] x.dtype, post [T, N] fp32, comb [T, N, N] fp32); see :func:`atb_ops.hc_pre`."""
    n = _check_streams(x)
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    u = torch.empty(t_count, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t_count, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t_count, n, n, dtype=torch.float32, device=x.device)
    if t_count == 0:
        return u, post, comb
    mixes, ss, bo, splits = _mixes(xc, fn)
    _split_kernel[(t_count,)](mixes, ss, xc, scale.float().contiguous(), base.float().contiguous(), u, post, comb, d,
                              int(sinkhorn_iters), float(hc_eps), float(norm_eps), t_count, splits, N=n, BO=bo,
                              SP=pow2(splits), FULL=True, BD=min(pow2(d), 1024))
    return u, post, comb


@register("hc_head", "cuda")
def hc_head(x, fn, base, scale, hc_eps: float, norm_eps: float):
    """x [T, N, d] -> sum_j (sigmoid(m_j scale + base_j) + hc_eps) x_j, [T, d] x.dtype."""
    n = _check_streams(x)
    t_count, d = x.shape[0], x.shape[-1]
    xc = x.contiguous()
    u = torch.empty(t_count, d, dtype=x.dtype, device=x.device)
    if t_count == 0:
        return u
    mixes, ss, bo, splits = _mixes(xc, fn)
    _split_kernel[(t_count,)](mixes, ss, xc, scale.float().contiguous(), base.float().contiguous(), u, u, u, d, 0,
                              float(hc_eps), float(norm_eps), t_count, splits, N=n, BO=bo, SP=pow2(splits), FULL=False,
                              BD=min(pow2(d), 1024))
    return u


@triton.jit
def _post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, d, N: tl.constexpr, BD: tl.constexpr):
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
                                                comb.float().contiguous(), out, d, N=n, BD=bd, num_warps=4)
    return out
