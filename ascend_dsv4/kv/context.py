"""StepContext: everything a forward step needs to address the paged KV pools.

A step runs a ragged batch: the new tokens of several sequences concatenated (each sequence's tokens
contiguous and in position order). Sequence s contributes positions ``start_s .. start_s + n_s - 1``;
a prefill has ``start_s = 0`` and large ``n_s``, a decode ``n_s = 1``, a prefill chunk anything between,
and they mix freely. All index tensors below are built once per step and shared by every layer.

Slots are rows of a layer's flattened pool view (``page * page_size + offset``); -1 means "absent".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import SeqBlocks
from .tables import logits_rows, lookup_slots, page_tables, token_positions


@dataclass
class CompressCtx:
    """Index tensors for the compressed pools of one ratio r (4 or 128)."""

    ratio: int
    new_cand: torch.Tensor  # [M, kappa*r] token slots of the candidates of each entry completed this step
    new_pos: torch.Tensor  # [M] RoPE position r*i of each completed entry i
    new_slot: torch.Tensor  # [M] entry slot the completed entry is written to
    visible: torch.Tensor  # [T, Nmax] entry slots token t may attend to / score (i < (t+1)//r), -1 padded


@dataclass
class StepContext:
    pools: "V4KVPools"  # noqa: F821  (kv.compressed_pools; not imported: it imports this module)
    positions: torch.Tensor  # [T] int64
    seq_index: torch.Tensor  # [T] which sequence of the step each token belongs to
    swa_slot: torch.Tensor  # [T] token slot each new token's rows are written to
    window: torch.Tensor  # [T, W] token slots of positions t-W+1 .. t (-1 where < 0)
    compress: dict[int, CompressCtx]
    logits_index: torch.Tensor  # [L] token indices whose logits the caller wants
    query_lens: list[int]
    starts: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_step_context(
    pools,
    seqs: list[SeqBlocks],
    query_lens: list[int],
    logits: str = "last",
    device: torch.device | str | None = None,
) -> StepContext:
    """Index tensors for one step in which ``seqs[s]`` adds ``query_lens[s]`` tokens after its
    ``num_tokens`` computed ones. Pages must already be allocated (:meth:`V4KVPools.ensure`).

    ``logits``: "last" (one row per sequence), "all" (every token) or "none".
    """
    cfg, sizes = pools.cfg, pools.sizes
    device = pools.device if device is None else device
    starts = [s.num_tokens for s in seqs]
    lens, seq_index, positions = token_positions(starts, query_lens)

    tok_tables = page_tables([s.token for s in seqs])
    B = sizes.block_size
    swa_slot = lookup_slots(tok_tables, seq_index, positions, B)
    if bool((swa_slot < 0).any()):
        raise RuntimeError("build_step_context: a new token has no page; call V4KVPools.ensure first")
    W = cfg.window_size
    win_pos = positions.unsqueeze(1) - (W - 1) + torch.arange(W)  # [T, W]
    window = lookup_slots(tok_tables, seq_index.unsqueeze(1).expand(-1, W), win_pos, B)

    compress: dict[int, CompressCtx] = {}
    for r, tables_rows, page in ((4, [s.c4 for s in seqs], sizes.c4_block_size),
                                 (128, [s.c128 for s in seqs], sizes.c128_block_size)):
        if (r == 4 and not pools.csa_layers) or (r == 128 and not pools.hca_layers):
            continue
        ent_tables = page_tables(tables_rows)
        kappa = 2 if r == 4 else 1
        done = (positions + 1) % r == 0
        tok = done.nonzero(as_tuple=True)[0]
        entry = (positions[tok] + 1) // r - 1  # [M]
        cand_pos = entry.unsqueeze(1) * r - (kappa - 1) * r + torch.arange(kappa * r)  # [M, kappa*r]
        new_cand = lookup_slots(tok_tables, seq_index[tok].unsqueeze(1).expand_as(cand_pos), cand_pos, B)
        new_slot = lookup_slots(ent_tables, seq_index[tok], entry, page)
        n_vis = (positions + 1) // r  # entries 0..n_vis-1 visible
        nmax = int(n_vis.max()) if len(n_vis) else 0
        ent = torch.arange(nmax).unsqueeze(0).expand(len(positions), -1)
        ent = torch.where(ent < n_vis.unsqueeze(1), ent, torch.full_like(ent, -1))
        visible = lookup_slots(ent_tables, seq_index.unsqueeze(1).expand_as(ent), ent, page)
        compress[r] = CompressCtx(r, new_cand.to(device), (entry * r).to(device), new_slot.to(device),
                                  visible.to(device))

    logits_index = logits_rows(lens, logits)
    return StepContext(pools, positions.to(device), seq_index.to(device), swa_slot.to(device), window.to(device),
                       compress, logits_index.to(device), list(query_lens), starts)
