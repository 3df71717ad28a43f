"""Quantised layers that replace a model's dense ones when a msModelSlim checkpoint describes them (both families):
a described linear (:class:`QuantLinearAdapter` around :class:`quant.msmodelslim.QuantLinear`), routed experts of
such linears (:class:`QuantExperts`), a smoothed norm (:class:`SmoothedRMSNorm`)."""

from __future__ import annotations

import torch
from torch import nn

import atb_ops


class QuantLinearAdapter(nn.Module):
    """A described msModelSlim linear in place of a :class:`parallel.linear.Linear`: [..., K] -> [..., N]."""

    def __init__(self, ql: nn.Module, out_dtype: torch.dtype):
        super().__init__()
        self.ql, self.out_dtype = ql, out_dtype

    @property
    def weight(self) -> torch.Tensor:  # consumers that need the matrix itself (absorption, einsum) get it dense
        return self.ql.dequant_weight().to(self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        # the NPU form (weights/msm_npu.py) takes the model dtype, as its NPU ops do; the CPU-layout one float32
        y = self.ql(x2 if getattr(self.ql, "takes_model_dtype", False) else x2.float())
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype if x.dtype != torch.float32 else self.out_dtype)


class QuantExperts(nn.Module):
    """Routed experts whose weights are msModelSlim entries: w1 / w3 / w2 QuantLinears per expert."""

    def __init__(self, experts: list[tuple[nn.Module, nn.Module, nn.Module]], limit: float,
                 weight_after_w2: bool = False):
        super().__init__()
        # where the routing weight multiplies: before w2 (DeepSeek-V4, ascend_dsv4/models/deepseek_v4/README.md §2.4)
        # or after (DeepSeek-V3); it
        # matters once w2 quantises its input
        self.weight_after_w2 = weight_after_w2
        self.w1 = nn.ModuleList(e[0] for e in experts)
        self.w3 = nn.ModuleList(e[1] for e in experts)
        self.w2 = nn.ModuleList(e[2] for e in experts)
        self.limit = limit

    def _expert(self, e: int, xs: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e`` (local index) on rows xs [n, d] with routing weights w [n, 1]: float32 [n, d], the weight
        applied before w2 or after it (``weight_after_w2``)."""
        h = atb_ops.swiglu(self.w1[e](xs), self.w3[e](xs), self.limit)
        if self.weight_after_w2:
            return self.w2[e](h.to(dtype)).float() * w
        return self.w2[e]((h * w).to(dtype)).float()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, tok, self._expert(e, x[tok], weights[tok, slot].unsqueeze(-1), x.dtype))
        return y

    def _rows(self, xs: torch.Tensor, e: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows xs [n, d] sorted by local expert id e [n], routing weights w [n] -> float32 [n, d] (each row its
        expert's output, weighted): what expert-parallel dispatch (``layers.experts.ep_dispatch_combine``) asks
        of the rank that holds the experts. Rows of id E (no expert here: ``layers.experts.ep_static_rows``) are
        zeros."""
        y = torch.empty(xs.shape[0], xs.shape[1], dtype=torch.float32, device=xs.device)
        ids, counts = torch.unique_consecutive(e, return_counts=True)
        lo = 0
        for eid, n in zip(ids.tolist(), counts.tolist()):
            if eid < len(self.w1):
                y[lo:lo + n] = self._expert(eid, xs[lo:lo + n], w[lo:lo + n].unsqueeze(-1).float(), dtype)
            else:  # only these rows need zeros: the others are all written above
                y[lo:lo + n] = 0
            lo += n
        return y


class SmoothedRMSNorm(nn.Module):
    """An anti-outlier smoothed norm (``norm(x) * w + b``, msModelSlim's ``AntiOutlierNorm``) in place of an RMSNorm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)
