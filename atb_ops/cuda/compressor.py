"""Triton compressor pooling (ascend_dsv4/models/deepseek_v4/README.md §2.3 "Compressor"), as
:func:`atb_ops.compressor_pool`.

One program per (entry, block of BC channels): the entry's K candidate rows are gathered as one [BK, BC] tile
(with overlap, candidates 0..r-1 read the A half [:c] and r..2r-1 the B half [c:] of their rows), absent
candidates (-1) get score -inf, and the softmax over candidates weights the kv values, all in float32.

:func:`compressor_entries` (``compressor_pool.entries_epilogue``, run by :func:`atb_ops.compressor_entries`) is the
model's whole entry path in one launch -- pool, RMSNorm, RoPE, store into the entry pool -- where the op sequence
takes up to six (pool, its float32 -> dtype cast, norm, rope, the cast to the pool dtype, index_copy_) per
compressor (main and indexer) per compressed layer and step. A program holds the full channel vector of its entry,
so the norm's sum of squares needs no second pass; the candidates stream through in chunks with an online softmax.
With few entries (decode: one per token) an entry's candidates are split over several programs, and the last to
finish merges their softmax partials before the epilogue: an HCA entry pools 128 candidates, 16 dependent chunks
in one program, which at 8 entries took 17.6 us on the H100 (FP8 step profile, scripts/bench_results/
decode_h100_session11.txt) for ~4 MB of state rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._registry import register
from ..reference.compressor import compressor_state_write as reference_state_write
from . import gemm_tc as tc
from ._util import pow2, sm_count, tl_dtype, pdl_wait, pdl


@triton.jit
def _pool_kernel(kv_ptr, sc_ptr, cand_ptr, out_ptr, K, W, C, R, OVERLAP: tl.constexpr, BK: tl.constexpr,
                 BC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    k = tl.arange(0, BK)
    rows = tl.load(cand_ptr + m * K + k, mask=k < K, other=-1)
    valid = rows >= 0
    if OVERLAP:
        half = tl.where(k >= R, C, 0)
    else:
        half = k * 0
    offs = rows.to(tl.int64)[:, None] * W + half[:, None] + ch[None, :]
    mask = valid[:, None] & (ch < C)[None, :]
    s = tl.load(sc_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    v = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(s - tl.max(s, 0)[None, :])
    out = tl.sum(e * v, 0) / tl.sum(e, 0)
    tl.store(out_ptr + m * C + ch, out, mask=ch < C)


@register("compressor_pool", "cuda")
def compressor_pool(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool) -> torch.Tensor:
    """kv_state, score_state [S, W]; cand [M, K] (-1 absent) -> [M, c] float32 (c = W/2 with overlap)."""
    m_count, k = cand.shape
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    out = torch.empty(m_count, c, dtype=torch.float32, device=kv_state.device)
    if m_count == 0:
        return out
    bk = pow2(k, 2)
    bc = max(16, min(pow2(c), 8192 // bk))
    _pool_kernel[(m_count, triton.cdiv(c, bc))](kv_state.contiguous(), score_state.contiguous(), cand.contiguous(),
                                                out, k, width, c, k // 2, OVERLAP=bool(overlap), BK=bk, BC=bc,
                                                num_warps=4, **pdl())
    return out


@triton.jit
def _pool_range(kv_ptr, sc_ptr, cand_ptr, m, k_lo, k_hi, K, W, C, RB, ch, cm, OVERLAP: tl.constexpr,
                CH: tl.constexpr, BC: tl.constexpr):
    """Online softmax over entry m's candidates [k_lo, k_hi), CH rows at a time, per channel: (running max, sum of
    exp(score - max), sum of exp(score - max) * kv), float32 [BC] each; -inf / 0 / 0 where none is present."""
    run_max = tl.full((BC,), float("-inf"), tl.float32)
    den = tl.zeros((BC,), tl.float32)
    acc = tl.zeros((BC,), tl.float32)
    for k0 in range(k_lo, k_hi, CH):
        k = k0 + tl.arange(0, CH)
        rows = tl.load(cand_ptr + m * K + k, mask=k < k_hi, other=-1)
        valid = rows >= 0  # absent rows (-1) are never read
        if OVERLAP:
            half = tl.where(k >= RB, C, 0)
        else:
            half = k * 0
        offs = rows.to(tl.int64)[:, None] * W + half[:, None] + ch[None, :]
        mask = valid[:, None] & cm[None, :]
        s = tl.load(sc_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        v = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(s, 0))
        # no present candidate yet in a channel: subtract 0 instead of -inf, so that alpha = p = 0 there (not NaN)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(run_max - safe)
        p = tl.exp(s - safe[None, :])
        den = den * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p * v, 0)
        run_max = new_max
    return run_max, den, acc


@triton.jit
def _entry_epilogue(acc, den, m, ch, cm, w_ptr, pos_ptr, f_ptr, out_ptr, rows_ptr, C, R, s_out, eps,
                    HAS_W: tl.constexpr, DT: tl.constexpr, BC: tl.constexpr):
    """pooled = acc / den, rounded to DT, RMSNorm, RoPE of the last R channels, stored at out[rows[m]]."""
    SH = C % 2
    # all candidates absent: 0 / 0 = NaN, as the reference's empty softmax; padding slots: 0 / 1 = 0
    e = acc / tl.where(cm, den, 1.0)
    e = e.to(DT).to(tl.float32)  # compressor_pool(...).to(dtype)
    y = e * tl.rsqrt(tl.sum(e * e, 0) / C + eps)
    if HAS_W:
        y = tl.load(w_ptr + ch, mask=cm, other=0.0).to(tl.float32) * y
    y = y.to(DT).to(tl.float32)  # rms_norm returns dtype
    # interleaved RoPE of the last R channels: slot pair p holds channels (2p - SH, 2p + 1 - SH), rope pair i
    a, b = tl.split(tl.reshape(y, (BC // 2, 2)))
    i = tl.arange(0, BC // 2) - (C + SH - R) // 2
    rope = (i >= 0) & (i < R // 2)
    ang = tl.load(pos_ptr + m).to(tl.float32) * tl.load(f_ptr + i, mask=rope, other=0.0)
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    a2 = tl.where(rope, a * cs - b * sn, a)
    b2 = tl.where(rope, a * sn + b * cs, b)
    y = tl.reshape(tl.join(a2, b2), (BC,))
    row = tl.load(rows_ptr + m).to(tl.int64)
    tl.store(out_ptr + row * s_out + ch, y.to(DT).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _entries_kernel(kv_ptr, sc_ptr, cand_ptr, w_ptr, pos_ptr, f_ptr, out_ptr, rows_ptr, part_ptr, ctr_ptr, M, K, W,
                    C, RB, R, s_out, eps, k_split, n_split, OVERLAP: tl.constexpr, HAS_W: tl.constexpr,
                    DT: tl.constexpr, CH: tl.constexpr, BC: tl.constexpr, SPLIT: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Grid [M, n_split]: program (m, sp) pools entry m's candidates [sp * k_split, +k_split). SPLIT: it stores
    its (max, sum, weighted sum) [3, BC] at part[sp, m]; the program that arrives last at the entry (an arrival
    counter, reset by it) merges the n_split partials in split order and runs the epilogue."""
    pdl_wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    # register slot j holds channel j - SH: for an odd c the shift puts every rope pair (c-R+2i, c-R+2i+1) at the
    # slots (2p, 2p+1) that the pair split below reads
    SH = C % 2
    ch = tl.arange(0, BC) - SH
    cm = (ch >= 0) & (ch < C)
    k_lo = sp * k_split
    run_max, den, acc = _pool_range(kv_ptr, sc_ptr, cand_ptr, m, k_lo, tl.minimum(k_lo + k_split, K), K, W, C, RB,
                                    ch, cm, OVERLAP, CH, BC)
    if SPLIT:
        j = tl.arange(0, BC)
        at = part_ptr + (sp * M + m) * 3 * BC + j
        tl.store(at, run_max)
        tl.store(at + BC, den)
        tl.store(at + 2 * BC, acc)
        tl.debug_barrier()
        if tl.atomic_add(ctr_ptr + m, 1, sem="acq_rel") == n_split - 1:
            run_max = tl.full((BC,), float("-inf"), tl.float32)
            den = tl.zeros((BC,), tl.float32)
            acc = tl.zeros((BC,), tl.float32)
            for q in range(0, n_split):  # split order: the result does not depend on which split came last
                pq = part_ptr + (q * M + m) * 3 * BC + j
                mq = tl.load(pq, cache_modifier=".cg")
                new_max = tl.maximum(run_max, mq)
                safe = tl.where(new_max == float("-inf"), 0.0, new_max)
                alpha = tl.exp(run_max - safe)
                beta = tl.exp(mq - safe)
                den = den * alpha + tl.load(pq + BC, cache_modifier=".cg") * beta
                acc = acc * alpha + tl.load(pq + 2 * BC, cache_modifier=".cg") * beta
                run_max = new_max
            _entry_epilogue(acc, den, m, ch, cm, w_ptr, pos_ptr, f_ptr, out_ptr, rows_ptr, C, R, s_out, eps, HAS_W,
                            DT, BC)
            tl.atomic_xchg(ctr_ptr + m, 0)  # zero again for the next launch
    else:
        _entry_epilogue(acc, den, m, ch, cm, w_ptr, pos_ptr, f_ptr, out_ptr, rows_ptr, C, R, s_out, eps, HAS_W, DT,
                        BC)


