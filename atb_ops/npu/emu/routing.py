"""Emulated torch_npu MoE token routing: npu_moe_init_routing_v2 (permute) and npu_moe_finalize_routing (combine).

Written from the torch_npu docs' numpy references (torch_npu doc ``npu_moe_init_routing_v2`` /
``npu_moe_finalize_routing``), the dropless forms only (``drop_pad_mode`` 0 for init, 0 / 2 for finalize) and
no quantisation in the permute (``quant_mode=-1``).
"""

from __future__ import annotations

import torch

from .common import refuse

INT32_MAX = 2**31 - 1


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num: int = -1,
                            expert_capacity: int = -1, expert_num: int = -1, drop_pad_mode: int = 0,
                            expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
                            quant_mode: int = -1, active_expert_range=(), row_idx_type: int = 0, x_dtype=None):
    """x [N, H], expert_idx [N, K] int32 -> ``(expanded_x, expanded_row_idx int32 [N*K], expert_tokens
    int64 [end - start], expanded_scale float32)``:

    ``e = expert_idx.flatten()`` with experts outside ``[start, end)`` (``active_expert_range``, default ``[0,
    expert_num)``) moved to the end; ``order = stable argsort(e)``; ``n_valid`` = ids in range;
    ``expanded_x = x[order[:active] // K]`` (active = n_valid, or ``min(active_num, n_valid)`` when
    ``active_num > 0``; the allocated ``min(active_num, N*K)`` rows, rows past ``active`` zero here: the device
    leaves them unspecified); ``expanded_row_idx = order`` (row_idx_type 1, the scatter index) or ``dst of src``
    (0: ``[order[:n_valid]] = arange(n_valid)``, -1 elsewhere); expert_tokens = per-expert counts (type 1) or
    their cumsum (0), only when ``expert_tokens_num_flag`` (else an empty tensor); expanded_scale =
    ``scale[order // K]`` when a scale is given, else unspecified (zeros).
    """
    if drop_pad_mode != 0:
        refuse("npu_moe_init_routing_v2", f"drop_pad_mode={drop_pad_mode}")
    if quant_mode != -1 or offset is not None or x_dtype is not None:
        refuse("npu_moe_init_routing_v2", "quantisation in the permute (quant_mode / offset / x_dtype)")
    if expert_tokens_num_type not in (0, 1):
        refuse("npu_moe_init_routing_v2", f"expert_tokens_num_type={expert_tokens_num_type}")
    n, k = expert_idx.shape
    if x.dim() != 2 or x.shape[0] != n:
        raise RuntimeError(f"npu_moe_init_routing_v2: x {list(x.shape)} vs expert_idx {list(expert_idx.shape)}")
    start, end = (int(active_expert_range[0]), int(active_expert_range[1])) if len(active_expert_range) else \
        (0, expert_num)
    e = expert_idx.reshape(-1).long()
    inside = (e >= start) & (e < end)
    key = torch.where(inside, e, torch.full_like(e, INT32_MAX))
    order = torch.argsort(key, stable=True)
    n_valid = int(inside.sum())
    active = n_valid if active_num in (0, -1) else min(active_num, n_valid)
    rows = n * k if active_num <= 0 else min(active_num, n * k)
    expanded_x = x.new_zeros(rows, x.shape[1])
    expanded_x[:active] = x[order[:active] // k]
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
    elif row_idx_type == 0:
        row_idx = torch.full((n * k,), -1, dtype=torch.int32, device=x.device)
        row_idx[order[:n_valid]] = torch.arange(n_valid, dtype=torch.int32, device=x.device)
    else:
        refuse("npu_moe_init_routing_v2", f"row_idx_type={row_idx_type}")
    if expert_tokens_num_flag:
        counts = torch.bincount(e[inside] - start, minlength=end - start).to(torch.int64)
        tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    else:
        tokens = torch.empty(0, dtype=torch.int64, device=x.device)
    exp_scale = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if scale is not None:
        exp_scale[:active] = scale.float()[order[:active] // k]
    return expanded_x, row_idx, tokens, exp_scale


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode: int = 0, k: int = 1):
    """``out[i] = skip1[i] + skip2[i] + sum_j scales[i, j] * (rows[src2dst[pos(i, j)]] + bias[expert[i, j]])``
    with ``pos = j * N + i`` (drop_pad_mode 0) or ``i * K + j`` (2); ``scales`` None means K = ``k`` rows of
    weight 1 (the doc: K = 1 by default); ``skip2`` needs ``skip1``; any of skip1 / skip2 / bias may be None;
    a ``src2dst`` of -1 contributes 0. Returns [N, H] in the rows' dtype (accumulated in float32 here)."""
    if drop_pad_mode not in (0, 2):
        refuse("npu_moe_finalize_routing", f"drop_pad_mode={drop_pad_mode}")
    if skip2 is not None and skip1 is None:
        raise RuntimeError("npu_moe_finalize_routing: skip2 needs skip1")
    kk = scales.shape[1] if scales is not None else int(k)
    n = expanded_src_to_dst_row.shape[0] // kk
    rows = expanded_permuted_rows.float()
    src2dst = expanded_src_to_dst_row.long()
    i = torch.arange(n, device=rows.device).view(n, 1)
    j = torch.arange(kk, device=rows.device).view(1, kk)
    pos = j * n + i if drop_pad_mode == 0 else i * kk + j  # [N, K]
    dst = src2dst[pos]
    picked = rows[dst.clamp(min=0)]  # [N, K, H]
    if bias is not None:
        picked = picked + bias.float()[export_for_source_row.long()[pos]]
    picked = picked.masked_fill((dst < 0).unsqueeze(-1), 0)
    w = torch.ones(n, kk, device=rows.device) if scales is None else scales.float()
    out = (picked * w.unsqueeze(-1)).sum(1)
    if skip1 is not None:
        out = out + skip1.float()
    if skip2 is not None:
        out = out + skip2.float()
    return out.to(expanded_permuted_rows.dtype)


__all__ = ["npu_moe_finalize_routing", "npu_moe_init_routing_v2"]
