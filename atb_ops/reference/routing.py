"""MoE token permutation: group the (token, slot) rows by expert, and sum them back per token."""

from __future__ import annotations

import torch

from .._registry import register


@register("moe_permute", "reference")
def moe_permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    return x[order // k], flat[order], order


@register("moe_unpermute", "reference")
def moe_unpermute(y: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    out = torch.zeros(num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    if num_tokens == 0 or y.shape[0] == 0:
        return out
    k = y.shape[0] // num_tokens
    return out.index_add_(0, order // k, y.float())
