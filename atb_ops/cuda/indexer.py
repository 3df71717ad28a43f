"""Triton lightning-indexer scores + causal top-k with the reference's stable tie order.

Math (per token t, candidate n < N; float32 accumulation):
    score[t, n] = sum_h w[t, h] * ReLU(q[t, h] . k_cache[cand[t, n]])        (-inf where cand[t, n] < 0)
and the output lists the k_cache rows of the min(topk, N) largest scores in descending order, equal scores in
candidate order (the reference's stable descending sort), -1 where the score is -inf (absent candidates).

Kernels with no host synchronisation and no data-dependent shapes (CUDA-graph safe):

``_score_keys_kernel`` (grid [T, S]: S programs per token, each looping over a contiguous range of blocks of BN
candidates with q [Hi, Di] and w [Hi] loaded once) gathers the key rows through ``cand`` (each row read once
from HBM; by default a register-prefetch loop requests block i + 1's rows and block i + 2's ids before block i's
product, PRE=0 leaves the pipelining to Triton), runs the [BN, Di] x [Di, Hi] product keys @ q^T on the tensor
cores (keys on the MMA's M side, so that each key's weighted sum over heads stays inside one warp: 1.2-1.3x the
whole op at T=32, N >= 8192 on an H200, scripts/bench_results/h200_session18.txt; ATB_CUDA_INDEXER_SWAP=0 gives the
previous q @ keys^T, whose warps split the heads and summed them through shared memory) and writes one int32
order key per candidate: the score's order-preserving integer image (-0.0 folded into +0.0, NaN made the positive
quiet NaN that the reference's descending sort puts first), ``ORD_NEG_INF`` for absent candidates.

With HB > 0 the score kernel also counts, per token, the finite keys per bin of their top HB bits (relaxed atomic
adds into a zeroed [T, 2^HB] buffer). The selections of ``indexer_select`` take the threshold bin from that
histogram and handle only the keys at or above it: ``rank`` buckets them by bin over many programs per token and
places each by its rank inside its bin (no sort); ``hist`` compacts and sorts them in one program per token;
``split`` spreads that compaction over many programs; ``place`` compacts as split, then writes each key at its
rank among them, counted by many programs a token (no sort). All fall back to the exact bit search when the threshold
bin holds too many keys (thousands of exact ties).

ATB_CUDA_INDEXER = "PATH[,BN,WARPS,STAGES,CTAS_PER_SM[,PRE]]" or just the tiles: PATH ``auto`` (default: radix
where it takes the rows, else bits, split or place by the candidate count N, see ``_AUTO_BITS_MAX``), ``fused``
(``indexer_fused``: score, bucket and sort programs in one launch), ``radix`` (``topk_radix``: a CUDA C block per
token, N <= 16384, k <= 2048; counts its own top bits unless ATB_CUDA_INDEXER_RADIX_HIST=1; the fastest path at
every N <= 16384 since session 27's merge sort, see that module), ``rank``, ``hist``,
``split``, ``place``, ``bits`` (the
previous selection: ``_select_kernel``, one program per token finding the k-th largest key by a 32-step MSB-first
bit search of counts; rows over 16384 keys through torch.topk) or ``old`` (the first path: int64 keys +
torch.topk); the tiles override the score kernel's (PRE=1: the register prefetch loop instead of Triton's
pipeliner). ATB_CUDA_INDEXER_HB: histogram bits (12); ATB_CUDA_INDEXER_CAP="CAP1,CAP2": the sort sizes;
ATB_CUDA_INDEXER_SEL_WARPS: the selection kernel's warps; ATB_CUDA_INDEXER_CH: keys per compaction chunk;
ATB_CUDA_INDEXER_R / _C: keys a place program writes / compares per load (powers of two; 64 / 64: the best of 9
pairs, H200; R also sizes the rank path's programs, 128 there);
ATB_CUDA_INDEXER_FIT / _SPLITS: the score kernel's grid (``_score_cfg``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._registry import register
from . import indexer_select as sel
from . import topk_radix
from ._util import INTERPRET, mma, dot_precision, pow2, sm_count, pdl_wait, pdl
from .indexer_select import key_bin

KEY_ABSENT = -(2**63)
ORD_NEG_INF_INT = -2139095041  # order key of -inf: bits 0xFF800000 ^ 0x7FFFFFFF as int32
ORD_NEG_INF = tl.constexpr(ORD_NEG_INF_INT)


# ----------------------------------------------------------------------------------------------- previous path
@triton.jit
def _score_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, N, Hi, Di, stride_k, BH: tl.constexpr, BD: tl.constexpr,
                  BN: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
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
                                                 PREC=dot_precision(kc.dtype), num_warps=4, **pdl())
    vals = torch.topk(keys, k, dim=-1, sorted=True).values
    pos = (4294967295 - (vals & 0xFFFFFFFF)).clamp(0, n - 1)
    picked = cand.gather(1, pos)
    return torch.where(vals == KEY_ABSENT, torch.full_like(picked, -1), picked)


# ----------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _score_keys_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, hist_ptr, HS, N, Hi, Di, stride_k, BPP,
                       BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                       F32: tl.constexpr, PRE: tl.constexpr, HB: tl.constexpr, SWAP: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """key[t, n] (int32) for the BPP blocks of BN candidates starting at block program_id(1) * BPP; the product
    runs in float32 when F32 (either operand float32, or mixed 16-bit dtypes), else in k_cache's 16-bit dtype.
    HB > 0: also counts the finite keys per bin of their top HB bits into hist[t, :2^HB] (row stride HS)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    score_program(t, tl.program_id(1) * BPP, q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, hist_ptr + t * HS, N, Hi, Di,
                  stride_k, BPP, BH, BD, BN, PREC, STAGES, F32, PRE, HB, SWAP)


