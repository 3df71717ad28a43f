"""Triton lightning-indexer scores + causal top-k with the reference's stable tie order.

Math (per token t, candidate n < N; float32 accumulation):
    score[t, n] = sum_h w[t, h] * ReLU(q[t, h] . k_cache[cand[t, n]])        (-inf where cand[t, n] < 0)
and the output lists the k_cache rows of the min(topk, N) largest scores in descending order, equal scores in
candidate order (the reference's stable descending sort), -1 where the score is -inf (absent candidates).

Two kernels, no host synchronisation and no data-dependent shapes (CUDA-graph safe):

``_score_keys_kernel`` (grid [T, S]: S programs per token, each looping over a contiguous range of blocks of BN
candidates with q [Hi, Di] and w [Hi] loaded once) gathers the key rows through ``cand`` (each row read once
from HBM; by default a register-prefetch loop requests block i + 1's rows and block i + 2's ids before block i's
product, PRE=0 leaves the pipelining to Triton), runs the [Hi, Di] x [Di, BN] product on the tensor cores and writes one int32
order key per candidate: the score's order-preserving integer image (-0.0 folded into +0.0, NaN made the positive
quiet NaN that the reference's descending sort puts first), ``ORD_NEG_INF`` for absent candidates.

``_select_kernel`` (one program per token; rows of up to 16384 candidates, longer ones go through torch.topk
over int64 composites, see ``_SELECT_MAX``) finds the k-th largest key by a 32-step MSB-first bit search of
counts (``count(key >= c) >= k``), keeps every key above it and the first ``k - count(key > thr)`` keys equal to
it in candidate order (a prefix count), compacts the k survivors into a [T, KP] int64 scratch row as
``(key << 32) | (2^32 - 1 - n)`` (all distinct; larger = earlier in the reference's order), sorts that row
(bitonic ``tl.sort``, KP = next power of two of k) and writes ``cand[t, n]`` (-1 for -inf keys).

ATB_CUDA_INDEXER=old selects the previous path (int64 keys + torch.topk), kept for side-by-side benchmarks;
ATB_CUDA_INDEXER="BN,WARPS,STAGES,CTAS_PER_SM[,PRE]" overrides the score kernel's tiles (PRE=1: the register
prefetch loop instead of Triton's pipeliner); ATB_CUDA_INDEXER_SEL_WARPS the selection kernel's warps.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._registry import register
from ._util import INTERPRET, mma, dot_precision, pow2, sm_count

KEY_ABSENT = -(2**63)
ORD_NEG_INF_INT = -2139095041  # order key of -inf: bits 0xFF800000 ^ 0x7FFFFFFF as int32
ORD_NEG_INF = tl.constexpr(ORD_NEG_INF_INT)


# ----------------------------------------------------------------------------------------------- previous path
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


def _indexer_topk_old(q, weights, k_cache, cand, topk):
    t_count, n = cand.shape
    k = min(topk, n)
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


# ----------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _score_keys_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, N, Hi, Di, stride_k, BPP, BH: tl.constexpr,
                       BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                       F32: tl.constexpr, PRE: tl.constexpr):
    """key[t, n] (int32) for the BPP blocks of BN candidates starting at block program_id(1) * BPP; the product
    runs in float32 when F32 (either operand float32, or mixed 16-bit dtypes), else in k_cache's 16-bit dtype."""
    t = tl.program_id(0).to(tl.int64)
    blk0 = tl.program_id(1) * BPP
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < Hi
    dm = d < Di
    if F32:
        op_ty = tl.float32
    else:
        op_ty = k_ptr.dtype.element_ty
    q = tl.load(q_ptr + (t * Hi + h[:, None]) * Di + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0).to(op_ty)
    w = tl.load(w_ptr + t * Hi + h, mask=hm, other=0.0).to(tl.float32)
    if PRE:
        # software pipeline in registers: the key rows of block i + 1 and the candidate ids of block i + 2 are
        # requested before block i's product (Triton does not pipeline the gather through ``cand`` itself)
        ar = tl.arange(0, BN)
        n_c = blk0 * BN + ar
        rows_c = tl.load(cand_ptr + t * N + n_c, mask=n_c < N, other=-1)
        keys_c = tl.load(k_ptr + rows_c.to(tl.int64)[:, None] * stride_k + d[None, :],
                         mask=(rows_c >= 0)[:, None] & dm[None, :], other=0.0)
        n_end = tl.minimum((blk0 + BPP) * BN, N)  # this program's candidates end here
        n_n = n_c + BN
        rows_n = tl.load(cand_ptr + t * N + n_n, mask=n_n < n_end, other=-1)
        for i in range(0, BPP):
            keys_n = tl.load(k_ptr + rows_n.to(tl.int64)[:, None] * stride_k + d[None, :],
                             mask=(rows_n >= 0)[:, None] & dm[None, :], other=0.0)
            n_nn = n_n + BN
            rows_nn = tl.load(cand_ptr + t * N + n_nn, mask=n_nn < n_end, other=-1)
            _score_block(q, w, keys_c.to(op_ty), rows_c, n_c, key_ptr + t * N, N, PREC)
            keys_c, rows_c, n_c = keys_n, rows_n, n_n
            rows_n, n_n = rows_nn, n_nn
    else:
        for i in tl.range(0, BPP, num_stages=STAGES):
            n = (blk0 + i) * BN + tl.arange(0, BN)
            rows = tl.load(cand_ptr + t * N + n, mask=n < N, other=-1)
            keys = tl.load(k_ptr + rows.to(tl.int64)[:, None] * stride_k + d[None, :],
                           mask=(rows >= 0)[:, None] & dm[None, :], other=0.0).to(op_ty)
            _score_block(q, w, keys, rows, n, key_ptr + t * N, N, PREC)


