"""Top-k selection of indexer_topk from int32 order keys plus a histogram of their top bits.

Inputs (built by ``indexer._score_keys_kernel``): ``keys`` [T, N] int32, the order-preserving image of each score
(larger key = larger score, ``ORD_NEG_INF`` = absent candidate / -inf score), and ``hist`` [T, 2^HB] int32, the
number of keys != ORD_NEG_INF per bin ``b(key) = (key >> (32 - HB)) + 2^(HB - 1)`` (the top HB bits of the unsigned
image key + 2^31, so bins are ordered like keys). Output: [T, KW] int64, the cand rows of the KW largest keys of each
row, descending, equal keys in candidate order (the reference's stable descending sort), -1 past the finite keys.

The threshold bin b* is the largest b with count(bin >= b) >= KW (0 when fewer than KW keys are finite), so the
selection lies in S = {finite keys in bins >= b*}, |S| = count(bin >= b*) (exact ties and the boundary bin's
spread make |S| > KW). S is compacted as int64 composites ``(key << 32) | (2^32 - 1 - n)`` (all distinct; descending
composite order = the reference's order), sorted in one program per token (bitonic ``tl.sort`` of CAP1 or CAP2
entries) and the first KW are mapped to cand rows. |S| > CAP2 (e.g. thousands of equal scores) falls back to the
exact bit search of ``_bits_select`` (slow, correct).

Three variants (no host synchronisation, static shapes: CUDA-graph safe):
  fused  (``_hist_select_kernel``, grid [T]): one program per token computes b*, compacts S in candidate order
         (prefix sums over chunks of CH keys), sorts and writes.
  split  (``_compact_kernel`` grid [T, ceil(N / CH)] + ``_sort_kernel`` grid [T]): the compaction spread over many
         programs, each reserving its slots with one atomic add on a per-token counter (slot order is
         nondeterministic; the sort makes the result deterministic).
  place  (``_compact_kernel`` as split + ``_place_kernel`` grid [T, CAP2 / R]): no sort; each entry of S is
         written at its rank in S (the number of larger composites), counted by |S| / R programs a token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import pdl_wait

ORD_NEG_INF_INT = -2139095041  # order key of -inf: bits 0xFF800000 ^ 0x7FFFFFFF as int32
ORD_NEG_INF = tl.constexpr(ORD_NEG_INF_INT)
I64_MIN = tl.constexpr(-9223372036854775807 - 1)


@triton.jit
def key_bin(x, HB: tl.constexpr):
    """Histogram bin (top HB bits of key + 2^31) of int32 order keys x."""
    return (x >> (32 - HB)) + (1 << (HB - 1))


@triton.jit
def _threshold(hist_row, KW, HB: tl.constexpr):
    """(b*, |S|): the largest bin b with count(bin >= b) >= KW (0 if none) and count(bin >= b*)."""
    b = tl.arange(0, 1 << HB)
    h = tl.load(hist_row + b)
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys in bins >= b
    bstar = tl.max(tl.where(ge >= KW, b, 0), 0)
    cnt = tl.sum(tl.where(b >= bstar, h, 0), 0)
    return bstar, cnt


@triton.jit
def _in_s(x, n, N, bstar, HB: tl.constexpr):
    """Mask of the keys x (positions n) that belong to S."""
    return (n < N) & (x != ORD_NEG_INF) & (key_bin(x, HB) >= bstar)


@triton.jit
def _composite(x, n):
    return (x.to(tl.int64) << 32) | (4294967295 - n.to(tl.int64))


@triton.jit
def _sort_emit(srow, cand_row, out_row, cnt, KW, CAP: tl.constexpr):
    """Sort the cnt composites of srow (descending) and write the cand rows of the first KW (-1 past cnt)."""
    j = tl.arange(0, CAP)
    v = tl.load(srow + j, mask=j < cnt, other=I64_MIN, cache_modifier=".cg")
    v = tl.sort(v, 0, descending=True)
    n_sel = 4294967295 - (v & 4294967295)
    row = tl.load(cand_row + n_sel, mask=(j < KW) & (j < cnt), other=-1)
    tl.store(out_row + j, row, mask=j < KW)


@triton.jit
def _bits_select(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, CH: tl.constexpr, KP: tl.constexpr,
                 ONE: tl.constexpr):
    """Exact selection of token t by a 32-step MSB-first bit search of counts (any key distribution).

    thr = the KW-th largest key; keeps every key > thr and the first KW - count(> thr) keys == thr in candidate
    order, compacts them into scratch row t (row stride SS >= KP), sorts, writes out[t, :KW]. ONE: the row fits
    one CH chunk and stays in registers."""
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
    srow = scratch_ptr + t * SS
    for off in range(0, N, CH):
        if not ONE:
            x = tl.load(base + off + offs, mask=off + offs < N, other=-2147483647)
        eq = (x == ts).to(tl.int32)
        eq_before = run_eq + tl.cumsum(eq, 0) - eq
        sel = (x > ts) | ((eq != 0) & (eq_before < need_eq))
        si = sel.to(tl.int32)
        pos = run_sel + tl.cumsum(si, 0) - si
        tl.store(srow + pos, _composite(x, off + offs), mask=sel)
        run_eq += tl.sum(eq, 0)
        run_sel += tl.sum(si, 0)
    tl.debug_barrier()
    # 3) order the KW survivors (descending composite = score desc, candidate order asc) and map to rows
    j = tl.arange(0, KP)
    jm = j < KW
    v = tl.load(srow + j, mask=jm, other=I64_MIN, cache_modifier=".cg")
    v = tl.sort(v, 0, descending=True)
    n_sel = 4294967295 - (v & 4294967295)
    row = tl.load(cand_ptr + t * N + n_sel, mask=jm, other=-1)
    row = tl.where((v >> 32) == ORD_NEG_INF, -1, row)
    tl.store(out_ptr + t * KW + j, row, mask=jm)


@triton.jit
def _select_kernel(key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, CH: tl.constexpr, KP: tl.constexpr,
                   ONE: tl.constexpr, PDL: tl.constexpr = False):
    """The bit-search selection alone (one program per token): out[t, :KW] (ATB_CUDA_INDEXER=bits)."""
    pdl_wait(PDL)
    _bits_select(tl.program_id(0).to(tl.int64), key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, KP, CH, KP, ONE)


@triton.jit
def _sort_tiers(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, bstar, cnt,
                CAP1: tl.constexpr, CAP2: tl.constexpr, FCH: tl.constexpr, KP: tl.constexpr, FONE: tl.constexpr):
    """Sort + write token t once S is compacted in scratch row t (CAP1 or CAP2 entries), else the exact fallback."""
    srow = scratch_ptr + t * SS
    if cnt <= CAP1:
        _sort_emit(srow, cand_ptr + t * N, out_ptr + t * KW, cnt, KW, CAP1)
    elif cnt <= CAP2:
        _sort_emit(srow, cand_ptr + t * N, out_ptr + t * KW, cnt, KW, CAP2)
    else:
        _bits_select(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, FCH, KP, FONE)


@triton.jit
def _hist_select_kernel(key_ptr, hist_ptr, HS, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, HB: tl.constexpr,
                        CH: tl.constexpr, CAP1: tl.constexpr, CAP2: tl.constexpr, FCH: tl.constexpr,
                        KP: tl.constexpr, FONE: tl.constexpr, PDL: tl.constexpr = False):
    """fused: one program per token (module docstring)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    bstar, cnt = _threshold(hist_ptr + t * HS, KW, HB)
    if cnt <= CAP2:
        base = key_ptr + t * N
        srow = scratch_ptr + t * SS
        offs = tl.arange(0, CH)
        run = tl.sum(tl.zeros([CH], dtype=tl.int32), 0)
        for off in range(0, N, CH):
            n = off + offs
            x = tl.load(base + n, mask=n < N, other=ORD_NEG_INF)
            sel = _in_s(x, n, N, bstar, HB)
            si = sel.to(tl.int32)
            tl.store(srow + run + tl.cumsum(si, 0) - si, _composite(x, n), mask=sel)
            run += tl.sum(si, 0)
        tl.debug_barrier()
    _sort_tiers(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, bstar, cnt, CAP1, CAP2, FCH, KP,
                FONE)