def entry_splits(m_count: int, k: int, ch: int, device: torch.device) -> int:
    """Candidate splits per entry: while the entries alone leave SMs idle (decode: one entry per token, each
    pooling up to 128 candidates -- HCA -- in a chain of CH-row chunks), each entry's candidates are spread over
    programs of at least 2 chunks, aiming at 2 programs per SM. ``ATB_CUDA_ENTRIES_SPLITS`` forces the count."""
    env = os.environ.get("ATB_CUDA_ENTRIES_SPLITS")
    if env and not env.isdigit():
        raise ValueError(f"ATB_CUDA_ENTRIES_SPLITS={env!r}: expected a positive integer (splits per entry)")
    want = int(env) if env else triton.cdiv(2 * sm_count(device), max(m_count, 1))
    return max(1, min(want, triton.cdiv(k, 2 * ch) if not env else k))


def compressor_entries(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool,
                       norm_weight: torch.Tensor | None, norm_eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, out_rows: torch.Tensor) -> None:
    """:func:`atb_ops.compressor_entries` (shapes checked there) in one launch: entry m pools its K candidates
    (chunks of 8, online softmax in float32; split over up to :func:`entry_splits` programs whose partials the last
    one merges in split order), rounds to ``dtype``, RMSNorms (float32, rounded to dtype), rotates the last
    R = 2 * len(inv_freq) channels by positions[m] (float32, rounded to dtype) and stores the row, cast to
    out.dtype, at out[out_rows[m]]. The roundings are those of the op sequence."""
    m_count, k = cand.shape
    if m_count == 0:
        return None
    if out.stride(-1) != 1:  # a column-strided pool (not the model's): rows to a dense buffer, then copied
        dense = torch.empty(m_count, out.shape[1], dtype=out.dtype, device=out.device)
        compressor_entries(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions, inv_freq, dtype,
                           dense, torch.arange(m_count, device=out.device))
        out.index_copy_(0, out_rows, dense)
        return None
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    f = inv_freq.to(device=kv_state.device, dtype=torch.float32).contiguous()
    w = norm_weight.contiguous() if norm_weight is not None else f
    bc = pow2(c + c % 2, 16)
    ch = min(8, pow2(k))
    n_split = entry_splits(m_count, k, ch, kv_state.device)
    ctr = tc._counters(kv_state.device) if 1 < n_split and m_count <= tc.CTR_SIZE else None
    if ctr is None:
        n_split = 1
    k_split = triton.cdiv(k, n_split)
    n_split = triton.cdiv(k, k_split)
    part = torch.empty(n_split, m_count, 3, bc, dtype=torch.float32, device=out.device) if n_split > 1 else f
    _entries_kernel[(m_count, n_split)](kv_state.contiguous(), score_state.contiguous(), cand.contiguous(), w,
                                        positions.contiguous(), f, out, out_rows.contiguous(), part,
                                        f if n_split == 1 else ctr, m_count, k, width, c, k // 2, 2 * f.numel(),
                                        out.stride(0), float(norm_eps), k_split, n_split, OVERLAP=bool(overlap),
                                        HAS_W=norm_weight is not None, DT=tl_dtype(dtype), CH=ch, BC=bc,
                                        SPLIT=n_split > 1, num_warps=8 if bc >= 512 else 4, **pdl())
    return None