@triton.jit
def _score_block(q, w, keys, rows, n, key_row, N, PREC: tl.constexpr):
    """Order keys of one block: keys [BN, BD] gathered rows, rows [BN] (-1 = absent), n [BN] positions."""
    dots = mma(q, tl.trans(keys), PREC)  # [BH, BN]
    dots = tl.where(dots < 0.0, 0.0, dots)  # ReLU (NaN stays NaN, as in torch)
    score = tl.sum(dots * w[:, None], 0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 are one tie
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score != score, 0x7FC00000, bits)  # one NaN, above +inf
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(rows >= 0, ordered, ORD_NEG_INF)
    tl.store(key_row + n, ordered, mask=n < N)


@triton.jit
def _select_kernel(key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, CH: tl.constexpr, KP: tl.constexpr,
                   ONE: tl.constexpr):
    """out[t, :KW] = cand rows of the KW largest keys of token t (ties by candidate order), -1 for -inf keys."""
    t = tl.program_id(0).to(tl.int64)
    base = key_ptr + t * N
    offs = tl.arange(0, CH)
    x = tl.load(base + offs, mask=offs < N, other=-2147483647)  # padding below every real key (>= ORD_NEG_INF)
    # 1) thr = the KW-th largest key: build its unsigned image u = key + 2^31 bit by bit from the top
    thr = tl.zeros([], dtype=tl.int64)
    for i in range(32):
        c = thr | (tl.full([], 1, tl.int64) << (31 - i))
        cs = (c - 2147483648).to(tl.int32)
        if ONE:
            cnt = tl.sum((x >= cs).to(tl.int32), 0)
        else:
            cnt = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
            for off in range(0, N, CH):
                xx = tl.load(base + off + offs, mask=off + offs < N, other=-2147483647)
                cnt += tl.sum((xx >= cs).to(tl.int32), 0)
        thr = tl.where(cnt >= KW, c, thr)
    ts = (thr - 2147483648).to(tl.int32)
    # 2) keep keys > thr and the first KW - count(> thr) keys == thr; compact them in candidate order
    if ONE:
        need_eq = KW - tl.sum((x > ts).to(tl.int32), 0)
    else:
        n_gt = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
        for off in range(0, N, CH):
            xx = tl.load(base + off + offs, mask=off + offs < N, other=-2147483647)
            n_gt += tl.sum((xx > ts).to(tl.int32), 0)
        need_eq = KW - n_gt
    run_eq = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
    run_sel = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
    srow = scratch_ptr + t * KP
    for off in range(0, N, CH):
        if not ONE:
            x = tl.load(base + off + offs, mask=off + offs < N, other=-2147483647)
        eq = (x == ts).to(tl.int32)
        eq_before = run_eq + tl.cumsum(eq, 0) - eq
        sel = (x > ts) | ((eq != 0) & (eq_before < need_eq))
        si = sel.to(tl.int32)
        pos = run_sel + tl.cumsum(si, 0) - si
        comp = (x.to(tl.int64) << 32) | (4294967295 - (off + offs).to(tl.int64))
        tl.store(srow + pos, comp, mask=sel)
        run_eq += tl.sum(eq, 0)
        run_sel += tl.sum(si, 0)
    tl.debug_barrier()
    # 3) order the KW survivors (descending composite = score desc, candidate order asc) and map to rows
    j = tl.arange(0, KP)
    jm = j < KW
    v = tl.load(srow + j, mask=jm, other=-9223372036854775807 - 1, cache_modifier=".cg")
    v = tl.sort(v, 0, descending=True)
    n_sel = 4294967295 - (v & 4294967295)
    row = tl.load(cand_ptr + t * N + n_sel, mask=jm, other=-1)
    row = tl.where((v >> 32) == ORD_NEG_INF, -1, row)
    tl.store(out_ptr + t * KW + j, row, mask=jm)


