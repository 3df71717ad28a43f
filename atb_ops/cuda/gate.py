"""Triton MoE router (V4 sqrt-softplus with bias or hash routing; V3 sigmoid with group-limited top-k).

Logits = x @ W^T come from the split-K skinny matmul (float32 products) as its per-split partial sums; one program
per tile of BT tokens adds them up in split order (the skinny matmul's own reduction launch spared: three launches
a call became two), holds all E logits and applies the score function,
the selection (hash table lookup, or iterative arg-max over scores + bias after masking to the ``topk_groups``
groups whose two best biased scores sum highest), then weights = scores[sel] (normalised) * route_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ._skinny import skinny_matmul
from ._util import pow2, pdl_wait, pdl

_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _gate_kernel(logit_ptr, b_ptr, tid_ptr, tok_ptr, wout_ptr, iout_ptr, T, E, S, route_scale,
                 K: tl.constexpr, FUNC: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                 G: tl.constexpr, TG: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                 BK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    e = tl.arange(0, BE)
    em = e < E
    at = logit_ptr + t[:, None].to(tl.int64) * BE + e[None, :]
    acc = tl.load(at, mask=tm[:, None], other=0.0)
    for sp in range(1, S):  # the skinny matmul's partial sums [S, T, BE], in split order
        acc += tl.load(at + sp.to(tl.int64) * T * BE, mask=tm[:, None], other=0.0)
    if FUNC == 0:
        y = tl.exp(tl.minimum(acc, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))  # accurate log(1 + y)
        sp = tl.where(acc > 20.0, acc, log1p)
        scores = tl.sqrt(sp)
    elif FUNC == 1:
        scores = tl.sigmoid(acc)
    else:
        z = tl.where(em[None, :], acc, float("-inf"))
        z = tl.exp(z - tl.max(z, 1)[:, None])
        scores = z / tl.sum(z, 1)[:, None]
    kk = tl.arange(0, BK)
    ids = tl.zeros((BT, BK), tl.int64)
    wts = tl.zeros((BT, BK), tl.float32)
    if HASH:
        tok = tl.load(tok_ptr + t, mask=tm, other=0).to(tl.int64)
        ids = tl.load(tid_ptr + tok[:, None] * K + kk[None, :], mask=tm[:, None] & (kk < K)[None, :], other=0)
        ids = ids.to(tl.int64)
        for j in tl.static_range(K):
            idj = tl.sum(tl.where(kk[None, :] == j, ids, 0), 1)
            wj = tl.sum(tl.where(e[None, :] == idj[:, None], scores, 0.0), 1)
            wts = tl.where(kk[None, :] == j, wj[:, None], wts)
    else:
        sel = scores
        if HAS_BIAS:
            sel = sel + tl.load(b_ptr + e, mask=em, other=0.0)[None, :]
        sel = tl.where(em[None, :], sel, float("-inf"))
        if G > 1:
            EG: tl.constexpr = BE // G
            g3 = tl.reshape(sel, (BT, G, EG))
            top1 = tl.max(g3, 2)
            if EG > 1:
                pos = tl.arange(0, EG)[None, None, :]
                a1 = tl.argmax(g3, 2)
                top2 = tl.max(tl.where(pos == a1[:, :, None], float("-inf"), g3), 2)
                gscore = top1 + top2
            else:
                gscore = top1
            gi = tl.arange(0, G)[None, :]
            keep = tl.zeros((BT, G), tl.int32)
            for _ in tl.static_range(TG):
                ga = tl.argmax(gscore, 1)
                keep = tl.where(gi == ga[:, None], 1, keep)
                gscore = tl.where(gi == ga[:, None], float("-inf"), gscore)
            sel = tl.reshape(tl.where(keep[:, :, None] != 0, g3, float("-inf")), (BT, BE))
        for j in tl.static_range(K):
            a = tl.argmax(sel, 1)
            hit = e[None, :] == a[:, None]
            wj = tl.sum(tl.where(hit, scores, 0.0), 1)
            ids = tl.where(kk[None, :] == j, a[:, None].to(tl.int64), ids)
            wts = tl.where(kk[None, :] == j, wj[:, None], wts)
            sel = tl.where(hit, float("-inf"), sel)
    if NORM:
        wts = wts / tl.sum(wts, 1)[:, None]
    wts = wts * route_scale
    om = tm[:, None] & (kk < K)[None, :]
    tl.store(wout_ptr + t[:, None] * K + kk[None, :], wts, mask=om)
    tl.store(iout_ptr + t[:, None] * K + kk[None, :], ids, mask=om)


@register("moe_gate", "cuda")
def moe_gate(x, weight, bias, topk: int, route_scale: float, tid2eid=None, token_ids=None,
             score_func: str = "sqrtsoftplus", n_groups: int = 1, topk_groups: int = 1, normalize: bool = True):
    """x [T, d], weight [E, d] -> (weights [T, k] fp32, ids [T, k] int64); see :func:`atb_ops.moe_gate`."""
    if score_func not in _FUNCS:
        raise ValueError(f"unknown score_func {score_func!r}")
    t_count, d = x.shape
    n_exp = weight.shape[0]
    w_out = torch.empty(t_count, topk, dtype=torch.float32, device=x.device)
    i_out = torch.empty(t_count, topk, dtype=torch.int64, device=x.device)
    if t_count == 0:
        return w_out, i_out
    hashed = tid2eid is not None
    be = pow2(n_exp, 16)
    if n_groups > 1 and (n_exp % n_groups or be != n_exp or n_groups & (n_groups - 1)):
        raise ValueError(f"moe_gate (cuda): group-limited routing needs a power-of-two number of experts split in "
                         f"a power-of-two number of groups, got E={n_exp}, n_groups={n_groups}")
    bt = 16
    logits, _ = skinny_matmul(x.contiguous(), weight.contiguous(), partials=True)  # [S, T, BE] float32
    _gate_kernel[(triton.cdiv(t_count, bt),)](
        logits, bias.float().contiguous() if bias is not None else logits,
        tid2eid.contiguous() if hashed else logits, token_ids.contiguous() if hashed else logits, w_out, i_out,
        t_count, n_exp, logits.shape[0], float(route_scale), K=topk, FUNC=_FUNCS[score_func],
        HAS_BIAS=bias is not None and not hashed, HASH=hashed, G=n_groups if not hashed else 1, TG=topk_groups, NORM=bool(normalize), BT=bt, BE=be,
        BK=pow2(topk), num_warps=4 if be <= 64 else 8, **pdl())
    return w_out, i_out
