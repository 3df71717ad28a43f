"""RMSNorm and float32 parameters, shared by both model families and the loaders."""

from __future__ import annotations

import torch
from torch import nn

import atb_ops


def fp32_param(*shape: int) -> nn.Parameter:
    """A zero float32 parameter of ``shape`` (no gradient): filled by the loaders."""
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm with a float32 weight (the official model up-casts norm weights at load)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return atb_ops.rms_norm(x, self.weight, self.eps)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``norm(h)``, returned as ``(norm(h), h)``: one fused ``atb_ops.add_rms_norm`` for
    a plain :class:`RMSNorm` (the same math: the sum is rounded to x's dtype before the norm), else the add
    then the module (e.g. an msModelSlim smoothed norm that replaced it at load)."""
    if type(norm) is RMSNorm:
        return atb_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    h = x + residual
    return norm(h), h
