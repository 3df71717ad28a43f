"""indexer_topk in ONE launch: score programs, then bucket programs, then sort programs of the same grid.

Why: the separate selection kernels of ``indexer_select`` start only when the whole score kernel has ended and
each pays its launch and ramp; here the selection programs of a token start as soon as that token's scores are
complete, in slots that the score programs leave free at the end of the grid.

Grid [T * (SPL + P + Q)] (1D). Each program's FIRST action takes a ticket pid = atomic_add(counter, 1) (buf[0,
2^(HB+1) + 2], zero on entry) and plays the role of that ticket, not of tl.program_id(0); roles by ticket, in this
order (t = ticket % T inside each group):
  score  (T * SPL): ``indexer.score_program`` -- int32 order keys of BPP blocks of BN candidates of token t and
         their top-HB-bit histogram (atomics into buf row t) -- then ticket_s[t] += 1 (release).
  bucket (T * P):   wait for ticket_s[t] == SPL (acquire); the threshold bin b* and S (``indexer_select``: the
         finite keys in bins >= b*) from the histogram; bucket S's keys of candidates [p * RC, (p + 1) * RC) by
         bin: scratch[t, start[b] + slot] (start[b] = keys of S in bins > b, slot from a per-bin atomic counter)
         as int64 composites (key << 32) | (2^32 - 1 - n); then ticket_b[t] += 1.
  sort   (T * Q):   wait for ticket_b[t] == P; q = 0 writes -1 at [|S|, KW). Default: program q sorts the
         segments of the nonempty bins >= b* with index q, q + Q, ... (tl.sort) and writes their entries at
         start[b] + j < KW. ATB_CUDA_INDEXER_FRANK=1 (RANK, ``_rank_slices``, not yet timed on a GPU): program q
         places the keys at scratch positions [s, s + R), s = q * R, (q + Q) * R, ..., each at start[b] + (keys of
         its bin with a larger composite). Either way: descending composite = the reference's order (score desc,
         candidate order on ties).
A token whose S has a bin over SEG keys takes the rank slices whatever FRANK says. |S| > CAP (thousands of equal
scores): no bucketing; sort program 0 runs the exact bit search (``indexer_select._bits_select``), as the rank path.

Why the dynamic ticket: a program waits only on roles with smaller tickets. CUDA does not promise that blocks
are dispatched (or made resident) in blockIdx order, so a wait on a smaller program id could spin forever while
the awaited block is still undispatched behind the resident waiters. A ticket is taken by a program that is
already running, so every smaller ticket belongs to a program that has started (resident or finished); by
induction on the ticket (ticket 0 is a score program, which waits on nothing) every wait ends, whatever the
dispatch order -- the dynamic tile id of decoupled look-back scans (CUB), which likewise does not rely on the
dispatch order. Under TRITON_INTERPRET=1 programs run one after another, tickets equal ids and every wait is
already satisfied. buf [T, 2^(HB+1) + 32] int32 must be zero on entry (histogram, per-bin slot counters, the two
tickets of row t at columns 2^(HB+1) and 2^(HB+1) + 1, the ticket counter at row 0, column 2^(HB+1) + 2):
``topk_fused`` allocates it with torch.zeros on every call, so a CUDA graph replays that memset too. No host
synchronisation, static shapes: CUDA-graph safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import pdl, pdl_wait
from .indexer import score_program
from .indexer_select import I64_MIN, ORD_NEG_INF, _bits_select, _composite, _in_s, key_bin


@triton.jit
def _signal(ptr):
    """ticket += 1 after every warp's earlier stores / atomics (CTA barrier, then a gpu-scope release)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _wait(ptr, target):
    """Spin until the ticket reaches target (acquire), then a CTA barrier so that every warp reads after it."""
    c = tl.atomic_add(ptr, 0, sem="acquire")
    while c < target:
        c = tl.atomic_add(ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _bins(hist_row, KW, CAP, SEG: tl.constexpr, HB: tl.constexpr):
    """b, h (counts), ge (keys in bins >= b), b*, |S|, whether S is bucketed (|S| <= CAP) and whether every bin
    of S fits one sort (<= SEG keys)."""
    b = tl.arange(0, 1 << HB)
    h = tl.load(hist_row + b, cache_modifier=".cg")
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    bstar = tl.max(tl.where(ge >= KW, b, 0), 0)
    ins = b >= bstar
    cnt = tl.sum(tl.where(ins, h, 0), 0)
    return b, h, ge, bstar, cnt, cnt <= CAP, tl.max(tl.where(ins, h, 0), 0) <= SEG


@triton.jit
def _seg_emit(seg, cand_row, out_row, st, ln, KW, C: tl.constexpr):
    """Sort one bin's ln composites (descending) and write the cand rows at out positions st + j < KW."""
    j = tl.arange(0, C)
    v = tl.load(seg + j, mask=j < ln, other=I64_MIN, cache_modifier=".cg")
    v = tl.sort(v, 0, descending=True)
    pos = st + j
    keep = (j < ln) & (pos < KW)
    row = tl.load(cand_row + (4294967295 - (v & 4294967295)), mask=keep, other=-1)
    tl.store(out_row + pos, row, mask=keep)


@triton.jit
def _rank_slices(t, qq, Q, cnt, hist_row, start_row, srow, cand_row, out_row, KW, HB: tl.constexpr, R: tl.constexpr,
                 C: tl.constexpr):
    """Sort program qq (RANK): places the S keys at scratch positions [s, s + R) for s = qq * R, (qq + Q) * R, ...
    at out position start[b] + (keys of its own bin b with a larger composite): no sort, a comparison with the
    bin's segment only (the bins already order the rest)."""
    ii = tl.arange(0, R)
    jc = tl.arange(0, C)
    for base in range(qq * R, cnt, Q * R):
        i = base + ii
        im = i < cnt
        c = tl.load(srow + i, mask=im, other=I64_MIN, cache_modifier=".cg")
        bx = tl.where(im, key_bin((c >> 32).to(tl.int32), HB), 0)
        st = tl.load(start_row + bx, mask=im, other=0, cache_modifier=".cg")
        ln = tl.load(hist_row + bx, mask=im, other=0, cache_modifier=".cg")
        r = tl.zeros([R], dtype=tl.int32)
        for j0 in range(0, tl.max(ln, 0), C):
            jj = j0 + jc
            # default caching: these lines were written before the wait (no stale copy in this SM's L1)
            o = tl.load(srow + st[:, None] + jj[None, :], mask=jj[None, :] < ln[:, None], other=I64_MIN)
            r += tl.sum((o > c[:, None]).to(tl.int32), 1)
        pos = st + r
        keep = im & (pos < KW)
        row = tl.load(cand_row + (4294967295 - (c & 4294967295)), mask=keep, other=-1)
        tl.store(out_row + pos, row, mask=keep)


@triton.jit
def _fused_kernel(q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, buf_ptr, BS, start_ptr, scratch_ptr, out_ptr,
                  T, N, Hi, Di, stride_k, SPL, BPP, KW, P, RC, Q, CAP,
                  BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr,
                  PRE: tl.constexpr, HB: tl.constexpr, CH: tl.constexpr, SEG: tl.constexpr, FCH: tl.constexpr,
                  KP: tl.constexpr, FONE: tl.constexpr, RANK: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                  SWAP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    NB: tl.constexpr = 1 << HB
    # dynamic ticket, not tl.program_id(0): every smaller ticket is held by a started program (module docstring)
    pid = tl.atomic_add(buf_ptr + 2 * NB + 2, 1, sem="relaxed")  # the role waits order the data
    if pid < T * SPL:
        t = (pid % T).to(tl.int64)
        row = buf_ptr + t * BS
        score_program(t, (pid // T) * BPP, q_ptr, w_ptr, k_ptr, cand_ptr, key_ptr, row, N, Hi, Di, stride_k, BPP,
                      BH, BD, BN, PREC, 1, F32, PRE, HB, SWAP)
        _signal(row + 2 * NB)
    elif pid < T * (SPL + P):
        j = pid - T * SPL
        t = (j % T).to(tl.int64)
        row = buf_ptr + t * BS
        _wait(row + 2 * NB, SPL)
        b, h, ge, bstar, cnt, ok, _ = _bins(row, KW, CAP, SEG, HB)
        if ok:
            srow = start_ptr + t * NB
            tl.store(srow + b, ge - h, mask=b >= bstar)  # every bucket program of t stores the same values
            tl.debug_barrier()
            lo = (j // T) * RC
            for off in range(lo, tl.minimum(lo + RC, N), CH):
                n = off + tl.arange(0, CH)
                x = tl.load(key_ptr + t * N + n, mask=n < N, other=ORD_NEG_INF, cache_modifier=".cg")
                sel = _in_s(x, n, N, bstar, HB)
                bx = tl.where(sel, key_bin(x, HB), 0)
                slot = tl.atomic_add(row + NB + bx, 1, mask=sel, sem="relaxed")
                st = tl.load(srow + bx, mask=sel, other=0, cache_modifier=".cg")
                tl.store(scratch_ptr + t * CAP + st + slot, _composite(x, n), mask=sel)
        _signal(row + 2 * NB + 1)
    else:
        j = pid - T * (SPL + P)
        t = (j % T).to(tl.int64)
        qq = j // T
        row = buf_ptr + t * BS
        _wait(row + 2 * NB + 1, P)
        b, h, ge, bstar, cnt, ok, fits = _bins(row, KW, CAP, SEG, HB)
        out_row = out_ptr + t * KW
        if ok:
            if qq == 0:
                jj = tl.arange(0, KP)
                tl.store(out_row + jj, tl.full([KP], -1, tl.int64), mask=(jj >= cnt) & (jj < KW))
            if RANK or not fits:  # a bin over SEG keys (many near-equal scores): rank slices, no sort
                _rank_slices(t, qq, Q, cnt, row, start_ptr + t * NB, scratch_ptr + t * CAP, cand_ptr + t * N,
                             out_row, KW, HB, R, C)
            else:
                m = (b >= bstar) & (h > 0)
                mi = m.to(tl.int32)
                idx = tl.cumsum(mi, 0) - mi  # index of each nonempty bin of S, highest bin last
                for i in range(qq, tl.sum(mi, 0), Q):
                    one = m & (idx == i)
                    st = tl.sum(tl.where(one, ge - h, 0), 0)
                    ln = tl.sum(tl.where(one, h, 0), 0)
                    seg = scratch_ptr + t * CAP + st
                    if ln <= 32:
                        _seg_emit(seg, cand_ptr + t * N, out_row, st, ln, KW, 32)
                    elif ln <= 256:
                        _seg_emit(seg, cand_ptr + t * N, out_row, st, ln, KW, 256)
                    else:
                        _seg_emit(seg, cand_ptr + t * N, out_row, st, ln, KW, SEG)
        elif qq == 0:
            _bits_select(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, CAP, FCH, KP, FONE)


def topk_fused(q, weights, kc, cand, k, hb, tiles=None):
    """fused path: [T, k] int64 cand rows (the op's contract) in one launch. q [T, Hi, Di], weights [T, Hi],
    kc [P, Di] unit stride, cand [T, N] int64 contiguous, 0 < k <= N. ATB_CUDA_INDEXER_P / _Q: bucket / sort
    programs per token; ATB_CUDA_INDEXER_CAP: most keys in S (its last value); ATB_CUDA_INDEXER_FRANK=1: the
    rank-slice sort programs."""
    import os

    import torch

    from . import indexer as ix
    from ._util import INTERPRET, dot_precision, pow2

    t_count, n = cand.shape
    hi, di = q.shape[1], q.shape[2]
    # score programs: one resident wave (the kernel takes 255 registers x 128 threads: 2 programs per SM)
    bn, warps, _, bpp, spl, pre = ix._score_cfg(q.device, n, t_count, tiles, wave=True)
    if not tiles:
        warps = 4  # the whole launch runs at the score programs' warps; its other roles were tuned at 4
    kp = pow2(k, 16)
    caps = os.environ.get("ATB_CUDA_INDEXER_CAP")
    cap = max(int(caps.split(",")[-1]) if caps else 8 * kp, kp)
    seg = min(64 if INTERPRET else 1024, pow2(cap, 32))  # largest bin segment one sort program takes
    ch = min(pow2(n, 16), 32 if INTERPRET else 2048)
    p_env = os.environ.get("ATB_CUDA_INDEXER_P")
    p = int(p_env) if p_env else max(1, triton.cdiv(n, 64 if INTERPRET else 4096))
    rc = triton.cdiv(triton.cdiv(n, p), ch) * ch
    p = triton.cdiv(n, rc)
    nq = int(os.environ.get("ATB_CUDA_INDEXER_Q", 2 if INTERPRET else 8))
    rank = os.environ.get("ATB_CUDA_INDEXER_FRANK", "0") == "1"  # sort programs: bin sorts / rank slices
    fch = min(pow2(n, 16), 64 if INTERPRET else 2048)
    # zeroed on every call (a captured CUDA graph replays the memset): histogram, slot counters, the tickets of
    # each row and, at buf[0, 2^(HB+1) + 2], the counter that hands out the program roles
    buf = torch.zeros(t_count, (2 << hb) + 32, dtype=torch.int32, device=q.device)
    start = torch.empty(t_count, 1 << hb, dtype=torch.int32, device=q.device)
    scratch = torch.empty(t_count, cap, dtype=torch.int64, device=q.device)
    keys = torch.empty(t_count, n, dtype=torch.int32, device=q.device)
    out = torch.empty(t_count, k, dtype=torch.int64, device=q.device)
    f32 = torch.float32 in (q.dtype, kc.dtype) or q.dtype != kc.dtype
    _fused_kernel[(t_count * (spl + p + nq),)](
        q, weights, kc, cand, keys, buf, buf.stride(0), start, scratch, out, t_count, n, hi, di, kc.stride(0), spl, bpp,
        k, p, rc, nq, cap, BH=pow2(hi, 16), BD=pow2(di, 16), BN=bn, PREC=dot_precision(q.dtype, kc.dtype), F32=f32,
        PRE=pre, HB=hb, CH=ch, SEG=seg, FCH=fch, KP=kp, FONE=pow2(n, 16) <= fch, RANK=rank, R=16 if INTERPRET else 128,
        C=8 if INTERPRET else 32, SWAP=ix.score_swap(), num_warps=warps, **pdl())
    return out