@triton.jit
def _compact_kernel(key_ptr, hist_ptr, HS, ctr_ptr, scratch_ptr, N, KW, SS, HB: tl.constexpr, CH: tl.constexpr,
                    CAP2: tl.constexpr, PDL: tl.constexpr = False):
    """split / place, step 1: program (t, p) appends the S keys of candidates [p * CH, (p + 1) * CH) to scratch
    row t; program (t, 0) also stores |S| at ctr[t, 1] (read by :func:`_place_kernel`)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    bstar, cnt = _threshold(hist_ptr + t * HS, KW, HB)
    if tl.program_id(1) == 0:
        tl.store(ctr_ptr + t * HS + 1, cnt)
    if cnt <= CAP2:
        n = tl.program_id(1) * CH + tl.arange(0, CH)
        x = tl.load(key_ptr + t * N + n, mask=n < N, other=ORD_NEG_INF)
        sel = _in_s(x, n, N, bstar, HB)
        si = sel.to(tl.int32)
        tot = tl.sum(si, 0)
        if tot > 0:
            slot = tl.atomic_add(ctr_ptr + t * HS, tot, sem="relaxed")
            tl.store(scratch_ptr + t * SS + slot + tl.cumsum(si, 0) - si, _composite(x, n), mask=sel)


@triton.jit
def _sort_kernel(key_ptr, hist_ptr, HS, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, HB: tl.constexpr,
                 CAP1: tl.constexpr, CAP2: tl.constexpr, FCH: tl.constexpr, KP: tl.constexpr, FONE: tl.constexpr,
                 PDL: tl.constexpr = False):
    """split, step 2: one program per token sorts its compacted S (or runs the exact fallback)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    bstar, cnt = _threshold(hist_ptr + t * HS, KW, HB)
    _sort_tiers(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, bstar, cnt, CAP1, CAP2, FCH, KP,
                FONE)


