"""RMSNorm (ascend_dsv4/models/deepseek_v4/README.md §2.0)."""

from __future__ import annotations

import torch

from .._registry import register


@register("rms_norm", "reference")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


@register("add_rms_norm", "reference")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm(h, weight, eps), h
