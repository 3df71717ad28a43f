"""Triton sparse attention over gathered rows (V4 sparse attention with sink; V3 MLA decode).

One kernel, ``_attn_kernel``, serves both ops. A program owns one token t, a block of BH heads and one split
of the token's key list; every key row it gathers is shared by all heads (one KV head), so it is loaded once
per head block. Per chunk of BN keys (rows ``idx[t, n]``, -1 = absent and never read):

    s[h, n] = scale * (q1[h] . row[n, :D1] + q2[h] . row[n, D1:D1+D2])        (float32 accumulation)
    online softmax (base-2 exponent, running max m, running sum l), acc[h] += p[h, n] row[n, :D1]

The key list is the main set ``idx`` followed by the optional extra set ``idx2`` over another row pool (V4's
compressed entries), all in one softmax. V4's sink enters as exp(sink_h) in the denominator (the running
max starts at the sink). When a token's keys are few compared with the GPU (decode), the key list is split
over several programs (flash-decoding) and ``attention_v2.combine_splits_kernel`` merges the partial (m, l, acc)
triples.
P is rounded to the value dtype for the P.V product (as FlashAttention does); accumulation stays float32.

This kernel is the "old" path: attention_v2.py (one pipelined loop, wgmma-sized head tiles, output columns in
groups) serves the ops by default from T x H >= 512 query rows, where it measured faster on an H100;
``ATB_CUDA_ATTN_IMPL=old|new|wgmma|seesaw|auto`` chooses (see ``_use_v2``, ``_use_wgmma`` and ``_use_seesaw``:
attention_wgmma.py's kernel, or its seesaw schedule in attention_seesaw.py, serves V4's bf16 decode batches on sm_90
GPUs where it measured faster).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._registry import register
from . import attention_seesaw, attention_v2, attention_wgmma
from ._util import env_choice, mma, dot_precision, pow2, sm_count, pdl_wait, pdl

LOG2E = 1.4426950408889634


@triton.jit
def _attn_chunk(q1, q2, row_ptr, stride_row, idx_ptr, n0, n_keys, m_i, l_i, acc, scale2, D1, D2,
                HAS_Q2: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, PREC: tl.constexpr):
    n = n0 + tl.arange(0, BN)
    rows = tl.load(idx_ptr + n, mask=n < n_keys, other=-1)
    valid = rows >= 0
    base = rows.to(tl.int64) * stride_row
    d1 = tl.arange(0, BD1)
    k1 = tl.load(row_ptr + base[:, None] + d1[None, :], mask=valid[:, None] & (d1 < D1)[None, :], other=0.0)
    s = mma(q1, tl.trans(k1), PREC)
    if HAS_Q2:
        d2 = tl.arange(0, BD2)
        k2 = tl.load(row_ptr + base[:, None] + D1 + d2[None, :], mask=valid[:, None] & (d2 < D2)[None, :], other=0.0)
        s += mma(q2, tl.trans(k2), PREC)
    s = tl.where(valid[None, :], s * scale2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(k1.dtype), k1, PREC)
    return m_new, l_i, acc


@triton.jit
def _attn_kernel(q1_ptr, q2_ptr, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, sink_ptr, out_ptr, part_ptr, ml_ptr,
                 T, H, D1, D2, K1, K2, stride_kv, stride_kv2, scale2, chunks_per_split,
                 HAS_Q2: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
                 BH: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, PREC: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    h = hb * BH + tl.arange(0, BH)
    hm = h < H
    d1 = tl.arange(0, BD1)
    kv_ty = kv_ptr.dtype.element_ty
    q1 = tl.load(q1_ptr + (t * H + h[:, None]) * D1 + d1[None, :], mask=hm[:, None] & (d1 < D1)[None, :],
                 other=0.0).to(kv_ty)
    q2 = q1
    if HAS_Q2:
        d2 = tl.arange(0, BD2)
        q2 = tl.load(q2_ptr + (t * H + h[:, None]) * D2 + d2[None, :], mask=hm[:, None] & (d2 < D2)[None, :],
                     other=0.0).to(kv_ty)
    if HAS_SINK and not SPLIT:
        m_i = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BH,), 1.0, tl.float32)
    else:
        m_i = tl.full((BH,), -1.0e30, tl.float32)
        l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BD1), tl.float32)

    nc1 = tl.cdiv(K1, BN)
    nc = nc1
    if HAS_EXTRA:
        nc += tl.cdiv(K2, BN)
    c_lo = sp * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, nc)
    for c in range(c_lo, tl.minimum(c_hi, nc1)):
        m_i, l_i, acc = _attn_chunk(q1, q2, kv_ptr, stride_kv, idx_ptr + t * K1, c * BN, K1, m_i, l_i, acc, scale2,
                                    D1, D2, HAS_Q2, BN, BD1, BD2, PREC)
    if HAS_EXTRA:
        for c in range(tl.maximum(c_lo, nc1), c_hi):
            m_i, l_i, acc = _attn_chunk(q1, q2, kv2_ptr, stride_kv2, idx2_ptr + t * K2, (c - nc1) * BN, K2, m_i, l_i,
                                        acc, scale2, D1, D2, HAS_Q2, BN, BD1, BD2, PREC)
    if SPLIT:
        off = (sp * T + t) * H + h
        tl.store(ml_ptr + off * 2, m_i, mask=hm)
        tl.store(ml_ptr + off * 2 + 1, l_i, mask=hm)
        tl.store(part_ptr + off[:, None] * BD1 + d1[None, :], acc, mask=hm[:, None])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (t * H + h[:, None]) * D1 + d1[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None] & (d1 < D1)[None, :])


def _tile(h_count: int, bd1: int, bd2: int, t_count: int = 1, n_keys: int = 0) -> tuple[int, int, int]:
    """(heads per program, keys per chunk, warps); ATB_CUDA_ATTN="BH,BN,WARPS" overrides (benchmarks).

    Measured on an H100 (scripts/bench_results): 64 heads per program (each gathered row loaded once for all
    of them, wgmma-sized tiles) wins from 32 tokens with >= 512 keys (prefill 2x); 16 heads with the key list
    split over more programs wins for a few tokens or short lists."""
    env = os.environ.get("ATB_CUDA_ATTN")
    if env:
        bh, bn, warps = (int(v) for v in env.split(","))
        return max(16, min(bh, pow2(h_count, 16))), bn, warps
    if h_count >= 64 and bd1 + bd2 <= 512 and t_count >= 32 and n_keys >= 512:
        return 64, 32, 8
    bh = 16 if bd1 >= 512 or h_count <= 16 else 32
    bn = 32 if bd1 + bd2 <= 640 else 16
    return bh, bn, 8 if bd1 >= 256 else 4


def _impl() -> str:
    """``ATB_CUDA_ATTN_IMPL``: auto (default) | old | new | wgmma | seesaw; another value is a ValueError naming it."""
    return env_choice("ATB_CUDA_ATTN_IMPL", "auto", ("auto", "old", "new", "wgmma", "seesaw"))


def _use_v2(q1, impl: str) -> bool:
    """Which kernel serves a call: ``ATB_CUDA_ATTN_IMPL`` = ``old`` (this module's kernel), ``new``
    (attention_v2.py) or ``auto`` (default): attention_v2 where it measured faster on an H100
    (scripts/bench_results/attention_h100.txt: from T x H = 512 query rows on), this kernel below (a single
    decode token: its 16-head blocks split over more programs). ``ATB_CUDA_ATTN`` (tile override) implies
    ``old``, ``ATB_CUDA_ATTN2`` ``new``. ``impl``: :func:`_impl`, read once per call by ``_run``."""
    if impl == "old" or (impl == "auto" and os.environ.get("ATB_CUDA_ATTN")):
        return False
    if impl == "new" or os.environ.get("ATB_CUDA_ATTN2"):
        return True
    return q1.shape[0] * q1.shape[1] >= 512


def _use_wgmma(q1, q2, kv, idx, kv2, idx2, out_dtype, impl: str) -> bool:
    """attention_wgmma.py's kernel where it takes the call (V4's shapes in bf16 on an sm_90 GPU,
    :func:`.attention_wgmma.eligible`): always with ``ATB_CUDA_ATTN_IMPL=wgmma``, by default (``auto``, no tile
    override) where it measured faster (:func:`.attention_wgmma.preferred`)."""
    if impl in ("wgmma", "seesaw"):
        return attention_wgmma.eligible(q1, q2, kv, idx, kv2, idx2, out_dtype)
    if impl != "auto" or os.environ.get("ATB_CUDA_ATTN") or os.environ.get("ATB_CUDA_ATTN2"):
        return False
    return (attention_wgmma.preferred(q1.shape[0], q1.shape[1])
            and attention_wgmma.eligible(q1, q2, kv, idx, kv2, idx2, out_dtype))


def _use_seesaw(q1, impl: str) -> bool:
    """For a call on the wgmma path: attention_seesaw.py's schedule, forced by ``ATB_CUDA_ATTN_IMPL=seesaw``, by default
    where :func:`.attention_seesaw.preferred` and it is built, never with ``=wgmma``."""
    if impl != "auto":
        return impl == "seesaw"
    return attention_seesaw.preferred(q1.shape[0], q1.shape[1]) and \
        attention_seesaw.PROGRAM.available(q1.device, min_cc=(9, 0), max_cc=(9, 0))


def _run(q1, q2, kv, idx, kv2, idx2, sink, scale, out_dtype):
    impl = _impl()
    if _use_wgmma(q1, q2, kv, idx, kv2, idx2, out_dtype, impl):
        return attention_wgmma.run(q1, kv, idx, kv2, idx2, sink, scale, sm_count(q1.device),
                                   seesaw=_use_seesaw(q1, impl))
    if _use_v2(q1, impl):
        return attention_v2.run(q1, q2, kv, idx, kv2, idx2, sink, scale, out_dtype)
    t_count, h_count, d1 = q1.shape
    d2 = 0 if q2 is None else q2.shape[-1]
    out = torch.empty(t_count, h_count, d1, dtype=out_dtype, device=q1.device)
    if t_count == 0:
        return out
    k1 = idx.shape[-1]
    has_extra = kv2 is not None and idx2 is not None and idx2.shape[-1] > 0
    k2 = idx2.shape[-1] if has_extra else 0
    bd1, bd2 = pow2(d1, 16), pow2(d2, 16)
    bh, bn, warps = _tile(h_count, bd1, bd2 if d2 else 0, t_count, k1 + k2)
    nc = triton.cdiv(k1, bn) + triton.cdiv(k2, bn)
    hb = triton.cdiv(h_count, bh)
    programs = t_count * hb
    n_split = max(1, min(nc, 64, triton.cdiv(2 * sm_count(q1.device), programs)))
    cps = max(1, triton.cdiv(nc, n_split))
    n_split = max(1, triton.cdiv(nc, cps))
    split = n_split > 1
    kvc = kv.contiguous()
    kv2c = kv2.contiguous() if has_extra else kvc
    q1c = q1.contiguous()
    q2c = q2.contiguous() if q2 is not None else q1c
    idxc = idx.contiguous()
    idx2c = idx2.contiguous() if has_extra else idxc
    sinkc = sink.float().contiguous() if sink is not None else q1c
    if split:
        part = torch.empty(n_split, t_count, h_count, bd1, dtype=torch.float32, device=q1.device)
        ml = torch.empty(n_split, t_count, h_count, 2, dtype=torch.float32, device=q1.device)
    else:
        part = ml = out
    prec = dot_precision(kv.dtype, q1.dtype)
    _attn_kernel[(t_count, hb, n_split)](
        q1c, q2c, kvc, idxc, kv2c, idx2c, sinkc, out, part, ml, t_count, h_count, d1, d2, k1, k2,
        kvc.stride(0), kv2c.stride(0), float(scale) * LOG2E, cps,
        HAS_Q2=q2 is not None, HAS_EXTRA=has_extra, HAS_SINK=sink is not None, SPLIT=split,
        BH=bh, BN=bn, BD1=bd1, BD2=bd2, PREC=prec, num_warps=warps, num_stages=2, **pdl())
    if split:
        attention_v2.combine_splits_kernel[(t_count, h_count)](
            part, ml, sinkc, out, t_count, h_count, d1, bd1, n_split, HAS_SINK=sink is not None,
            BS=pow2(n_split, 2), BD1=bd1, num_warps=4, **pdl())
    return out


@register("sparse_attention", "cuda")
def sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    """q [T, H, D], kv [P, D] (K = V), idx [T, K] (-1 ignored), sink [H] fp32, optional extra_kv [P2, D] /
    extra_idx [T, K2] in the same softmax; returns [T, H, D] in q.dtype (see :func:`atb_ops.sparse_attention`)."""
    if kv.dtype != q.dtype:
        kv = kv.to(q.dtype)
    if extra_kv is not None and extra_kv.dtype != q.dtype:
        extra_kv = extra_kv.to(q.dtype)
    return _run(q, None, kv, idx, extra_kv, extra_idx, sink, scale, q.dtype)


@register("mla_decode", "cuda")
def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
    """Absorbed MLA: q_nope [T, H, C], q_pe [T, H, R], latent rows [P, C + R], idx [T, L] -> [T, H, C]."""
    c, r = q_nope_absorbed.shape[-1], q_pe.shape[-1]
    if latent.shape[-1] != c + r:
        raise ValueError(f"mla_decode: latent last dim {latent.shape[-1]} != C + R = {c} + {r}")
    if latent.dtype != q_nope_absorbed.dtype:
        latent = latent.to(q_nope_absorbed.dtype)
    return _run(q_nope_absorbed, q_pe, latent, idx, None, None, None, scale, q_nope_absorbed.dtype)

