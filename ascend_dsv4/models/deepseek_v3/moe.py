"""DeepSeek-V3 feed-forward: SiLU-gated dense MLP (first layers, shared experts) and the MoE with sigmoid,
group-limited routing (``noaux_tc``: a score-correction bias for selection only)."""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.groups import Group
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.linear import stacked_linear

from ...layers.experts import moe_output, routed_experts
from ...layers.overlap import run_beside
from ...layers.norm import fp32_param


class MLP(nn.Module):
    """SiLU-gated MLP (dense layers and the shared experts): gate / up column-, down row-parallel under ``tp``
    (``reduce=False``: down returns the partial sum, for a caller that reduces it with others)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype, tp: Group | None = None, reduce: bool = True):
        super().__init__()
        tp = tp or Group()
        self.gate_proj = ColumnParallelLinear(dim, inter, dtype, tp)
        self.up_proj = ColumnParallelLinear(dim, inter, dtype, tp)
        self.down_proj = RowParallelLinear(inter, dim, dtype, tp, reduce=reduce)

    def stacked_linears(self):
        """gate_proj and up_proj read the same input: one GEMM once stacked (parallel.linear.stack_model_linears_)."""
        return ((self.gate_proj, self.up_proj),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = stacked_linear((self.gate_proj, self.up_proj), x)
        return self.down_proj(atb_ops.swiglu(g, u, 0.0, out_dtype=x.dtype))  # rounded in the kernel


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
    """Replicated router; routed experts TP (split inside) or EP (partitioned), see ``layers.experts``; shared
    experts column / row parallel; one reduction of the partial sums."""

    def __init__(self, cfg, dtype: torch.dtype, parallel=None):
        super().__init__()
        self.tp = parallel.tp if parallel is not None else Group()
        self.gate = Gate(cfg, dtype)
        self.experts = routed_experts(cfg, cfg.moe_inter_dim, 0.0, dtype, False, parallel)
        self.shared_experts = (MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts, dtype, self.tp, reduce=False)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router's small launches beside the shared expert's GEMMs (a side stream on a GPU / NPU)
        shared_fn = (lambda: self.shared_experts(x)) if self.shared_experts is not None else None
        (weights, ids), shared = run_beside(lambda: self.gate(x), shared_fn, x)
        return moe_output(self.experts, x, weights, ids, shared, self.tp, x.dtype)
