"""Grouping of MoE rows by expert without a radix sort: ``moe_permute`` and the order ``grouped_matmul`` tiles.

At decode sizes (a few hundred (token, expert) rows) a stable radix sort is a sequence of launches that costs
tens of microseconds per call, several times per layer. :func:`stable_order` computes the same permutation as
``torch.argsort(ids, stable=True)`` with no host synchronisation (capture-safe): on the GPU in one launch
(:func:`.group_rows.stable_positions`), elsewhere as a counting sort in a handful of element-wise torch ops:

    rank[i]  = #{j < i : ids[j] == ids[i]}            ([M, M] comparison, M <= SMALL)
    start[e] = sum_{e' < e} count[e']                 (exclusive prefix sum over the E experts)
    order[start[ids[i]] + rank[i]] = i

Larger M falls back to the stable argsort. ``ids`` must lie in [0, n) (global expert ids of the routing).
"""

from __future__ import annotations

import torch

from .._registry import register
from ._util import INTERPRET
from .group_rows import stable_positions

SMALL = 1024  # rows up to which the [M, M] comparison (1 M booleans) is cheaper than a radix sort


def stable_order(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [M]: the stable ascending order of ``ids`` (int [M], values in [0, n)) = argsort(ids, stable=True)."""
    ids = ids.reshape(-1).long()
    m = ids.numel()
    if m == 0 or m > SMALL:
        return torch.argsort(ids, stable=True)
    if ids.is_cuda or INTERPRET:  # the same permutation in one launch (group_rows.py)
        return stable_positions(ids)
    idx = torch.arange(m, device=ids.device)
    rank = ((ids.unsqueeze(0) == ids.unsqueeze(1)) & (idx.unsqueeze(0) < idx.unsqueeze(1))).sum(1)
    counts = torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    start = torch.cumsum(counts, 0) - counts
    return torch.empty_like(ids).scatter_(0, start[ids] + rank, idx)


@register("moe_permute", "cuda")
def moe_permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int):
    """Rows of ``x`` [T, d] repeated per routed expert and grouped by expert (stable): (x[order // k] [T k, d],
    sorted expert ids [T k], order [T k]); the reference op's result exactly (atb_ops/reference/routing.py)."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = stable_order(flat, num_experts)
    return x[order // k], flat[order], order