@triton.jit
def score_program(t, blk0, q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, hist_row, N, Hi, Di, stride_k, BPP,
                  BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                  F32: tl.constexpr, PRE: tl.constexpr, HB: tl.constexpr, SWAP: tl.constexpr = False):
    """One score program: token t (int64), the BPP blocks of BN candidates from block blk0 (also used by
    ``indexer_fused``)."""
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
            _score_block(q, w, keys_c.to(op_ty), rows_c, n_c, key_ptr + t * N, N, PREC, hist_row, HB, SWAP)
            keys_c, rows_c, n_c = keys_n, rows_n, n_n
            rows_n, n_n = rows_nn, n_nn
    else:
        for i in tl.range(0, BPP, num_stages=STAGES):
            n = (blk0 + i) * BN + tl.arange(0, BN)
            rows = tl.load(cand_ptr + t * N + n, mask=n < N, other=-1)
            keys = tl.load(k_ptr + rows.to(tl.int64)[:, None] * stride_k + d[None, :],
                           mask=(rows >= 0)[:, None] & dm[None, :], other=0.0).to(op_ty)
            _score_block(q, w, keys, rows, n, key_ptr + t * N, N, PREC, hist_row, HB, SWAP)


@triton.jit
def _score_block(q, w, keys, rows, n, key_row, N, PREC: tl.constexpr, hist_row, HB: tl.constexpr,
                 SWAP: tl.constexpr = False):
    """Order keys of one block: keys [BN, BD] gathered rows, rows [BN] (-1 = absent), n [BN] positions; HB > 0:
    histogram of their top HB bits (relaxed atomics: only the next kernel reads it). SWAP: the product as
    keys @ q^T [BN, BH] (keys the MMA's M side), so that the sum over heads stays inside a warp."""
    if SWAP:
        dots = mma(keys, tl.trans(q), PREC)  # [BN, BH]
        dots = tl.where(dots < 0.0, 0.0, dots)
        score = tl.sum(dots * w[None, :], 1)
    else:
        dots = mma(q, tl.trans(keys), PREC)  # [BH, BN]
        dots = tl.where(dots < 0.0, 0.0, dots)  # ReLU (NaN stays NaN, as in torch)
        score = tl.sum(dots * w[:, None], 0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 are one tie
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score != score, 0x7FC00000, bits)  # one NaN, above +inf
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(rows >= 0, ordered, ORD_NEG_INF)
    tl.store(key_row + n, ordered, mask=n < N)
    if HB > 0:
        tl.atomic_add(hist_row + key_bin(ordered, HB), 1, mask=(n < N) & (ordered != ORD_NEG_INF), sem="relaxed")


