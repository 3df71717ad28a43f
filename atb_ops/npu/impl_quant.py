"""NPU implementation of ``quant_linear``: the msModelSlim integer path on torch_npu's quantised matmuls.

* dynamic: ``npu_dynamic_quant`` (per-token int8 + scale) then ``npu_quant_matmul(x1, x2, scale,
  pertoken_scale=..., bias=..., output_dtype=x.dtype)``;
* static: ``npu_quantize(x, 1 / input_scale, input_offset, torch.qint8, axis=-1, div_mode=False)`` (as
  vllm-ascend quantises: the offset is added before rounding) then
  ``npu_quant_matmul(x1, x2, deq_scale, bias=quant_bias (int32), output_dtype=x.dtype)``;
* weight_only: ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, bias=...,
  antiquant_group_size=...)`` (the offset is already negated: the op adds it).
"""

from __future__ import annotations

import torch

from .optable import candidate, has_torch_npu, torch_npu


@candidate("quant_linear", "torch_npu", "torch_npu.npu_dynamic_quant / npu_quantize + npu_quant_matmul; "
           "npu_weight_quant_batchmatmul",
           has_torch_npu("npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "npu_weight_quant_batchmatmul"))
def quant_linear(x, weight, mode, scale, bias=None, offset=None, input_scale=None, input_offset=None, group_size=0):
    tn = torch_npu()
    if x.shape[0] == 0:
        n = weight.shape[1] * (8 if weight.dtype == torch.int32 else 1)
        return x.new_zeros((0, n))
    if mode == "weight_only":
        return tn.npu_weight_quant_batchmatmul(x, weight, scale, antiquant_offset=offset, bias=bias,
                                               antiquant_group_size=int(group_size))
    if mode == "dynamic":
        q, s_t = tn.npu_dynamic_quant(x)
        return tn.npu_quant_matmul(q, weight, scale, pertoken_scale=s_t, bias=bias, output_dtype=x.dtype)
    if mode == "static":
        q = tn.npu_quantize(x, (1.0 / input_scale.float()).reshape(1), input_offset.float().reshape(1), torch.qint8,
                            axis=-1, div_mode=False)
        return tn.npu_quant_matmul(q, weight, scale, bias=bias, output_dtype=x.dtype)
    raise ValueError(f"quant_linear: unknown mode {mode!r}")


@candidate("quant_grouped_matmul", "torch_npu", "torch_npu.npu_dynamic_quant + npu_grouped_matmul (int8, per-token "
           "and per-expert scales)", has_torch_npu("npu_dynamic_quant", "npu_grouped_matmul"))
def quant_grouped_matmul(x, weight, expert_ids, scale):
    """Rows sorted by expert (stable); ``npu_dynamic_quant`` per token; one ``npu_grouped_matmul`` over
    ``x=[q (M, K) int8]``, ``weight=[W (E, K, N) int8]``, ``scale=[(E, N) f32]``, ``per_token_scale=[(M,) f32]``,
    ``group_list`` = per-expert counts (type 1), ``output_dtype`` = x's dtype; rows scattered back (id E: zeros)."""
    m, (e, _, n) = x.shape[0], weight.shape
    if m == 0:
        return x.new_zeros((0, n))
    tn = torch_npu()
    order = torch.argsort(expert_ids, stable=True)  # rows of id E (no expert here) last, past every group
    counts = torch.bincount(expert_ids, minlength=e + 1)[:e].to(torch.int64)
    q, s_t = tn.npu_dynamic_quant(x[order])
    y = tn.npu_grouped_matmul([q], [weight], scale=[scale.float()], per_token_scale=[s_t], group_list=counts,
                              split_item=3, group_type=0, group_list_type=1, output_dtype=x.dtype)[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out[order] = y
    return out.masked_fill_((expert_ids >= e).unsqueeze(-1), 0)  # rows past the last group are undefined


@candidate("kv_quant", "torch_npu", "torch_npu.npu_quantize (div_mode=False, per channel)",
           has_torch_npu("npu_quantize"))
def kv_quant(x, inv_scale, offset=None):
    """C8 KV quantisation as vllm-ascend quantises the cache: ``npu_quantize(x, inv_scale, offset, torch.qint8,
    axis=-1, div_mode=False)`` = ``round(x * inv_scale + offset)`` saturated to int8."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.int8, device=x.device)
    zp = torch.zeros_like(inv_scale, dtype=torch.float32) if offset is None else offset.float()
    return torch_npu().npu_quantize(x, inv_scale.float(), zp, torch.qint8, axis=-1, div_mode=False)
