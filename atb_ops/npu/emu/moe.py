"""Emulated torch_npu MoE ops: npu_moe_gating_top_k and npu_grouped_matmul."""

from __future__ import annotations

import torch

from .common import enum_to_dtype, refuse


def _stable_topk_desc(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index (the doc's stable argsort of -v)."""
    return torch.argsort(-v, dim=-1, stable=True)[..., :k]


def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias=None, input_ids=None, tid2eid=None, k_group: int = 1,
                         group_count: int = 1, group_select_mode: int = 0, renorm: int = 0, norm_type: int = 0,
                         out_flag: bool = False, routed_scaling_factor: float = 1.0, eps: float = 1e-20):
    """DeepSeek noaux_tc gating (torch_npu doc ``npu_moe_gating_top_k``, its numpy reference).

    ``s = softmax(x)`` (norm_type 0) or ``sigmoid(x)`` (1); ``sb = s + bias``; with ``group_count`` G > 1 the E
    experts form G groups scored by their max (group_select_mode 0) or the sum of their two best ``sb``
    (mode 1); all but the ``k_group`` best groups are set to -inf; ``idx`` = the k best ``sb`` (stable: lower
    index first on ties); ``y = s[idx]`` (unbiased), divided by ``sum(y) + eps`` when norm_type == 1, times
    ``routed_scaling_factor``. With ``input_ids``/``tid2eid`` (hash routing) ``idx = tid2eid[input_ids]``.
    Returns ``(y [T, k] x.dtype, idx [T, k] int32, norm_out [T, E] float32)``; norm_out = s when ``out_flag``
    (zeros otherwise: not read).
    """
    if renorm != 0:
        refuse("npu_moe_gating_top_k", f"renorm={renorm}")
    if norm_type not in (0, 1):
        refuse("npu_moe_gating_top_k", f"norm_type={norm_type}")
    xf = x.float()
    s = xf.softmax(-1) if norm_type == 0 else xf.sigmoid()
    t, e = s.shape
    if tid2eid is not None:
        idx = tid2eid[input_ids.long()].long()
    else:
        sb = s if bias is None else s + bias.float()
        if group_count > 1:
            if e % group_count:
                raise RuntimeError("npu_moe_gating_top_k: expert count must be divisible by group_count")
            g = sb.view(t, group_count, e // group_count)
            if group_select_mode == 0:
                gs = g.amax(-1)
            elif group_select_mode == 1:
                gs = g.gather(-1, _stable_topk_desc(g, 2)).sum(-1)
            else:
                refuse("npu_moe_gating_top_k", f"group_select_mode={group_select_mode}")
            keep = _stable_topk_desc(gs, k_group)
            mask = torch.ones(t, group_count, dtype=torch.bool, device=x.device)
            mask.scatter_(1, keep, False)
            sb = g.masked_fill(mask.unsqueeze(-1), float("-inf")).view(t, e)
        idx = _stable_topk_desc(sb, k)
    y = s.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = s if out_flag else torch.zeros_like(s)
    return y.to(x.dtype), idx.to(torch.int32), norm_out


def _group_bounds(group_list: torch.Tensor, group_list_type: int, n_groups: int) -> list[tuple[int, int]]:
    gl = [int(v) for v in group_list.reshape(-1).tolist()]
    if group_list_type == 0:  # cumulative end offsets
        ends = gl
    elif group_list_type == 1:  # counts
        ends, acc = [], 0
        for c in gl:
            acc += c
            ends.append(acc)
    else:
        refuse("npu_grouped_matmul", f"group_list_type={group_list_type}")
    if len(ends) != n_groups:
        raise RuntimeError(f"npu_grouped_matmul: group_list has {len(ends)} entries for {n_groups} weights")
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """Grouped matmul, MoE form (torch_npu doc ``npu_grouped_matmul``): ``x = [X (M, K)]``,
    ``weight = [W (E, K, N)]``, ``group_type=0`` (split M), ``split_item`` 2/3 (one output ``[M, N]``): rows
    ``[start_e, end_e)`` of X, from ``group_list`` (type 0 cumulative ends, type 1 counts), are multiplied by
    W[e]. Optional ``bias=[(E, N)]``. Rows past the last group are NaN here (documented as undefined: a caller
    must not read them). Accumulates in float32; output in ``output_dtype`` or X's dtype. Quantised form (A2/A3): int8
    X and W with ``scale=[(E, N)]`` and ``per_token_scale=[(M,)]``: ``y = (X @ W[e]) * scale[e] * pertoken[m]``."""
    for name, v in (("offset", offset), ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset),
                    ("activation_input", activation_input), ("x_dtype", x_dtype), ("weight_dtype", weight_dtype)):
        if v is not None:
            refuse("npu_grouped_matmul", name)
    if act_type:
        refuse("npu_grouped_matmul", f"act_type={act_type}")
    if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3 or group_type != 0 or split_item not in (2, 3):
        refuse("npu_grouped_matmul", "a form other than single x / single [E, K, N] weight / group_type 0 / "
                                     "split_item 2|3")
    if group_list is None:
        refuse("npu_grouped_matmul", "group_list=None")
    xm, w = x[0], weight[0]
    quant = xm.dtype == torch.int8
    if quant != (w.dtype == torch.int8) or quant != (scale is not None) or (per_token_scale is not None and not quant):
        refuse("npu_grouped_matmul", "this dtype / scale combination (emulated: float x float, or int8 x int8 with "
                                     "scale [E, N] and optional per_token_scale [M])")
    out_dtype = xm.dtype if output_dtype is None else enum_to_dtype(output_dtype, "npu_grouped_matmul", "output_dtype")
    if quant and out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        refuse("npu_grouped_matmul", f"int8 output_dtype {out_dtype}")
    bounds = _group_bounds(group_list, group_list_type, w.shape[0])
    y = torch.zeros(xm.shape[0], w.shape[2], dtype=torch.float32, device=xm.device)
    y[max((b for _, b in bounds), default=0):] = float("nan")  # undefined on the device: poisoned here
    for e, (a, b) in enumerate(bounds):
        if b > a:
            if quant:  # int32 accumulation (exact), then * scale[e][n] * per_token_scale[m]
                acc = (xm[a:b].to(torch.int64) @ w[e].to(torch.int64)).float()
                y[a:b] = acc * scale[0][e].float()
                if per_token_scale is not None:
                    y[a:b] *= per_token_scale[0][a:b].float().unsqueeze(-1)
            else:
                y[a:b] = xm[a:b].float() @ w[e].float()
            if bias is not None:
                y[a:b] += bias[0][e].float()
    return [y.to(out_dtype)]
