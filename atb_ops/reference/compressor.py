"""Compressor pooling (ascend_dsv4/models/deepseek_v4/README.md §2.3 "Compressor"): softmax-gated per-channel pooling
of token rows."""

from __future__ import annotations

import torch

from .._registry import register


@register("compressor_pool", "reference")
def compressor_pool(kv_state: torch.Tensor, score_state: torch.Tensor, cand: torch.Tensor, overlap: bool) -> torch.Tensor:
    m, n_cand = cand.shape
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    if m == 0:
        return kv_state.new_zeros((0, c), dtype=torch.float32)
    valid = cand >= 0
    rows = cand.clamp(min=0)
    kv = kv_state[rows].float()  # [M, K, width]
    sc = score_state[rows].float()
    if overlap:
        r = n_cand // 2
        # candidates 0..r-1 are the previous block's tokens (A half), r..2r-1 the current block (B half)
        kv = torch.cat([kv[:, :r, :c], kv[:, r:, c:]], dim=1)
        sc = torch.cat([sc[:, :r, :c], sc[:, r:, c:]], dim=1)
    sc = sc.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    w = sc.softmax(dim=1)
    return (w * kv.masked_fill(~valid.unsqueeze(-1), 0.0)).sum(dim=1)


def compressor_state_write(kv_state, score_state, a, z, ape, positions, slots) -> None:
    """kv_state[slots] = a; score_state[slots] = z + ape[positions mod r] (see :func:`atb_ops.compressor_state_write`).
    Row by row, so also the batch-invariant variant."""
    kv_state.index_copy_(0, slots, a.to(kv_state.dtype))
    score_state.index_copy_(0, slots, (z + ape[positions % ape.shape[0]]).to(score_state.dtype))


register("compressor_state_write", "reference")(compressor_state_write)
register("compressor_state_write", "reference", batch_invariant=True)(compressor_state_write)