# ----------------------------------------------------------------------------------------------------- wrapper
PATHS = ("auto", "radix", "fused", "rank", "hist", "split", "place", "bits", "old")
DEFAULT_PATH = "auto"
# auto: the fastest path per candidate count N in H100 runs at T = 32 (graph replays): N <= 8192 bits (N = 2048:
# 20.7 us vs rank 24.1; N = 8192: 55.9 vs 57.6, hist 55.6; scripts/bench_results/indexer_select_h100.txt),
# N <= 16384 split, longer rows rank, both on the one-wave score grid (session 11, one run: N = 16384 split 80.0 us
# vs 82.6 on the previous grid, fused 104.7, rank 84.7; N = 65536 rank 258.1 us vs fused 274.3 (the previous
# default), split 339.2; scripts/bench_results/indexer_h100_session11.txt). Since session 19 longer rows take place
# (H200, T = 32, N = 65536, two calls: 183.5 / 181.9 us vs rank 189.0 / 187.9, split 266.7 / 264.6; at N = 16384
# split stays the fastest: 59.5-60.5 us vs place 62.2-63.3; scripts/bench_results/h200_session19.txt). Since
# session 27 auto takes the CUDA C radix selection first (N <= 16384, built, not interpreted): on an H200 it beat
# bits, split and place at every (T, N) timed, T = 1-2048, N = 2048-16384 (h200_session27.txt); these thresholds
# pick the Triton path where it cannot run. The interpreter switches at small N so that CPU tests cover every path.
_AUTO_BITS_MAX, _AUTO_SPLIT_MAX = (64, 128) if INTERPRET else (8192, 16384)


def _mode(n):
    """(selection path, score tiles or None) from ATB_CUDA_INDEXER = "[PATH][,BN,WARPS,STAGES,CTAS_PER_SM[,PRE]]"."""
    parts = [p for p in os.environ.get("ATB_CUDA_INDEXER", "").split(",") if p]
    path = DEFAULT_PATH
    if parts and not parts[0].isdigit():
        path = parts.pop(0)
        if path not in PATHS:
            raise ValueError(f"ATB_CUDA_INDEXER path {path!r} not in {PATHS}")
    return path, ([int(v) for v in parts] or None)


def _fallback(path, n):
    """The Triton selection path for N candidates where ``radix`` / ``auto`` do not take the CUDA C one: auto's
    rule by N (see _AUTO_BITS_MAX); radix: split or place (so the CPU tests of radix cover the split path)."""
    if path == "radix":
        return "split" if n <= _AUTO_SPLIT_MAX else "place"
    return "bits" if n <= _AUTO_BITS_MAX else "split" if n <= _AUTO_SPLIT_MAX else "place"


