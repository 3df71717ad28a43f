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
