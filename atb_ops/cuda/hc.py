"""Triton manifold-constrained hyper-connections: hc_pre (with Sinkhorn), hc_post, hc_head
(ascend_dsv4/models/deepseek_v4/README.md §2.2, §2.5).

Two kernels per collapse: ``_mixes_kernel`` computes m = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + eps) for a
tile of tokens (float32 products, so the mixes match the reference's float32 matmul); ``_split_kernel`` turns
one token's mixes into pre / post / the Sinkhorn-normalised comb and writes u = sum_j pre_j x_j.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import pow2


@triton.jit
def _mixes_kernel(x_ptr, fn_ptr, out_ptr, T, K, n_out, eps, BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    o = tl.arange(0, BO)
    tm = t < T
    om = o < n_out
    acc = tl.zeros((BT, BO), dtype=tl.float32)
    ss = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xa = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=tm[:, None] & km[None, :],
                     other=0.0).to(tl.float32)
        fa = tl.load(fn_ptr + o[:, None] * K + k[None, :], mask=om[:, None] & km[None, :], other=0.0)
        acc += tl.dot(xa, tl.trans(fa), input_precision="ieee")
        ss += tl.sum(xa * xa, 1)
    r = tl.rsqrt(ss / K + eps)
    tl.store(out_ptr + t[:, None] * BO + o[None, :], acc * r[:, None], mask=tm[:, None])


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, int]:
    """float32 [T, BO] (BO = pow2(rows of fn) >= 16; the first rows-of-fn columns are meaningful)."""
    t_count = x.shape[0]
    k = x.shape[1] * x.shape[2]
    n_out = fn.shape[0]
    bo = pow2(n_out, 16)
    out = torch.empty(t_count, bo, dtype=torch.float32, device=x.device)
    bt = 16
    _mixes_kernel[(triton.cdiv(t_count, bt),)](x, fn.float().contiguous(), out, t_count, k, n_out, float(norm_eps),
                                               BT=bt, BO=bo, BK=64, num_warps=4)
    return out, bo


@triton.jit
def _split_kernel(m_ptr, x_ptr, scale_ptr, base_ptr, u_ptr, post_ptr, comb_ptr, d, iters, hc_eps,
                  N: tl.constexpr, BO: tl.constexpr, FULL: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    s0 = tl.load(scale_ptr)
    pre = tl.sigmoid(tl.load(m_ptr + t * BO + j) * s0 + tl.load(base_ptr + j)) + hc_eps
    if FULL:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = 2.0 * tl.sigmoid(tl.load(m_ptr + t * BO + N + j) * s1 + tl.load(base_ptr + N + j))
        tl.store(post_ptr + t * N + j, post)
        cidx = 2 * N + j[:, None] * N + j[None, :]  # comb[a, b] = mixes[2N + a N + b]
        c = tl.load(m_ptr + t * BO + cidx) * s2 + tl.load(base_ptr + cidx)
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
    mixes, bo = _mixes(xc, fn, norm_eps)
    _split_kernel[(t_count,)](mixes, xc, scale.float().contiguous(), base.float().contiguous(), u, post, comb, d,
                              int(sinkhorn_iters), float(hc_eps), N=n, BO=bo, FULL=True, BD=min(pow2(d), 1024))
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
    mixes, bo = _mixes(xc, fn, norm_eps)
    _split_kernel[(t_count,)](mixes, xc, scale.float().contiguous(), base.float().contiguous(), u, u, u, d, 0,
                              float(hc_eps), N=n, BO=bo, FULL=False, BD=min(pow2(d), 1024))
    return u


@triton.jit
def _post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, d, N: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = dd < d
    j = tl.arange(0, N)
    comb = tl.load(comb_ptr + t * N * N + j[:, None] * N + j[None, :])  # [j, k]
    xv = tl.load(x_ptr + t * N * d + j[:, None] * d + dd[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * d + dd, mask=dm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + j)
    mix = tl.sum(comb[:, :, None] * xv[:, None, :], 0)  # [k, BD]
    out = post[:, None] * y[None, :] + mix
    tl.store(out_ptr + t * N * d + j[:, None] * d + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=dm[None, :])


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