compressor_pool.entries_epilogue = compressor_entries  # atb_ops.compressor_entries runs it (one launch)


@triton.jit
def _state_write_kernel(kv_ptr, sc_ptr, a_ptr, z_ptr, ape_ptr, pos_ptr, slot_ptr, W, R, s_kv, s_sc, s_a, s_z,
                        BW: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BW + tl.arange(0, BW)
    m = col < W
    slot = tl.load(slot_ptr + t).to(tl.int64)
    phase = tl.load(pos_ptr + t).to(tl.int64) % R  # positions >= 0 (the op's contract)
    a = tl.load(a_ptr + t * s_a + col, mask=m)
    z = tl.load(z_ptr + t * s_z + col, mask=m).to(tl.float32)
    z += tl.load(ape_ptr + phase * W + col, mask=m).to(tl.float32)
    tl.store(kv_ptr + slot * s_kv + col, a.to(kv_ptr.dtype.element_ty), mask=m)
    tl.store(sc_ptr + slot * s_sc + col, z.to(sc_ptr.dtype.element_ty), mask=m)


@register("compressor_state_write", "cuda")
def compressor_state_write(kv_state, score_state, a, z, ape, positions, slots) -> None:
    """One launch, one program per (token, block of columns): the row of a copied, z + ape[pos mod r] added in float32,
    both stored at the token's pool row. a / z may be row-strided (the halves of a stacked GEMM's output); pools whose
    rows are not contiguous take the reference (index_copy_) path."""
    t_count, w = a.shape
    if t_count == 0:
        return None
    if kv_state.stride(-1) != 1 or score_state.stride(-1) != 1:
        return reference_state_write(kv_state, score_state, a, z, ape, positions, slots)
    ac = a if a.stride(-1) == 1 else a.contiguous()
    zc = z if z.stride(-1) == 1 else z.contiguous()
    bw = min(pow2(w), 1024)
    _state_write_kernel[(t_count, triton.cdiv(w, bw))](kv_state, score_state, ac, zc, ape.float().contiguous(),
                                                      positions.contiguous(), slots.contiguous(), w, ape.shape[0],
                                                      kv_state.stride(0), score_state.stride(0), ac.stride(0),
                                                      zc.stride(0), BW=bw, num_warps=4, **pdl())
    return None