@triton.jit
def _program_slots(out_row, p, cnt, KW, R: tl.constexpr):
    """Output positions [p * R, (p + 1) * R) of a placing program (place / rank): -1 written to those in [cnt, KW)
    (past the |S| = cnt keys); returns them and the mask of those < cnt (the program's keys of S)."""
    i = p * R + tl.arange(0, R)
    tl.store(out_row + i, tl.full([R], -1, tl.int64), mask=(i >= cnt) & (i < KW))
    return i, i < cnt


@triton.jit
def _emit_ranked(out_row, cand_row, c, pos, im, KW):
    """out_row[pos] = the cand row of each composite c (mask im) whose output position pos is < KW."""
    keep = im & (pos < KW)
    row = tl.load(cand_row + (4294967295 - (c & 4294967295)), mask=keep, other=-1)
    tl.store(out_row + pos, row, mask=keep)


@triton.jit
def _place_kernel(key_ptr, ctr_ptr, HS, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, R: tl.constexpr,
                  C: tl.constexpr, CAP2: tl.constexpr, FCH: tl.constexpr, KP: tl.constexpr, FONE: tl.constexpr,
                  PDL: tl.constexpr = False):
    """place, step 2 (grid [T, CAP2 / R]): program p writes the compacted S entries scratch[t, p * R : (p + 1) * R]
    at their rank in S, the count of larger composites (all distinct: the rank is the position in the descending
    composite order, which is the reference's), if it is < KW; output positions [|S|, KW) in its range get -1.
    Replaces the split path's one-program sort by R x |S| comparisons spread over |S| / R programs a token.
    |S| > CAP2: the exact bit-search fallback (program 0)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cnt = tl.load(ctr_ptr + t * HS + 1)
    out_row = out_ptr + t * KW
    if cnt <= CAP2:
        i, im = _program_slots(out_row, p, cnt, KW, R)
        if p * R < cnt:
            srow = scratch_ptr + t * SS
            c = tl.load(srow + i, mask=im, other=I64_MIN, cache_modifier=".cg")
            r = tl.zeros([R], dtype=tl.int32)
            jc = tl.arange(0, C)
            # chunk j + 1 is requested before chunk j is compared (each load is an L2 round trip; the last,
            # past |S|, is fully masked and reads nothing)
            o = tl.load(srow + jc, mask=jc < cnt, other=I64_MIN, cache_modifier=".cg")
            for j0 in range(C, cnt + C, C):
                jj = j0 + jc
                o_next = tl.load(srow + jj, mask=jj < cnt, other=I64_MIN, cache_modifier=".cg")
                r += tl.sum((o[None, :] > c[:, None]).to(tl.int32), 1)
                o = o_next
            _emit_ranked(out_row, cand_ptr + t * N, c, r, im, KW)
    elif p == 0:
        _bits_select(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, FCH, KP, FONE)


# ------------------------------------------------------------------------------- rank path: no sort at all
@triton.jit
def _bucket_kernel(key_ptr, buf_ptr, BS, start_ptr, scratch_ptr, N, KW, SS, HB: tl.constexpr, CH: tl.constexpr,
                   CAP: tl.constexpr, PDL: tl.constexpr = False):
    """rank, step 1 (grid [T, ceil(N / CH)]): bucket the S keys of candidates [p * CH, (p + 1) * CH) by bin.

    buf row t (stride BS, zeroed): [0, 2^HB) the histogram, [2^HB, 2^(HB+1)) per-bin slot counters, then
    (|S|, b*). start[t, b] = keys of S in bins > b (b >= b*), written by every program of the token (identical
    values) and read back after a barrier; a key of bin b goes to scratch[t, start[b] + its slot in the bin]."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    NB: tl.constexpr = 1 << HB
    hist_row = buf_ptr + t * BS
    b = tl.arange(0, NB)
    h = tl.load(hist_row + b)
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys in bins >= b
    bstar = tl.max(tl.where(ge >= KW, b, 0), 0)
    cnt = tl.sum(tl.where(b >= bstar, h, 0), 0)
    if p == 0:
        tl.store(hist_row + 2 * NB, cnt)
    if cnt <= CAP:
        start_row = start_ptr + t * NB
        tl.store(start_row + b, ge - h, mask=b >= bstar)
        tl.debug_barrier()
        n = p * CH + tl.arange(0, CH)
        x = tl.load(key_ptr + t * N + n, mask=n < N, other=ORD_NEG_INF)
        sel = _in_s(x, n, N, bstar, HB)
        bx = tl.where(sel, key_bin(x, HB), 0)
        slot = tl.atomic_add(hist_row + NB + bx, 1, mask=sel, sem="relaxed")
        st = tl.load(start_row + bx, mask=sel, other=0, cache_modifier=".cg")
        tl.store(scratch_ptr + t * SS + st + slot, _composite(x, n), mask=sel)