# ----------------------------------------------------------------------------------------------------- wrapper
def _score_cfg(device, n, t_count):
    """(BN, warps, stages, blocks per program, programs per token, register prefetch) of the score kernel."""
    bn, warps, stages, per_sm, pre = 128, 4, 1, 4, 1  # best of the H100 sweep (scripts/bench_indexer.py)
    env = os.environ.get("ATB_CUDA_INDEXER")
    if env and env != "old":
        vals = [int(v) for v in env.split(",")]
        bn, warps, stages, per_sm = vals[:4]
        pre = vals[4] if len(vals) > 4 else 0
    if INTERPRET:
        bn, stages = 16, 1
    bn = min(bn, pow2(n, 16))
    nblk = triton.cdiv(n, bn)
    splits = min(nblk, max(1, triton.cdiv(per_sm * sm_count(device), t_count)))
    bpp = triton.cdiv(nblk, splits)
    return bn, warps, stages, bpp, triton.cdiv(nblk, bpp), bool(pre)


def score_keys(q, weights, kc, cand):
    """[T, N] int32 order keys of the scores (see the module docstring); kc [P, Di] rows, unit stride."""
    t_count, n = cand.shape
    hi, di = q.shape[1], q.shape[2]
    keys = torch.empty(t_count, n, dtype=torch.int32, device=q.device)
    bn, warps, stages, bpp, splits, pre = _score_cfg(q.device, n, t_count)
    f32 = torch.float32 in (q.dtype, kc.dtype) or q.dtype != kc.dtype
    _score_keys_kernel[(t_count, splits)](q, weights, kc, cand, keys, n, hi, di, kc.stride(0), bpp,
                                          BH=pow2(hi, 16), BD=pow2(di, 16), BN=bn, PREC=dot_precision(q.dtype, kc.dtype),
                                          STAGES=stages, F32=f32, PRE=pre, num_warps=warps)
    return keys


def select_topk(keys, cand, k):
    """[T, k] int64 cand rows of the k largest int32 keys per row (ties in candidate order), -1 for -inf keys."""
    t_count, n = keys.shape
    kp = pow2(k, 16)
    scratch = torch.empty(t_count, kp, dtype=torch.int64, device=keys.device)
    out = torch.empty(t_count, k, dtype=torch.int64, device=keys.device)
    ch_max = 256 if INTERPRET else 16384
    one = pow2(n, 16) <= ch_max
    ch = pow2(n, 16) if one else ch_max // 2
    warps = 8 if ch >= 2048 else 4  # H100, N = 2048 / 16384: 8 warps beat 4 and 16
    warps = int(os.environ.get("ATB_CUDA_INDEXER_SEL_WARPS", warps))
    _select_kernel[(t_count,)](keys, cand, scratch, out, n, k, CH=ch, KP=kp, ONE=one, num_warps=warps)
    return out


@register("indexer_topk", "cuda")
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, cand: torch.Tensor, topk: int) -> torch.Tensor:
    """q [T, Hi, Di] (float32 / bf16), weights [T, Hi] (float), k_cache [P, Di] (float32 / bf16; float32 products
    when either is float32, else bf16 x bf16 products into float32), cand [T, N] int64 (-1 = absent) -> [T, min(topk, N)] int64 rows of k_cache in descending score order
    (ties in candidate order), -1 where a token has fewer valid candidates (module docstring: the math)."""
    t_count, n = cand.shape
    k = min(topk, n)
    if t_count == 0 or k == 0:
        return cand.new_full((t_count, k), -1)
    if os.environ.get("ATB_CUDA_INDEXER") == "old":
        return _indexer_topk_old(q, weights, k_cache, cand, topk)
    kc = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    if kc.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        kc = kc.float()
    cand = cand.contiguous()
    keys = score_keys(q.contiguous(), weights.contiguous(), kc, cand)
    if pow2(n, 16) <= _SELECT_MAX:
        return select_topk(keys, cand, k)
    return _select_torch(keys, cand, k)


# Longest candidate row that the one-program selection keeps in registers. Longer rows (contexts beyond 64K tokens
# at ratio 4) take torch.topk over int64 composites: on the H100 at T=4, N=65536 the chunked selection kernel took
# 200 us against 106 us for torch.topk.
_SELECT_MAX = 256 if INTERPRET else 16384


def _select_torch(keys, cand, k):
    """select_topk through torch.topk: composite (key << 32) | (2^32 - 1 - n) int64 keys are all distinct, so the
    order is the reference's (ties by candidate order)."""
    n = keys.shape[1]
    low = 4294967295 - torch.arange(n, device=keys.device, dtype=torch.int64)
    vals = torch.topk(keys.long() * 4294967296 + low, k, dim=-1, sorted=True).values
    picked = cand.gather(1, 4294967295 - (vals & 4294967295))
    absent = torch.div(vals, 4294967296, rounding_mode="floor") == ORD_NEG_INF_INT
    return torch.where(absent, torch.full_like(picked, -1), picked)
