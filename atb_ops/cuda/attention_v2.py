"""Sparse attention over gathered rows, second kernel (the default of ``sparse_attention`` / ``mla_decode``
where it measured faster; ``ATB_CUDA_ATTN_IMPL=old`` selects attention.py's kernel).

Same math as attention.py (one softmax over the main set ``idx`` and the extra set ``idx2``, the sink in the
denominator, float32 accumulation, P rounded to the value dtype for P.V). What differs is the work layout:

- one loop over the joined key list (a chunk of BN keys comes from the main or the extra pool, selected per
  chunk), so that Triton's software pipeliner issues the index load and the dependent row gathers of chunk
  c + STAGES - 1 (cp.async straight into shared memory) while chunk c is computed (Triton 3.6, sm_90: at 5
  stages the loop keeps 3 chunks of copies in flight; at 3 it waits for every outstanding copy each chunk);
- TRIM (prefill): the token's index lists are read first and all-absent leading / trailing chunks skipped
  (window slots before position 0, the unfilled tail of a causal top-k);
- a program owns BH heads of one token and DV = BD1 / ND of the ND output-column groups: with ND = 2 each row
  is read by the 2 programs of a token (adjacent program ids, so the second read hits L2), the score uses all
  D1 (+ D2) columns (q . k over the own and the other half) and the accumulator holds BH x DV float32 -- half
  the registers, which is what lets BH = 64 / 128 heads (wgmma-sized tiles) run without spilling;
- split-K (flash-decoding) partials are normalised per split (o_s = acc_s / l_s) and stored in the output
  dtype with float32 (m_s, l_s); the combine re-weights them: o = sum_s 2^(m_s - M) l_s o_s /
  (sum_s 2^(m_s - M) l_s + 2^(sink - M)). For bf16 outputs this rounds o_s once more to bf16 (relative
  2^-9, the size of the final output rounding) and halves the partial traffic of float32 partials. A second
  launch merges them (:func:`_merge_splits_kernel`), or, with ``ATB_CUDA_ATTN_MERGE=kernel``, the split that
  finishes last at its (token, head block, column group) (an arrival counter, zero between launches); see
  :func:`merge_in_kernel` for which measured faster when;
- fewer instructions around the tensor cores (session 12, H100, ``scripts/bench_results/attention_h100_session12.txt``):
  rows addressed by int32 element offsets where the pools hold < 2^31 elements (``ATB_CUDA_ATTN_OFF32`` = auto |
  0 | 1; 0 keeps 64-bit row pointers), absent keys set to -inf by one multiply-add with a 0 / -inf bias per key,
  the output divided by one reciprocal per row instead of a division per element (IEEE division is a
  multi-instruction sequence: 128 of them per thread ended every 64 x 512 tile), no masks where the head block
  and the columns are whole. Together 1-6 % per kernel (T=8 h=64 decode 19.3 -> 18.1 us); with them the 2-stage
  64-key tile of :func:`tile` measured 7-9 % faster than the 3-stage one (session 11, before them: equal).

Shapes: q1 [T, H, D1], q2 [T, H, D2] (V3's rope part, scores only), kv [P, >= D1 + D2] (K = V = row[:D1]),
idx [T, K1] int (-1 = absent, never read), kv2 [P2, ...] / idx2 [T, K2], sink [H] float32 -> out [T, H, D1].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gemm_tc as tc
from ._util import dot_precision, mma, pow2, sm_count, pdl_wait, pdl

LOG2E = 1.4426950408889634


@triton.jit
def _gather_ptrs(rp, rows, stride, cols, OFF32: tl.constexpr):
    """Pointers [len(rows), len(cols)] to columns cols of the pool rows ``rows`` (row stride ``stride`` elements).
    OFF32 (the pool holds < 2^31 elements): int32 element offsets added to the pool's base once per vector;
    else 64-bit row pointers."""
    if OFF32:
        return rp + ((rows.to(tl.int32) * stride)[:, None] + cols[None, :])
    return (rp + rows.to(tl.int64) * stride)[:, None] + cols[None, :]


@triton.jit
def _attn2_kernel(q1_ptr, q2_ptr, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, sink_ptr, out_ptr, part_ptr, ml_ptr, ctr_ptr,
                  T, H, D1, D2, K1, K2, stride_kv, stride_kv2, scale2, chunks_per_split, n_split, n_hb,
                  HAS_Q2: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
                  MERGE: tl.constexpr, SP: tl.constexpr,
                  BH: tl.constexpr, BN: tl.constexpr, DV: tl.constexpr, ND: tl.constexpr, BD2: tl.constexpr,
                  PREC: tl.constexpr, STAGES: tl.constexpr,
                  TRIM: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr, OFF32: tl.constexpr,
                  EVEN_D: tl.constexpr, EVEN_HD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # program id -> (token, split, head block, output-column group), the column group fastest: the ND
    # programs that read the same rows run side by side
    pid = tl.program_id(0)
    dh = pid % ND
    rest = pid // ND
    hb = rest % n_hb
    rest = rest // n_hb
    sp = rest % n_split
    t = (rest // n_split).to(tl.int64)
    h = hb * BH + tl.arange(0, BH)
    hm = h < H
    cv = dh * DV + tl.arange(0, DV)  # own output columns
    cvm = cv < D1
    kv_ty = kv_ptr.dtype.element_ty
    qrow = (t * H + h[:, None]) * D1
    if EVEN_HD:  # whole head block and columns in range: no masks
        q_own = tl.load(q1_ptr + qrow + cv[None, :]).to(kv_ty)
    else:
        q_own = tl.load(q1_ptr + qrow + cv[None, :], mask=hm[:, None] & cvm[None, :], other=0.0).to(kv_ty)
    co = (1 - dh) * DV + tl.arange(0, DV)  # the other group's columns (score only), ND == 2
    com = co < D1
    q_oth = q_own
    if ND == 2:
        q_oth = tl.load(q1_ptr + qrow + co[None, :], mask=hm[:, None] & com[None, :], other=0.0).to(kv_ty)
    d2 = tl.arange(0, BD2)
    q2 = q_own
    if HAS_Q2:
        q2 = tl.load(q2_ptr + (t * H + h[:, None]) * D2 + d2[None, :], mask=hm[:, None] & (d2 < D2)[None, :],
                     other=0.0).to(kv_ty)
    if HAS_SINK and not SPLIT:
        m_i = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BH,), 1.0, tl.float32)
    else:
        m_i = tl.full((BH,), -1.0e30, tl.float32)
        l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, DV), tl.float32)

    # chunk ranges [lo, hi) of the main and the extra list; TRIM: drop leading / trailing all-absent chunks
    # (prefill's early tokens: window slots before position 0, the unfilled tail of the compressed top-k)
    lo1 = 0
    hi1 = tl.cdiv(K1, BN)
    lo2 = 0
    hi2 = 0
    if HAS_EXTRA:
        hi2 = tl.cdiv(K2, BN)
    if TRIM:
        i1 = tl.arange(0, BK1)
        v1 = tl.load(idx_ptr + t * K1 + i1, mask=i1 < K1, other=-1) >= 0
        lo1 = tl.min(tl.where(v1, i1, BK1), 0) // BN
        hi1 = tl.cdiv(tl.max(tl.where(v1, i1 + 1, 0), 0), BN)
        if HAS_EXTRA:
            i2 = tl.arange(0, BK2)
            v2 = tl.load(idx2_ptr + t * K2 + i2, mask=i2 < K2, other=-1) >= 0
            lo2 = tl.min(tl.where(v2, i2, BK2), 0) // BN
            hi2 = tl.cdiv(tl.max(tl.where(v2, i2 + 1, 0), 0), BN)
    n1 = tl.maximum(hi1 - lo1, 0)
    nc = n1 + tl.maximum(hi2 - lo2, 0)
    c_lo = sp * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, nc)
    nn = tl.arange(0, BN)
    for c in tl.range(c_lo, c_hi, num_stages=STAGES):
        # the chunk's pool: main (c < n1) or extra; scalar selects keep one loop for the pipeliner
        if HAS_EXTRA:
            main = c < n1
            n = tl.where(main, lo1 + c, lo2 + c - n1) * BN + nn
            lim = tl.where(main, K1, K2)
            ip = tl.where(main, idx_ptr + t * K1, idx2_ptr + t * K2)
            rp = tl.where(main, kv_ptr, kv2_ptr)
            stride = tl.where(main, stride_kv, stride_kv2)
        else:
            n = (lo1 + c) * BN + nn
            lim = K1
            ip = idx_ptr + t * K1
            rp = kv_ptr
            stride = stride_kv
        rows = tl.load(ip + n, mask=n < lim, other=-1)
        valid = rows >= 0
        kmask = valid[:, None] if EVEN_D else valid[:, None] & cvm[None, :]
        k_own = tl.load(_gather_ptrs(rp, rows, stride, cv, OFF32), mask=kmask, other=0.0)
        s = mma(q_own, tl.trans(k_own), PREC)
        if ND == 2:
            k_oth = tl.load(_gather_ptrs(rp, rows, stride, co, OFF32), mask=valid[:, None] & com[None, :], other=0.0)
            s += mma(q_oth, tl.trans(k_oth), PREC)
        if HAS_Q2:
            k2 = tl.load(_gather_ptrs(rp, rows, stride, D1 + d2, OFF32), mask=valid[:, None] & (d2 < D2)[None, :],
                         other=0.0)
            s += mma(q2, tl.trans(k2), PREC)
        # absent keys (k = 0 rows) to -inf: one fused multiply-add with a 0 / -inf bias per key
        s = s * scale2 + tl.where(valid, 0.0, float("-inf"))[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(kv_ty), k_own, PREC)
        m_i = m_new

    # one reciprocal per row, then multiplies: a division per element (IEEE div.rn, a multi-instruction sequence)
    # made the epilogue of a 64 x 512 tile a large share of a short program's instructions
    o = acc * (1.0 / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if SPLIT:
        off = (sp * T + t) * H + h
        tl.store(ml_ptr + off * 2, m_i, mask=hm)
        tl.store(ml_ptr + off * 2 + 1, l_i, mask=hm)
        tl.store(part_ptr + off[:, None] * D1 + cv[None, :], o.to(part_ptr.dtype.element_ty),
                 mask=hm[:, None] & cvm[None, :])
        if MERGE:  # the split that arrives last at (token, head block, column group) merges them all
            tl.debug_barrier()
            cp = ctr_ptr + (t * n_hb + hb) * ND + dh
            if tl.atomic_add(cp, 1, sem="acq_rel") == n_split - 1:
                _merge_splits(part_ptr, ml_ptr, sink_ptr, out_ptr, t, h, hm, cv, cvm, T, H, D1, n_split, HAS_SINK,
                              BH, DV, SP)
                tl.atomic_xchg(cp, 0)  # zero again for the next launch
    elif EVEN_HD:
        tl.store(out_ptr + (t * H + h[:, None]) * D1 + cv[None, :], o.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + (t * H + h[:, None]) * D1 + cv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None] & cvm[None, :])


@triton.jit
def _merge_splits(part_ptr, ml_ptr, sink_ptr, out_ptr, t, h, hm, cv, cvm, T, H, D1, n_split, HAS_SINK: tl.constexpr,
                  BH: tl.constexpr, DV: tl.constexpr, SP: tl.constexpr):
    """Merge the key-list splits of heads h [BH] and output columns cv [DV] of token t, whose partials are
    normalised (o_s = acc_s / l_s): out = sum_s w_s l_s o_s / (sum_s w_s l_s + 2^(sink - M)), w_s = 2^(m_s - M),
    M = max(m_s, sink); the partials are added in split order (the result does not depend on which split arrived
    last). Every split's (m_s, l_s) comes in one load of [SP >= n_split, BH] (was a loop of n_split dependent
    round trips before the partials' loop). The partials stay a loop, one [BH, DV] tile live at a time: this code
    is inlined into the attention kernel, whose register allocation it must not raise (unrolled over the splits it
    spilled: 18 -> 48 us a layer at batch 8, scripts/bench_results/decode_h100_session9.txt). The partials of the
    other programs are read past L1 (.cg): they were written by other SMs."""
    sp = tl.arange(0, SP)
    off = (sp[:, None] * T + t) * H + h[None, :]  # [SP, BH]
    msk = (sp < n_split)[:, None] & hm[None, :]
    m_s = tl.load(ml_ptr + off * 2, mask=msk, other=-1.0e30, cache_modifier=".cg")
    l_s = tl.load(ml_ptr + off * 2 + 1, mask=msk, other=0.0, cache_modifier=".cg")
    mx = tl.max(m_s, 0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        mx = tl.maximum(mx, sink2)
    w = tl.exp2(m_s - mx[None, :]) * l_s  # [SP, BH]; 0 for the absent splits
    den = tl.sum(w, 0)
    if HAS_SINK:
        den += tl.exp2(sink2 - mx)
    acc = tl.zeros((BH, DV), tl.float32)
    for s in range(0, n_split):
        w_j = tl.sum(tl.where(sp[:, None] == s, w, 0.0), 0)  # row s of w, from registers
        row = (s * T + t) * H + h
        o_s = tl.load(part_ptr + row[:, None] * D1 + cv[None, :], mask=hm[:, None] & cvm[None, :], other=0.0,
                      cache_modifier=".cg")
        acc += o_s.to(tl.float32) * w_j[:, None]
    o = acc * (1.0 / tl.where(den > 0, den, 1.0))[:, None]  # reciprocal per row (see _attn2_kernel)
    tl.store(out_ptr + (t * H + h[:, None]) * D1 + cv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & cvm[None, :])


@triton.jit
def _merge_splits_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, T, H, D1, n_split, n_hb, HAS_SINK: tl.constexpr,
                         BH: tl.constexpr, DV: tl.constexpr, ND: tl.constexpr, SP: tl.constexpr,
                         PDL: tl.constexpr = False):
    """:func:`_merge_splits` as a launch of its own (``ATB_CUDA_ATTN_MERGE=launch``), one program per (token, head
    block, column group) of the attention launch, in the same program-id order."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    dh = pid % ND
    rest = pid // ND
    hb = rest % n_hb
    t = (rest // n_hb).to(tl.int64)
    h = hb * BH + tl.arange(0, BH)
    cv = dh * DV + tl.arange(0, DV)
    _merge_splits(part_ptr, ml_ptr, sink_ptr, out_ptr, t, h, h < H, cv, cv < D1, T, H, D1, n_split, HAS_SINK,
                  BH, DV, SP)


@triton.jit
def combine_splits_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, T, H, D1, PS, n_split, HAS_SINK: tl.constexpr,
                          BS: tl.constexpr, BD1: tl.constexpr, PDL: tl.constexpr = False):
    """Merge attention.py's key-list splits of one (token, head), whose partials a_s [PS columns per row] are the
    un-normalised float32 accumulators: out = sum_s w_s a_s / (sum_s w_s l_s + 2^(sink - M)), w_s = 2^(m_s - M),
    M = max(m_s, sink). (This module's partials are normalised: :func:`_merge_splits`.)"""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BS)
    sm = s < n_split
    off = (s * T + t) * H + h
    m_s = tl.load(ml_ptr + off * 2, mask=sm, other=-1.0e30)
    l_s = tl.load(ml_ptr + off * 2 + 1, mask=sm, other=0.0)
    m = tl.max(m_s, 0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    w = tl.exp2(m_s - m)
    den = tl.sum(w * l_s, 0)
    if HAS_SINK:
        den += tl.exp2(sink2 - m)
    d = tl.arange(0, BD1)
    a_s = tl.load(part_ptr + off[:, None] * PS + d[None, :], mask=sm[:, None] & (d < D1)[None, :], other=0.0)
    o = tl.sum(a_s.to(tl.float32) * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (t * H + h) * D1 + d, o.to(out_ptr.dtype.element_ty), mask=d < D1)

def tile(h_count: int, d1: int, d2: int, elem: int, t_count: int, n_keys: int, n_sm: int):
    """(BH heads per program, BN keys per chunk, ND column groups, warps, pipeline stages, trim (-1 = auto),
    programs per SM assumed when sizing the key-list split).

    ``ATB_CUDA_ATTN2="BH,BN,ND,WARPS,STAGES[,TRIM[,CTAS]]"`` overrides (benchmarks, tests). Defaults (H100 sweeps:
    scripts/bench_results/attention_h100.txt, decode_h100_session11.txt, attention_h100_session12.txt):

    - 64 heads x 512 columns, 64-key chunks, 8 warps, 2 stages: prefill (from 256 tokens) at every head count,
      decode at h = 64 and V3's MLA (rope part). Compiled with 2 stages its 197,120 B of shared memory hold two
      64 KB key stages and, by their size, the 64 KB query tile, and it spills less (32 -> 14 registers at h = 64,
      where 3 stages spent the shared memory on a third key stage and kept the query in registers); after session 12's
      int32 row offsets and per-row reciprocal it measured, against the 3-stage 64-key tile / the 32-key tiles:
      T=2048 one sequence h=64 202-203 -> 218-219 TFLOP/s, h=128 204 -> 219; distinct rows h=64 203-205 -> 214
      (67 % of HBM), h=128 235 -> 230-231 (the one loss, kept for the one-sequence gain); decode T=128 h=64
      55.4-56.1 -> 59.0-59.6 % of HBM; V3 MLA T=32 x 4096 keys 205-208 -> 223-224 TFLOP/s;
    - h >= 128 decode without a rope part: 128 heads x 256 columns (a warpgroup per 64 heads), 32-key chunks,
      5 stages (the 64-head tile measured 212 against 232-237 TFLOP/s at T=128);
    - while those programs would fill less than half the SMs (decode of a few tokens over <= 2048 keys): 64 heads
      x 256 columns on 4 warps with the key list split (flash-decoding; the 64-key tile measured 20-35 % slower
      at T = 8 / 32);
    - h < 64 decode (tensor-parallel head shards): h heads x 512 columns, 32-key chunks, 5 stages (not re-measured).
    """
    env = os.environ.get("ATB_CUDA_ATTN2")
    if env:
        v = [int(x) for x in env.split(",")] + [-1, 1][len(env.split(",")) - 5:]
        if v[2] not in (1, 2):  # the score reads the own and at most one other column group (_attn2_kernel)
            raise ValueError(f"ATB_CUDA_ATTN2={env!r}: ND (the third field, output-column groups) must be 1 or 2")
        return max(16, min(v[0], pow2(h_count, 16))), v[1], v[2], v[3], v[4], v[5], v[6]
    bd1, hp = pow2(d1, 16), pow2(h_count, 16)
    if elem > 2:  # float32 operands (tests, exact mode): tiles that fit shared memory at 4 bytes an element
        return min(32, hp), 16, (2 if bd1 >= 256 else 1), 4, 3, -1, 1
    if bd1 < 256:
        return min(64, hp), 32, 1, 4, 3, -1, 1
    if t_count >= 256 or hp == 64 or (hp >= 128 and d2):
        big = (min(64, hp), 64, 1, 8, 2, -1, 1)
    elif hp >= 128:
        big = (128, 32, 2, 8, 5, -1, 1)
    else:
        big = (hp, 32, 1, 8, 5, -1, 1)
    if t_count * triton.cdiv(h_count, big[0]) * big[2] * 2 < n_sm and n_keys <= 2048:
        return min(64, hp), 32, 2, 4, 5, -1, 1
    return big


_STAGES: dict = {}  # launch configuration -> the pipeline depth that fit


def key_splits(nc: int, slots: int, programs: int) -> tuple[int, int]:
    """(splits, chunks per split) of a key list of ``nc`` chunks: split only while the ``programs`` fill fewer than
    ``slots`` resident programs (at most 32 splits), every split non-empty (also used by attention_wgmma.py)."""
    n_split = max(1, min(nc, 32, slots // programs)) if nc else 1
    cps = max(1, triton.cdiv(nc, n_split))
    return max(1, triton.cdiv(nc, cps)), cps


def merge_in_kernel() -> bool:
    """Whether key-list splits are merged by the split that finishes last (an arrival counter per token, head
    block and column group; ``ATB_CUDA_ATTN_MERGE=kernel``) or by a separate launch of the same merge
    (:func:`_merge_splits_kernel`, ``=launch``). Default ``launch``: session 5 chose ``kernel`` when the merge read
    each split's (m, l) in a loop of dependent loads (the launch then cost 11-12 us a layer at batch 32,
    scripts/bench_results/decode_h100_session5.txt); with those in one load (session 9) the launch is the faster:
    the H100 FP8 step's graph replay at batch 8 / 32, alternated twice in one call, 1.68-1.69 / 2.11 ms against
    1.70 / 2.13 ms, the op alone at T = 8 / 32 19.3 / 26.7 us against 20.0 / 28.5 us
    (scripts/bench_results/decode_h100_session9.txt); the in-kernel merge also lengthens the attention kernel's
    own tail and register allocation."""
    v = os.environ.get("ATB_CUDA_ATTN_MERGE", "launch")
    if v not in ("kernel", "launch"):
        raise ValueError(f"ATB_CUDA_ATTN_MERGE={v!r}: expected kernel or launch")
    return v == "kernel"


def run(q1, q2, kv, idx, kv2, idx2, sink, scale, out_dtype):
    """The op on the v2 kernel (arguments as attention.py's ``_run``)."""
    t_count, h_count, d1 = q1.shape
    d2 = 0 if q2 is None else q2.shape[-1]
    out = torch.empty(t_count, h_count, d1, dtype=out_dtype, device=q1.device)
    if t_count == 0:
        return out
    k1 = idx.shape[-1]
    has_extra = kv2 is not None and idx2 is not None and idx2.shape[-1] > 0
    k2 = idx2.shape[-1] if has_extra else 0
    n_sm = sm_count(q1.device)
    bh, bn, nd, warps, stages, trim, ctas = tile(h_count, d1, d2, max(q1.element_size(), kv.element_size()), t_count,
                                                 k1 + k2, n_sm)
    bd1 = pow2(d1, 16)
    nd = nd if bd1 // nd >= 16 else 1
    dv = bd1 // nd
    nc = triton.cdiv(k1, bn) + triton.cdiv(k2, bn)
    n_hb = triton.cdiv(h_count, bh)
    programs = t_count * n_hb * nd
    # split the key list only while the programs fill less than one wave (ctas programs per SM)
    n_split, cps = key_splits(nc, ctas * n_sm, programs)
    split = n_split > 1
    # trimming reads the token's whole index lists first: worth it for prefill (many programs, -1 tails)
    if trim < 0:
        trim = t_count >= 256
    trim = bool(trim) and not split and max(k1, k2) <= 1024
    kvc = kv.contiguous()
    kv2c = kv2.contiguous() if has_extra else kvc
    q1c = q1.contiguous()
    q2c = q2.contiguous() if q2 is not None else q1c
    idxc = idx.contiguous()
    idx2c = idx2.contiguous() if has_extra else idxc
    sinkc = sink.float().contiguous() if sink is not None else q1c
    ctr = None
    if split:
        part = torch.empty(n_split, t_count, h_count, d1, dtype=out_dtype, device=q1.device)
        ml = torch.empty(n_split, t_count, h_count, 2, dtype=torch.float32, device=q1.device)
        if merge_in_kernel() and programs <= tc.CTR_SIZE:
            ctr = tc._counters(q1.device)  # None while capturing before they exist (then: the merge launch)
    else:
        part = ml = out
    merge = ctr is not None
    off32 = os.environ.get("ATB_CUDA_ATTN_OFF32", "auto")
    if off32 not in ("auto", "0", "1"):
        raise ValueError(f"ATB_CUDA_ATTN_OFF32={off32!r}: expected auto, 0 or 1")
    fits = kvc.numel() < 2**31 and kv2c.numel() < 2**31
    off32 = fits and off32 != "0"
    args = (q1c, q2c, kvc, idxc, kv2c, idx2c, sinkc, out, part, ml, ctr if merge else ml, t_count, h_count, d1, d2,
            k1, k2, kvc.stride(0), kv2c.stride(0), float(scale) * LOG2E, cps, n_split, n_hb)
    meta = dict(HAS_Q2=q2 is not None, HAS_EXTRA=has_extra, HAS_SINK=sink is not None, SPLIT=split, MERGE=merge,
                SP=pow2(n_split), BH=bh, BN=bn,
                DV=dv, ND=nd, BD2=pow2(d2, 16), PREC=dot_precision(kv.dtype, q1.dtype), TRIM=trim,
                BK1=pow2(k1, 16), BK2=pow2(k2, 16), OFF32=off32,
                EVEN_D=dv * nd == d1, EVEN_HD=dv * nd == d1 and n_hb * bh == h_count, num_warps=warps)
    key = (str(q1.dtype), str(kv.dtype), stages, tuple(meta.items()))
    for st in sorted({stages, min(stages, 3), 2}, reverse=True) if key not in _STAGES else [_STAGES[key]]:
        try:  # a tile whose pipeline buffers exceed shared memory: fewer stages (the smem need is compiler-made)
            _attn2_kernel[(programs * n_split,)](*args, STAGES=st, **meta, **pdl())
            _STAGES[key] = st
            break
        except triton.runtime.errors.OutOfResources:
            if st == 2:
                raise
    if split and not merge:
        _merge_splits_kernel[(programs,)](part, ml, sinkc, out, t_count, h_count, d1, n_split, n_hb,
                                          HAS_SINK=sink is not None, BH=bh, DV=dv, ND=nd, SP=pow2(n_split),
                                          num_warps=warps, **pdl())
    return out
