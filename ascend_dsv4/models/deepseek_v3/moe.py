"""DeepSeek-V3 feed-forward: SiLU-gated dense MLP (first layers, shared experts) and the MoE with sigmoid,
group-limited routing (``noaux_tc``: a score-correction bias for selection only)."""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.linear import Linear

from ...layers.experts import Experts
from ...layers.norm import fp32_param


class MLP(nn.Module):
    """SiLU-gated MLP (dense layers and the shared experts)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, inter, dtype), Linear(dim, inter, dtype)
        self.down_proj = Linear(inter, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(atb_ops.swiglu(self.gate_proj(x), self.up_proj(x), 0.0).to(x.dtype))


class Gate(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = fp32_param(cfg.n_routed_experts)

    def forward(self, x):
        c = self.cfg
        return atb_ops.moe_gate(x, self.weight, self.e_score_correction_bias, c.n_activated_experts, c.route_scale,
                                score_func=c.score_func, n_groups=c.n_expert_groups, topk_groups=c.n_limited_groups,
                                normalize=c.norm_topk_prob)


class MoE(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim, 0.0, dtype, False)
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts, dtype) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)