def _score_cfg(device, n, t_count, tiles=None, wave=False):
    """(BN, warps, stages, blocks per program, programs per token, register prefetch) of the score kernel.

    Programs per token: wave (the fused, rank and split paths): CTAS_PER_SM (2) * SMs / T rounded
    down, one resident wave -- the 4-warp tiles take 255 registers x 128 threads (triton 3.6, sm_90), so 2
    programs fit on an SM (the 8-warp ones of the swapped product take 255 x 256 by ptxas for sm_90a under Triton
    3.9, so one fits: that grid is two waves, and it measured fastest all the same), and the previous rule's extra
    programs run as a short last wave (H100, T=32: score
    kernel alone 210 vs 266 us at N=65536, 57 vs 61 us at N=16384; the rank op 258 vs 312 us at N=65536, the
    split op 80 vs 83 us at N=16384, scripts/bench_results/indexer_h100_session11.txt); else (bits, hist) the
    previous rule, 4 * SMs / T rounded up (not timed with the wave grid). ATB_CUDA_INDEXER_FIT=0/1 forces either rule,
    ATB_CUDA_INDEXER_SPLITS the count itself."""
    fit = os.environ.get("ATB_CUDA_INDEXER_FIT")
    wave = wave if fit not in ("0", "1") else fit == "1"
    # best of the H100 sweeps; with the swapped product 8 warps (H200, session 18, score kernel alone at T=32: N=16384
    # 48.3 -> 38.6 us and N=65536 179 -> 149 us on the wave grid, N=8192 27.8 -> 23.4 and N=2048 6.4 -> 6.5 us on the
    # bits path's grid; the same keys as at 4 warps, whose warpgroups split the keys and not the heads)
    bn, warps, stages, per_sm, pre = 128, 8 if score_swap() else 4, 1, 2 if wave else 4, 1
    if tiles:
        bn, warps, stages, per_sm = tiles[:4]
        pre = tiles[4] if len(tiles) > 4 else 0
    if INTERPRET:
        bn, stages = 16, 1
    bn = min(bn, pow2(n, 16))
    nblk = triton.cdiv(n, bn)
    slots = per_sm * sm_count(device)
    splits = int(os.environ.get("ATB_CUDA_INDEXER_SPLITS", 0)) or (slots // t_count if wave else
                                                                  triton.cdiv(slots, t_count))
    splits = min(nblk, max(1, splits))
    bpp = triton.cdiv(nblk, splits)
    return bn, warps, stages, bpp, triton.cdiv(nblk, bpp), bool(pre)


def _flag(name: str, default: str) -> bool:
    """Environment switch ``name`` = 0 / 1 (``default`` when unset); anything else is a ValueError naming it."""
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


def score_swap() -> bool:
    """Whether the score product runs as keys @ q^T (ATB_CUDA_INDEXER_SWAP, default 1) or as q @ keys^T (=0)."""
    return _flag("ATB_CUDA_INDEXER_SWAP", "1")


def score_keys(q, weights, kc, cand, hist=None, hb=0, tiles=None, wave=False):
    """[T, N] int32 order keys of the scores (see the module docstring); kc [P, Di] rows, unit stride. hist
    [T, >= 2^hb] int32 zeros (hb > 0): receives the per-token count of finite keys per top-hb-bit bin. wave: the
    one-resident-wave grid (``_score_cfg``)."""
    t_count, n = cand.shape
    hi, di = q.shape[1], q.shape[2]
    keys = torch.empty(t_count, n, dtype=torch.int32, device=q.device)
    bn, warps, stages, bpp, splits, pre = _score_cfg(q.device, n, t_count, tiles, wave)
    f32 = torch.float32 in (q.dtype, kc.dtype) or q.dtype != kc.dtype
    hist_arg, hs = (keys, 0) if hist is None or hb == 0 else (hist, hist.stride(0))
    _score_keys_kernel[(t_count, splits)](q, weights, kc, cand, keys, hist_arg, hs, n, hi, di, kc.stride(0), bpp,
                                          BH=pow2(hi, 16), BD=pow2(di, 16), BN=bn, PREC=dot_precision(q.dtype, kc.dtype),
                                          STAGES=stages, F32=f32, PRE=pre, HB=hb if hist is not None else 0,
                                          SWAP=score_swap(), num_warps=warps, **pdl())
    return keys


def select_topk(keys, cand, k):
    """bits path: [T, k] int64 cand rows of the k largest int32 keys per row (ties in candidate order), -1 for -inf
    keys; one program per token (``indexer_select._bits_select``)."""
    t_count, n = keys.shape
    kp = pow2(k, 16)
    scratch = torch.empty(t_count, kp, dtype=torch.int64, device=keys.device)
    out = torch.empty(t_count, k, dtype=torch.int64, device=keys.device)
    ch_max = 256 if INTERPRET else 16384
    one = pow2(n, 16) <= ch_max
    ch = pow2(n, 16) if one else ch_max // 2
    warps = 8 if ch >= 2048 else 4  # H100, N = 2048 / 16384: 8 warps beat 4 and 16
    warps = int(os.environ.get("ATB_CUDA_INDEXER_SEL_WARPS", warps))
    sel._select_kernel[(t_count,)](keys, cand, scratch, out, n, k, CH=ch, KP=kp, ONE=one, num_warps=warps, **pdl())
    return out


