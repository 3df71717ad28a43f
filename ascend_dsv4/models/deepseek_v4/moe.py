"""DeepSeek-V4 MoE: sqrt-softplus gate (biased top-k or hash routing), clamped SwiGLU experts (README.md §2.4).

Under tensor parallelism the router is replicated, the shared expert is column (w1, w3) / row (w2) parallel and
the routed experts are TP-split or EP-partitioned (:mod:`ascend_dsv4.layers.experts`); the partial sums of the
routed and the shared experts are reduced once per layer."""

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
from .config import DeepseekV4Config


class Gate(nn.Module):
    """``weight`` [E, dim]; ``bias`` [E] (non-hash layers, selection only) or ``tid2eid`` [vocab, k] (hash)."""

    def __init__(self, cfg: DeepseekV4Config, hash_routed: bool, dtype: torch.dtype):
        super().__init__()
        self.topk, self.route_scale = cfg.n_activated_experts, cfg.route_scale
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=dtype), requires_grad=False)
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.long))
            self.bias = None
        else:
            self.bias = fp32_param(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hash_routed:
            return atb_ops.moe_gate(x, self.weight, None, self.topk, self.route_scale, self.tid2eid, token_ids)
        return atb_ops.moe_gate(x, self.weight, self.bias, self.topk, self.route_scale)


class SharedExpert(nn.Module):
    """Shared expert; under TP w1 / w3 are column- and w2 row-parallel, returning a partial sum (``reduce=False``:
    the MoE reduces it together with the routed experts)."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, reference: bool, tp: Group | None = None):
        super().__init__()
        d, I = cfg.dim, cfg.moe_inter_dim
        tp = tp or Group()
        self.limit = cfg.swiglu_limit  # current official revision clamps the shared expert too
        self.w1 = ColumnParallelLinear(d, I, dtype, tp, fp8_input=reference)
        self.w3 = ColumnParallelLinear(d, I, dtype, tp, fp8_input=reference)
        self.w2 = RowParallelLinear(I, d, dtype, tp, fp8_input=reference, reduce=False)

    def stacked_linears(self):
        """w1 and w3 read the same input: one GEMM once stacked (parallel.linear.stack_model_linears_)."""
        return ((self.w1, self.w3),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = stacked_linear((self.w1, self.w3), x)
        return self.w2(atb_ops.swiglu(h1, h3, self.limit, out_dtype=x.dtype))  # rounded in the kernel


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, dtype: torch.dtype, reference: bool, parallel=None):
        super().__init__()
        self.tp = parallel.tp if parallel is not None else Group()
        self.gate = Gate(cfg, layer_id < cfg.n_hash_layers and layer_id < cfg.n_layers, dtype)
        self.experts = routed_experts(cfg, cfg.moe_inter_dim, cfg.swiglu_limit, dtype, reference, parallel)
        self.shared_experts = SharedExpert(cfg, dtype, reference, self.tp) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        # the router's small launches beside the shared expert's GEMMs (a side stream on a GPU / NPU)
        shared_fn = (lambda: self.shared_experts(x)) if self.shared_experts is not None else None
        (weights, ids), shared = run_beside(lambda: self.gate(x, token_ids), shared_fn, x)
        return moe_output(self.experts, x, weights, ids, shared, self.tp, x.dtype)
