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
def moe_unpermute(y: torch.Tensor, order: torch.Tensor, num_tokens: int, skip: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.zeros(num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    if num_tokens and y.shape[0]:
        out.index_add_(0, order // (y.shape[0] // num_tokens), y.float())
    return finish_unpermute(out, skip, out_dtype)


def finish_unpermute(out: torch.Tensor, skip: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``moe_unpermute``'s tail: + skip (float32, after the rows), one rounding to ``out_dtype``."""
    if skip is not None:
        out = out + skip.float()
    return out if out_dtype is None else out.to(out_dtype)
