"""Sparse attention over gathered K=V rows with a per-head sink (ascend_dsv4/models/deepseek_v4/README.md §2.3
"Combined attention")."""

from __future__ import annotations

import torch

from .._registry import register


def _scores(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float):
    # -1 slots gather row 0 (any content, NaN in an uninitialised pool slot included): zero them so they
    # cannot reach the output through 0 * NaN
    rows = kv[idx.clamp(min=0)].float().masked_fill((idx < 0).unsqueeze(-1), 0.0)  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    return s.masked_fill((idx < 0).unsqueeze(1), float("-inf")), rows


@register("sparse_attention", "reference")
def sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    s, v = _scores(q, kv, idx, scale)
    if extra_kv is not None and extra_idx is not None and extra_idx.shape[-1] > 0:
        s2, v2 = _scores(q, extra_kv, extra_idx, scale)
        s, v = torch.cat([s, s2], dim=-1), torch.cat([v, v2], dim=1)
    sink = sink.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    m = torch.cat([s, sink], dim=-1).amax(-1, keepdim=True)  # max(scores, sink); defined when K = 0
    e = torch.exp(s - m)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("thk,tkd->thd", p, v).to(q.dtype)
