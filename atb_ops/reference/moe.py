"""MoE routing, clamped SwiGLU and the grouped expert matmul (ascend_dsv4/models/deepseek_v4/README.md §2.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register


@register("moe_gate", "reference")
def moe_gate(x, weight, bias, topk: int, route_scale: float, tid2eid=None, token_ids=None,
             score_func: str = "sqrtsoftplus", n_groups: int = 1, topk_groups: int = 1, normalize: bool = True):
    logits = x.float() @ weight.float().t()  # [T, E]
    if score_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    elif score_func == "softmax":
        scores = logits.softmax(-1)
    else:
        raise ValueError(f"unknown score_func {score_func!r}")
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        sel = scores if bias is None else scores + bias.float()
        if n_groups > 1:
            T, E = sel.shape
            grouped = sel.view(T, n_groups, E // n_groups)
            group_score = grouped.topk(min(2, E // n_groups), dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
            sel = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
        ids = sel.topk(topk, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, ids


@register("swiglu", "reference")
def swiglu(gate, up, limit: float):
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u
