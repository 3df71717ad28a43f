"""Grouping of MoE rows by expert without a radix sort: ``moe_permute`` and the order ``grouped_matmul`` tiles.

At decode sizes (a few hundred (token, expert) rows) a stable radix sort is a sequence of launches that costs
tens of microseconds per call, several times per layer. :func:`stable_order` computes the same permutation as
``torch.argsort(ids, stable=True)`` with no host synchronisation (capture-safe): on the GPU in one launch
(:func:`.group_rows.stable_positions`), elsewhere as a counting sort in a handful of element-wise torch ops:

    rank[i]  = #{j < i : ids[j] == ids[i]}            ([M, M] comparison, M <= SMALL)
    start[e] = sum_{e' < e} count[e']                 (exclusive prefix sum over the E experts)
    order[start[ids[i]] + rank[i]] = i

Larger M falls back to the stable argsort. ``ids`` must lie in [0, n) (global expert ids of the routing).

``moe_permute`` up to ``SMALL`` rows is one launch (:func:`.group_rows.permute_rows`: positions, grouped rows, sorted
ids and order written together). ``moe_unpermute`` sums each token's rows back in one program per (token, column
block), in ascending row order: deterministic, and the CPU reference's float32 sum order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import INTERPRET, pdl_wait, pdl
from .group_rows import permute_rows, stable_positions

SMALL = 1024  # rows up to which the [M, M] comparison (1 M booleans) is cheaper than a radix sort


def stable_order(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [M]: the stable ascending order of ``ids`` (int [M], values in [0, n)) = argsort(ids, stable=True)."""
    ids = ids.reshape(-1).long()
    m = ids.numel()
    if m == 0 or m > SMALL:
        return torch.argsort(ids, stable=True)
    if ids.is_cuda or INTERPRET:  # the same permutation in one launch (group_rows.py)
        return stable_positions(ids)
    idx = torch.arange(m, device=ids.device)
    rank = ((ids.unsqueeze(0) == ids.unsqueeze(1)) & (idx.unsqueeze(0) < idx.unsqueeze(1))).sum(1)
    counts = torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    start = torch.cumsum(counts, 0) - counts
    return torch.empty_like(ids).scatter_(0, start[ids] + rank, idx)


@register("moe_permute", "cuda")
def moe_permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int):
    """Rows of ``x`` [T, d] repeated per routed expert and grouped by expert (stable): (x[order // k] [T k, d],
    sorted expert ids [T k], order [T k]); the reference op's result exactly (atb_ops/reference/routing.py)."""
    k = ids.shape[1]
    if (x.is_cuda or INTERPRET) and 0 < ids.numel() <= SMALL and x.dim() == 2:
        return permute_rows(x, ids)  # one launch (group_rows.py)
    flat = ids.reshape(-1).long()
    order = stable_order(flat, num_experts)
    return x[order // k], flat[order], order


@triton.jit
def _unpermute_kernel(y_ptr, inv_ptr, skip_ptr, out_ptr, k, d, M, BK: tl.constexpr, BD: tl.constexpr,
                      FIND: tl.constexpr, BM: tl.constexpr, SKIP: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, cols] = ((0 + y[p_0]) + y[p_1]) + ... over token t's rows p_0 < p_1 < ... (ascending, as the
    reference's index_add_ visits them on the CPU), + skip[t, cols] (SKIP), rounded once to out's dtype. FIND: ``inv_ptr`` is the order itself (M <= BM entries) and
    token t's positions are found in it (p with order[p] = t k + j), instead of read from its inverse."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = dd < d
    j = tl.arange(0, BK)
    big = 9223372036854775807
    if FIND:
        q = tl.arange(0, BM)
        o = tl.load(inv_ptr + q, mask=q < M, other=-1)
        hit = (o[None, :] == t * k + j[:, None]) & (j < k)[:, None]
        p = tl.where(j < k, tl.sum(tl.where(hit, q[None, :].to(tl.int64), 0), 1), big)
    else:
        p = tl.load(inv_ptr + t * k + j, mask=j < k, other=big)
    acc = tl.zeros([BD], dtype=tl.float32)
    for _ in range(k):
        pm = tl.min(p, 0)
        acc += tl.load(y_ptr + pm * d + dd, mask=dm, other=0.0).to(tl.float32)
        p = tl.where(p == pm, big, p)
    if SKIP:
        acc += tl.load(skip_ptr + t * d + dd, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * d + dd, acc.to(out_ptr.dtype.element_ty), mask=dm)


@register("moe_unpermute", "cuda")
def moe_unpermute(y: torch.Tensor, order: torch.Tensor, num_tokens: int, skip: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's k expert rows summed back (+ skip), [T, d] in out_dtype (float32 by default): the reference op's
    values, deterministic (each token's rows added in ascending row order in one program, where index_add_ on the
    GPU adds with float atomics in any order; skip after them, one rounding). One launch up to ``SMALL`` rows (each
    program finds its token's rows in the order itself), else three: the inverse permutation (arange, scatter)
    and the sum."""
    d = y.shape[-1]
    out = torch.empty(num_tokens, d, dtype=out_dtype or torch.float32, device=y.device)
    if num_tokens == 0 or y.shape[0] == 0:
        return out.zero_() if skip is None else out.copy_(skip.float())
    k = y.shape[0] // num_tokens
    order = order.reshape(-1).long()
    m = order.numel()
    find = m <= SMALL  # positions found in the order itself: no inverse permutation (two launches fewer)
    inv = order.contiguous() if find else torch.empty_like(order).scatter_(0, order, torch.arange(m, device=order.device))
    bd = min(1024, triton.next_power_of_2(d))
    skc = skip.contiguous() if skip is not None else out
    _unpermute_kernel[(num_tokens, triton.cdiv(d, bd))](y.contiguous(), inv, skc, out, k, d, m,
                                                       BK=max(2, triton.next_power_of_2(k)), BD=bd, FIND=find,
                                                       BM=max(2, triton.next_power_of_2(m)) if find else 2,
                                                       SKIP=skip is not None, **pdl())
    return out
