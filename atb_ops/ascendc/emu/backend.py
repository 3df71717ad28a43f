"""The ``ascendc_emu`` atb_ops backend: compressor_pool, sparse_attention and mla_decode executed by the AscendC
kernel sources (atb_ops/ascendc/kernels) compiled for the host against our emulation of the AscendC API.

Every other op falls back to the reference implementation (logged once by the dispatcher). The attention runs the
cube (Matmul API) variant of the kernel where its shapes allow (channel dims multiples of 16) and the vector variant
otherwise; ``ASCEND_DSV4_ASCENDC_MLA=vector`` or ``=cube`` forces one. The wrappers only adapt
arguments (dtype, contiguity, index validation); all of the math runs in the kernels. Inputs in float32 or bfloat16
go to the kernels as they are; any other float dtype is computed in float32 and returned in its own dtype.
"""

from __future__ import annotations

import os

import torch

from ..._registry import register
from .runner import cube_supported, run_compressor, run_mla

MLA_VARIANTS = ("auto", "vector", "cube")


def use_cube(C: int, R: int) -> bool:
    """Which attention kernel runs: $ASCEND_DSV4_ASCENDC_MLA (auto | vector | cube), auto = cube where supported."""
    mode = os.environ.get("ASCEND_DSV4_ASCENDC_MLA", "auto")
    if mode not in MLA_VARIANTS:
        raise ValueError(f"ASCEND_DSV4_ASCENDC_MLA={mode!r}: expected one of {', '.join(MLA_VARIANTS)}")
    if mode == "cube" and not cube_supported(C, R):
        raise ValueError(f"ASCEND_DSV4_ASCENDC_MLA=cube needs channel dims that are multiples of 16, got C={C}, R={R}")
    return mode == "cube" or (mode == "auto" and cube_supported(C, R))

_NATIVE = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype in _NATIVE else x.float()).contiguous()


def _rows(idx: torch.Tensor, n_rows: int, what: str) -> torch.Tensor:
    idx = idx.to(torch.int64).contiguous()
    if idx.numel() and int(idx.max()) >= n_rows:
        raise IndexError(f"{what}: row index {int(idx.max())} out of range for {n_rows} rows")
    return idx


@register("compressor_pool", "ascendc_emu")
def compressor_pool(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool) -> torch.Tensor:
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    if cand.shape[0] == 0:
        return kv_state.new_zeros((0, c), dtype=torch.float32)
    kv = _native(kv_state)
    score = score_state.to(kv.dtype).contiguous()
    return run_compressor(kv, score, _rows(cand, kv.shape[0], "compressor_pool cand"), overlap).out


def compressor_pool_norm_rope(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool,
                              norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                              inv_freq: torch.Tensor) -> torch.Tensor:
    """The compressor kernel with its fused epilogue: ``apply_rope(rms_norm(compressor_pool(...), norm_weight, eps),
    positions, inv_freq)`` in one launch, float32 throughout (returns float32 [M, c]; the model's three-op sequence
    rounds to the model dtype between the ops). positions: [M] int64, inv_freq: [R/2] float32. What
    :func:`compressor_entries` runs for float32 entries."""
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    if cand.shape[0] == 0:
        return kv_state.new_zeros((0, c), dtype=torch.float32)
    kv = _native(kv_state)
    score = score_state.to(kv.dtype).contiguous()
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)  # [M, R/2], as apply_rope
    return run_compressor(kv, score, _rows(cand, kv.shape[0], "compressor_pool cand"), overlap,
                          norm_weight=norm_weight.float().contiguous(), cos=angles.cos().contiguous(),
                          sin=angles.sin().contiguous(), eps=eps).out


def compressor_entries(kv_state, score_state, cand, overlap: bool, norm_weight, norm_eps: float, positions, inv_freq,
                       dtype: torch.dtype, out: torch.Tensor, out_rows: torch.Tensor) -> None:
    """:func:`atb_ops.compressor_entries` (arguments checked there): the kernel with its fused epilogue where that is
    the op sequence -- float32 entries, whose roundings between the pool, the norm and the rope are no-ops -- the
    pool kernel then the reference norm and rope otherwise (the epilogue computes in float32 throughout)."""
    if dtype != torch.float32 or norm_weight is None:
        from ...ops import compressor_entries_in_sequence

        return compressor_entries_in_sequence(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions,
                                              inv_freq, dtype, out, out_rows)
    e = compressor_pool_norm_rope(kv_state, score_state, cand, overlap, norm_weight, norm_eps, positions, inv_freq)
    out.index_copy_(0, out_rows, e.to(out.dtype))


compressor_pool.entries_epilogue = compressor_entries  # the model's entry path on the epilogue (float32)


def _attention(q, qpe, pools, idxs, sink, scale):
    out_dtype = q.dtype
    qn = _native(q)
    qpe = None if qpe is None else qpe.to(qn.dtype).contiguous()
    kv_dtype = pools[0].dtype if pools[0].dtype in _NATIVE else torch.float32
    pools = [p.to(kv_dtype).contiguous() for p in pools]
    idxs = [_rows(i, p.shape[0], "attention idx") for i, p in zip(idxs, pools)]
    pool1, idx1 = (pools[1], idxs[1]) if len(pools) > 1 else (None, None)
    sink = None if sink is None else sink.float().contiguous()
    cube = use_cube(qn.shape[-1], 0 if qpe is None else qpe.shape[-1])
    return run_mla(qn, qpe, pools[0], idxs[0], pool1, idx1, sink, scale, cube=cube).out.to(out_dtype)


@register("sparse_attention", "ascendc_emu")
def sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    pools, idxs = [kv], [idx]
    if extra_kv is not None and extra_idx is not None and extra_idx.shape[-1] > 0:
        pools.append(extra_kv)
        idxs.append(extra_idx)
    return _attention(q, None, pools, idxs, sink, scale)


@register("mla_decode", "ascendc_emu")
def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
    t_count, h_count, c = q_nope_absorbed.shape
    r = q_pe.shape[-1]
    if latent.shape[-1] != c + r:
        raise ValueError(f"mla_decode: latent last dim {latent.shape[-1]} != C + R = {c} + {r}")
    if t_count == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t_count, h_count, c)
    return _attention(q_nope_absorbed, q_pe if r else None, [latent], [idx], None, scale)
