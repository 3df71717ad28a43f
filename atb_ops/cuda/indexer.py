"""Triton lightning-indexer scores + causal top-k with the reference's stable tie order.

``_score_kernel`` (one program per token and block of BN candidates) computes
    score[t, n] = sum_h w[t, h] * ReLU(q[t, h] . k_cache[cand[t, n]])        (float32 accumulation)
and writes one int64 sort key per candidate: the score's order-preserving integer image in the high 32 bits
(-0.0 folded into +0.0) and ``2^32 - 1 - n`` in the low 32 bits, so that equal scores rank by candidate order
(what the reference's stable descending sort gives). Absent candidates get the smallest key. ``torch.topk``
over the keys then selects without ties, on the device and without a host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import mma, dot_precision, pow2

KEY_ABSENT = -(2**63)


@triton.jit
def _score_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, N, Hi, Di, stride_k, BH: tl.constexpr, BD: tl.constexpr,
                  BN: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < Hi
    k_ty = k_ptr.dtype.element_ty
    q = tl.load(q_ptr + (t * Hi + h[:, None]) * Di + d[None, :], mask=hm[:, None] & (d < Di)[None, :],
                other=0.0).to(k_ty)
    w = tl.load(w_ptr + t * Hi + h, mask=hm, other=0.0).to(tl.float32)
    nm = n < N
    rows = tl.load(cand_ptr + t * N + n, mask=nm, other=-1)
    valid = rows >= 0
    keys = tl.load(k_ptr + rows.to(tl.int64)[:, None] * stride_k + d[None, :],
                   mask=valid[:, None] & (d < Di)[None, :], other=0.0)
    dots = mma(q, tl.trans(keys), PREC)  # [BH, BN]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 are one tie
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) | (4294967295 - n.to(tl.int64))
    key = tl.where(valid, key, -9223372036854775807 - 1)
    tl.store(key_ptr + t * N + n, key, mask=nm)


@register("indexer_topk", "cuda")
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, cand: torch.Tensor, topk: int) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi], k_cache [P, Di], cand [T, N] (-1 padding) -> [T, min(topk, N)] int64 rows
    of k_cache (-1 where a token has fewer valid candidates)."""
    t_count, n = cand.shape
    k = min(topk, n)
    if t_count == 0 or k == 0:
        return cand.new_full((t_count, k), -1)
    hi, di = q.shape[1], q.shape[2]
    keys = torch.empty(t_count, n, dtype=torch.int64, device=q.device)
    kc = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    if kc.dtype != q.dtype:
        kc = kc.to(q.dtype)
    bn = 64
    _score_kernel[(t_count, triton.cdiv(n, bn))](q.contiguous(), weights.contiguous(), kc, cand.contiguous(), keys, n,
                                                 hi, di, kc.stride(0), BH=pow2(hi, 16), BD=pow2(di, 16), BN=bn,
                                                 PREC=dot_precision(kc.dtype), num_warps=4)
    vals = torch.topk(keys, k, dim=-1, sorted=True).values
    pos = (4294967295 - (vals & 0xFFFFFFFF)).clamp(0, n - 1)
    picked = cand.gather(1, pos)
    return torch.where(vals == KEY_ABSENT, torch.full_like(picked, -1), picked)
