"""The routed experts of one MoE layer, stacked (both families; the loaders fill them in checkpoint format)."""

from __future__ import annotations

import torch
from torch import nn

import atb_ops


class Experts(nn.Module):
    """All routed experts stacked: ``w1``, ``w3`` [E, inter, dim] and ``w2`` [E, dim, inter] (dense), or kept in
    the checkpoint format (``fmt`` 'fp4': int8 [E, out, in/2] with E8M0 ``w*_scale`` [E, out, in/32];
    'fp8_block': e4m3 [E, out, in] with ``w*_scale`` [E, out/128, in/128]) after :meth:`set_weights`."""

    def __init__(self, n_experts: int, inter: int, dim: int, limit: float, dtype: torch.dtype, reference: bool):
        super().__init__()
        E, I, d = n_experts, inter, dim
        self.limit, self.reference = limit, reference
        self.fmt = "dense"
        self.w1 = nn.Parameter(torch.empty(E, I, d, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(E, I, d, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, d, I, dtype=dtype), requires_grad=False)
        for n in ("w1_scale", "w2_scale", "w3_scale"):
            self.register_parameter(n, None)

    def set_weights(self, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
        """Install stacked weights ``w1, w2, w3`` (and ``w1_scale, ...`` for quantised formats)."""
        self.fmt = fmt
        for n in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
            t = tensors.get(n)
            setattr(self, n, None if t is None else nn.Parameter(t, requires_grad=False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, d]; weights, ids [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x_t), float32 [T, d]."""
        T = ids.shape[0]
        xs, e, order = atb_ops.moe_permute(x, ids, self.w1.shape[0])  # rows grouped by expert
        if self.reference:
            xs = atb_ops.fp8_act_round(xs, 128)
        f = self.fmt
        g = atb_ops.grouped_matmul(xs, self.w1, e, self.w1_scale, f)
        u = atb_ops.grouped_matmul(xs, self.w3, e, self.w3_scale, f)
        h = atb_ops.swiglu(g, u, self.limit)
        h = (h * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)  # routing weight before w2
        if self.reference:
            h = atb_ops.fp8_act_round(h, 128)
        y = atb_ops.grouped_matmul(h, self.w2, e, self.w2_scale, f).float()
        return atb_ops.moe_unpermute(y, order, T)
