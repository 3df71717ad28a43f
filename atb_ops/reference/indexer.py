"""Lightning-indexer scores and causal top-k (ascend_dsv4/models/deepseek_v4/README.md §2.3 "CSA Indexer")."""

from __future__ import annotations

import torch

from .._registry import register


@register("indexer_topk", "reference")
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, cand: torch.Tensor, topk: int) -> torch.Tensor:
    t, n = cand.shape
    k = min(topk, n)
    if t == 0 or k == 0:
        return cand.new_full((t, k), -1)
    valid = cand >= 0
    keys = k_cache[cand.clamp(min=0)].float()  # [T, N, Di]
    dots = torch.einsum("thd,tnd->thn", q.float(), keys).relu()
    score = (dots * weights.float().unsqueeze(-1)).sum(1)  # [T, N]
    score = score.masked_fill(~valid, float("-inf"))
    # Stable descending sort: equal scores (ReLU makes exact ties common) keep candidate order, so the
    # selection does not depend on how many padded candidates a token's row has (prefill vs decode, batching).
    vals, order = torch.sort(score, dim=-1, descending=True, stable=True)
    vals, order = vals[:, :k], order[:, :k]
    picked = cand.gather(1, order)
    return torch.where(torch.isneginf(vals), torch.full_like(picked, -1), picked)
