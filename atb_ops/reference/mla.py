"""Multi-head Latent Attention (DeepSeek-V2/V3 MLA) over gathered rows.

Two forms of the same attention (see :func:`atb_ops.mla_decode` / :func:`atb_ops.mla_prefill`):

- ``mla_decode``: the absorbed form over a latent pool (W_UK folded into q, W_UV applied by the caller),
  with the rope and nope scores computed as two separate dot products (MoveElision: no q/k concatenation);
- ``mla_prefill``: the decompressed form (per-head k_nope and v, k_pe shared by the heads).

Both compute in float32 and return q's dtype. ``-1`` (any negative) indices are padding: their rows are
zeroed before use (a paged pool may hold NaN in unreferenced slots) and their scores are -inf. A token
with no valid index returns 0.
"""

from __future__ import annotations

import torch

from .._registry import register


def _gather(x: torch.Tensor, idx: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """x[idx] in float32 with the padded slots zeroed: [T, L, ...]."""
    rows = x[idx.clamp(min=0)].float()
    return rows.masked_fill(pad.view(*pad.shape, *([1] * (rows.dim() - 2))), 0.0)


def _softmax_valid(s: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Softmax of s [T, H, L] over L ignoring padded slots (pad [T, L]); an all-padded row gives 0."""
    s = s.masked_fill(pad.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf row: exp(-inf - 0) = 0
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


@register("mla_decode", "reference")
def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
    t_count, h_count, c = q_nope_absorbed.shape
    r = q_pe.shape[-1]
    if latent.shape[-1] != c + r:
        raise ValueError(f"mla_decode: latent last dim {latent.shape[-1]} != C + R = {c} + {r}")
    if t_count == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t_count, h_count, c)
    pad = idx < 0
    rows = _gather(latent, idx, pad)  # [T, L, C + R]
    ckv, kpe = rows[..., :c], rows[..., c:]
    s = torch.einsum("thc,tlc->thl", q_nope_absorbed.float(), ckv)
    s = s + torch.einsum("thr,tlr->thl", q_pe.float(), kpe)
    p = _softmax_valid(s * scale, pad)
    return torch.einsum("thl,tlc->thc", p, ckv).to(q_nope_absorbed.dtype)


@register("mla_decode_split", "reference")
def mla_decode_split(q_nope_absorbed, q_pe, c_kv, k_pe, idx, scale):
    t_count, h_count, c = q_nope_absorbed.shape
    if c_kv.shape[-1] != c or k_pe.shape[-1] != q_pe.shape[-1] or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(f"mla_decode_split: c_kv {list(c_kv.shape)} / k_pe {list(k_pe.shape)} do not match C = {c}, "
                         f"R = {q_pe.shape[-1]}")
    if t_count == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t_count, h_count, c)
    pad = idx < 0
    ckv, kpe = _gather(c_kv, idx, pad), _gather(k_pe, idx, pad)  # [T, L, C], [T, L, R]
    s = torch.einsum("thc,tlc->thl", q_nope_absorbed.float(), ckv)
    s = s + torch.einsum("thr,tlr->thl", q_pe.float(), kpe)
    p = _softmax_valid(s * scale, pad)
    return torch.einsum("thl,tlc->thc", p, ckv).to(q_nope_absorbed.dtype)


@register("mla_prefill", "reference")
def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, idx, scale):
    t_count, h_count, _ = q_nope.shape
    dv = v.shape[-1]
    if t_count == 0 or idx.shape[-1] == 0:
        return q_nope.new_zeros(t_count, h_count, dv)
    pad = idx < 0
    kn = _gather(k_nope, idx, pad)  # [T, L, H, Dn]
    kp = _gather(k_pe, idx, pad)  # [T, L, R]
    vv = _gather(v, idx, pad)  # [T, L, H, Dv]
    s = torch.einsum("thd,tlhd->thl", q_nope.float(), kn)
    s = s + torch.einsum("thr,tlr->thl", q_pe.float(), kp)
    p = _softmax_valid(s * scale, pad)
    return torch.einsum("thl,tlhd->thd", p, vv).to(q_nope.dtype)