def env_pow2(name: str, default: int) -> int:
    """A tile size from environment variable ``name`` (default when unset): a power of two >= 1, else a ValueError
    naming the variable (Triton's ranges need powers of two)."""
    v = os.environ.get(name)
    if v is None:
        return default
    if not v.isdigit() or int(v) < 1 or int(v) & (int(v) - 1):
        raise ValueError(f"{name}={v!r}: expected a power of two >= 1")
    return int(v)


def radix_hist() -> bool:
    """Whether the radix path takes its top-bit counts from the score kernel's histogram (ATB_CUDA_INDEXER_RADIX_HIST
    =1) or counts them in the selection block (=0, default: no zeroed histogram, no atomics in the score kernel;
    the op 1-1.6 us faster at T = 32, N = 2048 / 8192 / 16384 on an H200, scripts/bench_results/h200_session22.txt)."""
    return _flag("ATB_CUDA_INDEXER_RADIX_HIST", "0")


def hist_bits():
    """Top bits per histogram bin (ATB_CUDA_INDEXER_HB; 12 = sign, exponent and 3 mantissa bits of the score)."""
    return int(os.environ.get("ATB_CUDA_INDEXER_HB", 12))


def select_hist(keys, hist, cand, k, hb, split=False):
    """hist / split / place paths (``indexer_select``; split False / True / "place"): [T, k] int64 rows from the
    keys and their histogram."""
    t_count, n = keys.shape
    kp = pow2(k, 16)
    caps = os.environ.get("ATB_CUDA_INDEXER_CAP")  # "CAP1,CAP2": sort sizes of S (powers of two)
    cap1, cap2 = [int(v) for v in caps.split(",")] if caps else (max(16, 2 * kp), 8 * kp)
    cap1, cap2 = max(cap1, kp), max(cap2, cap1)
    scratch = torch.empty(t_count, cap2, dtype=torch.int64, device=keys.device)
    out = torch.empty(t_count, k, dtype=torch.int64, device=keys.device)
    fch = min(pow2(n, 16), 64 if INTERPRET else 2048)  # the exact fallback's chunk
    warps = int(os.environ.get("ATB_CUDA_INDEXER_SEL_WARPS", 8))
    common = dict(CAP1=cap1, CAP2=cap2, FCH=fch, KP=kp, FONE=pow2(n, 16) <= fch)
    ch_env = os.environ.get("ATB_CUDA_INDEXER_CH")  # keys per compaction chunk (a power of two)
    if split:
        ch = min(pow2(n, 16), 32 if INTERPRET else int(ch_env or 2048))
        ctr = hist[:, 1 << hb:]  # [T, 0]: the slot counter, [T, 1]: |S| (written by the compaction)
        sel._compact_kernel[(t_count, triton.cdiv(n, ch))](keys, hist, hist.stride(0), ctr, scratch, n,
                                                           k, cap2, HB=hb, CH=ch, CAP2=cap2, num_warps=4, **pdl())
        if split == "place":
            r = env_pow2("ATB_CUDA_INDEXER_R", 64)  # S entries a program places
            c = env_pow2("ATB_CUDA_INDEXER_C", 64)  # S entries compared with them per load
            r, c = (16, 16) if INTERPRET else (r, c)
            sel._place_kernel[(t_count, triton.cdiv(cap2, r))](keys, ctr, hist.stride(0), cand, scratch, out, n, k,
                                                               cap2, R=r, C=c, CAP2=cap2,
                                                               FCH=fch, KP=kp, FONE=common["FONE"],
                                                               num_warps=4, **pdl())
        else:
            sel._sort_kernel[(t_count,)](keys, hist, hist.stride(0), cand, scratch, out, n, k, cap2, HB=hb, **common,
                                         num_warps=warps, **pdl())
    else:
        ch = min(pow2(n, 16), 64 if INTERPRET else int(ch_env or 4096))
        sel._hist_select_kernel[(t_count,)](keys, hist, hist.stride(0), cand, scratch, out, n, k, cap2, HB=hb, CH=ch,
                                            **common, num_warps=warps, **pdl())
    return out