@triton.jit
def _rank_kernel(key_ptr, buf_ptr, BS, start_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, HB: tl.constexpr,
                 R: tl.constexpr, C: tl.constexpr, CAP: tl.constexpr, FCH: tl.constexpr, KP: tl.constexpr,
                 FONE: tl.constexpr, PDL: tl.constexpr = False):
    """rank, step 2 (grid [T, CAP / R]): program p places the S keys at scratch[t, p * R : (p + 1) * R].

    The output position of a key of bin b is start[b] + (keys of its own bin with a larger composite): a
    comparison with its bin's segment only (bins order the rest). Positions past |S| get -1; |S| > CAP: the exact
    bit-search fallback (program 0)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    NB: tl.constexpr = 1 << HB
    hist_row = buf_ptr + t * BS
    cnt = tl.load(hist_row + 2 * NB)
    out_row = out_ptr + t * KW
    if cnt <= CAP:
        i, im = _program_slots(out_row, p, cnt, KW, R)
        if p * R < cnt:
            srow = scratch_ptr + t * SS
            c = tl.load(srow + i, mask=im, other=I64_MIN)
            bx = tl.where(im, key_bin((c >> 32).to(tl.int32), HB), 0)
            st = tl.load(start_ptr + t * NB + bx, mask=im, other=0)
            ln = tl.load(hist_row + bx, mask=im, other=0)
            r = tl.zeros([R], dtype=tl.int32)
            jc = tl.arange(0, C)
            for j0 in range(0, tl.max(ln, 0), C):
                jj = j0 + jc
                o = tl.load(srow + st[:, None] + jj[None, :], mask=jj[None, :] < ln[:, None], other=I64_MIN)
                r += tl.sum((o > c[:, None]).to(tl.int32), 1)
            _emit_ranked(out_row, cand_ptr + t * N, c, st + r, im, KW)
    elif p == 0:
        _bits_select(t, key_ptr, cand_ptr, scratch_ptr, out_ptr, N, KW, SS, FCH, KP, FONE)
