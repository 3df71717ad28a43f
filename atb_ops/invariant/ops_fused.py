"""Batch-invariant variants of the fused ops added for the NPU backend (``add_rms_norm``, ``kv_quant``,
``mla_decode_split``, ``moe_permute``, ``moe_unpermute``), built on the variants of :mod:`.ops`.

``kv_quant`` (elementwise) and ``moe_permute`` (a stable sort and a gather: no arithmetic) are invariant as the
reference computes them; ``moe_unpermute`` sums each token's ``k`` expert rows in slot order (the reference's
scatter-add sums them in expert order, which depends only on that token too, but not in a fixed association on
every device)."""

from __future__ import annotations

import torch

from .._registry import register
from ..reference.kv_quant import kv_quant as _kv_quant_ref
from ..reference.routing import finish_unpermute, moe_permute as _moe_permute_ref
from .ops import mla_decode, rms_norm, seq_sum

register("kv_quant", "reference", batch_invariant=True)(_kv_quant_ref)
register("moe_permute", "reference", batch_invariant=True)(_moe_permute_ref)


@register("add_rms_norm", "reference", batch_invariant=True)
def add_rms_norm(x, residual, weight, eps):
    h = x + residual  # in x's dtype, as the unfused model rounds it
    return rms_norm(h, weight, eps), h


@register("mla_decode_split", "reference", batch_invariant=True)
def mla_decode_split(q_nope_absorbed, q_pe, c_kv, k_pe, idx, scale):
    return mla_decode(q_nope_absorbed, q_pe, torch.cat([c_kv, k_pe.to(c_kv.dtype)], -1), idx, scale)


@register("moe_unpermute", "reference", batch_invariant=True)
def moe_unpermute(y, order, num_tokens, skip=None, out_dtype=None):
    n = order.numel()
    if num_tokens == 0 or n == 0:
        return finish_unpermute(y.new_zeros(num_tokens, y.shape[-1], dtype=torch.float32), skip, out_dtype)
    k = n // num_tokens
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n, device=order.device)
    per_token = y.float()[inv].view(num_tokens, k, y.shape[-1])  # row t * k + j = token t, slot j
    return finish_unpermute(seq_sum(per_token, 1), skip, out_dtype)