def select_rank(keys, buf, cand, k, hb):
    """rank path (``indexer_select._bucket_kernel`` + ``_rank_kernel``): [T, k] int64 rows from the keys and
    buf [T, 2^(hb+1) + 32] int32 (histogram filled by the score kernel, the rest zeros)."""
    t_count, n = keys.shape
    kp = pow2(k, 16)
    caps = os.environ.get("ATB_CUDA_INDEXER_CAP")
    cap = int(caps.split(",")[-1]) if caps else 8 * kp  # most keys at or above the threshold bin
    cap = max(cap, kp)
    scratch = torch.empty(t_count, cap, dtype=torch.int64, device=keys.device)
    start = torch.empty(t_count, 1 << hb, dtype=torch.int32, device=keys.device)
    out = torch.empty(t_count, k, dtype=torch.int64, device=keys.device)
    ch = min(pow2(n, 16), 32 if INTERPRET else int(os.environ.get("ATB_CUDA_INDEXER_CH", 2048)))
    r = env_pow2("ATB_CUDA_INDEXER_R", 128)
    r = min(cap, 16 if INTERPRET else r)
    fch = min(pow2(n, 16), 64 if INTERPRET else 2048)
    sel._bucket_kernel[(t_count, triton.cdiv(n, ch))](keys, buf, buf.stride(0), start, scratch, n, k, cap, HB=hb,
                                                      CH=ch, CAP=cap, num_warps=4, **pdl())
    sel._rank_kernel[(t_count, triton.cdiv(cap, r))](keys, buf, buf.stride(0), start, cand, scratch, out, n, k, cap,
                                                     HB=hb, R=r, C=16 if INTERPRET else 32, CAP=cap, FCH=fch, KP=kp,
                                                     FONE=pow2(n, 16) <= fch, num_warps=4, **pdl())
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
    path, tiles = _mode(n)
    if path == "old":
        return _indexer_topk_old(q, weights, k_cache, cand, topk)
    kc = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    if kc.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        kc = kc.float()
    cand = cand.contiguous()
    q, weights = q.contiguous(), weights.contiguous()
    if path in ("auto", "radix"):  # the CUDA C selection (topk_radix) where it takes the rows (auto: not interpreted)
        if (path == "radix" or not INTERPRET) and topk_radix.eligible(cand, k):
            if radix_hist():
                hb = hist_bits()
                hist = torch.zeros(t_count, (1 << hb) + 32, dtype=torch.int32, device=q.device)
                keys = score_keys(q, weights, kc, cand, hist, hb, tiles, wave=True)
                return topk_radix.select(keys, cand, k, hist, hb)
            return topk_radix.select(score_keys(q, weights, kc, cand, tiles=tiles, wave=True), cand, k)
        path = _fallback(path, n)
    if path == "bits":
        keys = score_keys(q, weights, kc, cand, tiles=tiles)
        if pow2(n, 16) <= _SELECT_MAX:
            return select_topk(keys, cand, k)
        return _select_torch(keys, cand, k)
    hb = hist_bits()  # the histogram paths' bin width (the default radix and bits paths above need none)
    if path == "fused":
        from .indexer_fused import topk_fused

        return topk_fused(q, weights, kc, cand, k, hb, tiles)
    if path == "rank":  # histogram, per-bin slot counters, |S|
        buf = torch.zeros(t_count, (2 << hb) + 32, dtype=torch.int32, device=q.device)
        keys = score_keys(q, weights, kc, cand, buf, hb, tiles, wave=True)
        return select_rank(keys, buf, cand, k, hb)
    # per-token bins + the split path's slot counter (column 2^hb); rows padded to 128 bytes
    hist = torch.zeros(t_count, (1 << hb) + 32, dtype=torch.int32, device=q.device)
    keys = score_keys(q, weights, kc, cand, hist, hb, tiles, wave=path in ("split", "place"))
    return select_hist(keys, hist, cand, k, hb, split={"split": True, "place": "place"}.get(path, False))


# bits path: longest candidate row that the one-program selection keeps in registers. Longer rows (contexts beyond
# 64K tokens at ratio 4) take torch.topk over int64 composites: on the H100 at T=4, N=65536 the chunked selection
# kernel took 200 us against 106 us for torch.topk.
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
