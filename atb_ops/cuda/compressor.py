"""Triton compressor pooling (ascend_dsv4/models/deepseek_v4/README.md §2.3 "Compressor"), as
:func:`atb_ops.compressor_pool`.

One program per (entry, block of BC channels): the entry's K candidate rows are gathered as one [BK, BC] tile
(with overlap, candidates 0..r-1 read the A half [:c] and r..2r-1 the B half [c:] of their rows), absent
candidates (-1) get score -inf, and the softmax over candidates weights the kv values, all in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import register
from ..reference.compressor import compressor_state_write as reference_state_write
from ._util import pow2


@triton.jit
def _pool_kernel(kv_ptr, sc_ptr, cand_ptr, out_ptr, K, W, C, R, OVERLAP: tl.constexpr, BK: tl.constexpr,
                 BC: tl.constexpr):
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
                                                num_warps=4)
    return out


@triton.jit
def _state_write_kernel(kv_ptr, sc_ptr, a_ptr, z_ptr, ape_ptr, pos_ptr, slot_ptr, W, R, s_kv, s_sc, s_a, s_z,
                        BW: tl.constexpr):
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
                                                      zc.stride(0), BW=bw, num_warps=4)
    return None
