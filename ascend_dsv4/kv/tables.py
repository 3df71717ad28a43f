"""Index helpers shared by the pools: positions of a ragged step, padded page tables, slot look-ups.

A "slot" is a row of a layer's flattened pool view: ``page * page_size + offset``; -1 means absent.
"""

from __future__ import annotations

import torch


def lookup_slots(tables: torch.Tensor, seq_idx: torch.Tensor, item: torch.Tensor, page: int) -> torch.Tensor:
    """Slot of item index ``item`` of sequence ``seq_idx`` via padded page tables; -1 if item < 0."""
    valid = item >= 0
    it = item.clamp(min=0)
    pg = tables[seq_idx, it // page]
    return torch.where(valid & (pg >= 0), pg * page + it % page, torch.full_like(it, -1))


def token_positions(starts: list[int], query_lens: list[int]):
    """(lens, seq_index [T], positions [T]) of a ragged step: sequence s adds positions start_s .. start_s+n_s-1."""
    lens = torch.tensor(query_lens, dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
    offsets = torch.cumsum(lens, 0) - lens
    positions = torch.tensor(starts, dtype=torch.long)[seq_index] + (torch.arange(int(lens.sum())) - offsets[seq_index])
    return lens, seq_index, positions


def logits_rows(lens: torch.Tensor, logits: str) -> torch.Tensor:
    """Token rows whose logits a step returns: "last" (one per sequence), "all", or "none"."""
    if logits == "last":
        return (torch.cumsum(lens, 0) - 1)[lens > 0]
    if logits == "all":
        return torch.arange(int(lens.sum()))
    return torch.zeros(0, dtype=torch.long)


def page_tables(rows: list[list[int]]) -> torch.Tensor:
    """Padded page tables [S, max pages] (int64, -1 padded) of S sequences."""
    width = max([len(r) for r in rows] + [1])
    t = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return t
