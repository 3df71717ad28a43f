"""Paged KV pools for DeepSeek-V4 (the state of ``ascend_dsv4/models/deepseek_v4/README.md`` §4; SGLang's
``mem_cache/deepseek_v4_memory_pool.py`` keeps the same parts).

Three page spaces, each with its own allocator and one block table per sequence:

* **token pages** (``block_size`` tokens each), addressed by absolute position. They hold, per layer,
  the sliding-window K=V row of every token (``swa``: all backbone layers and the MTP layers) and the
  compressor state rows (``csa_state`` / ``idx_state`` / ``hca_state``: ``wkv x_t`` and
  ``wgate x_t + ape[t mod r]`` in float32). Keeping compressor state by position (instead of a ring per
  request) makes chunked prefill, MTP rollback and prefix sharing plain page-table operations. Pages
  whose positions no query can need any more (older than the window and the open compression blocks)
  are freed by :meth:`V4KVPools.trim`.
* **ratio-4 entry pages** (``c4_block_size`` entries): the CSA compressed KV (``c4``, head_dim wide)
  and the indexer keys (``c4_idx``, index_head_dim wide) share one block table.
* **ratio-128 entry pages** (``c128_block_size`` entries): the HCA compressed KV (``c128``).

Every pool tensor is ``[layers_of_that_kind, num_pages, page_size, width]``; a layer's view flattened
to ``[num_pages * page_size, width]`` is what the ops index with "slots" (page * page_size + offset).
Compressor state starts empty for every sequence: candidates at negative positions are absent (-1).
"""

from __future__ import annotations

import torch

from ..errors import CapacityError
from .blocks import BlockAllocator, EntrySpace, PoolSizes, SeqBlocks
from .context import StepContext, build_step_context


class V4KVPools:
    """All KV state of a DeepSeek-V4 model, paged (see module docstring)."""

    def __init__(self, cfg, sizes: PoolSizes, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg, self.sizes, self.dtype, self.device = cfg, sizes, dtype, torch.device(device)
        n_all = cfg.n_layers + cfg.n_mtp_layers
        self.csa_layers = cfg.layers_of_kind("csa")
        self.hca_layers = cfg.layers_of_kind("hca")
        self.slot_of = {lid: i for i, lid in enumerate(self.csa_layers)}
        self.slot_of.update({lid: i for i, lid in enumerate(self.hca_layers)})
        B, B4, B128 = sizes.block_size, sizes.c4_block_size, sizes.c128_block_size
        D, Di = cfg.head_dim, cfg.index_head_dim
        nb, nb4, nb128 = sizes.num_blocks, sizes.num_c4_blocks, sizes.num_c128_blocks
        nc, nh = len(self.csa_layers), len(self.hca_layers)
        f32 = torch.float32
        z = dict(device=self.device)
        self.swa = torch.zeros(n_all, nb, B, D, dtype=dtype, **z)
        self.csa_state_kv = torch.zeros(nc, nb, B, 2 * D, dtype=f32, **z)
        self.csa_state_score = torch.zeros(nc, nb, B, 2 * D, dtype=f32, **z)
        self.idx_state_kv = torch.zeros(nc, nb, B, 2 * Di, dtype=f32, **z)
        self.idx_state_score = torch.zeros(nc, nb, B, 2 * Di, dtype=f32, **z)
        self.hca_state_kv = torch.zeros(nh, nb, B, D, dtype=f32, **z)
        self.hca_state_score = torch.zeros(nh, nb, B, D, dtype=f32, **z)
        self.c4 = torch.zeros(nc, nb4 if nc else 0, B4, D, dtype=dtype, **z)
        self.c4_idx = torch.zeros(nc, nb4 if nc else 0, B4, Di, dtype=dtype, **z)
        self.c128 = torch.zeros(nh, nb128 if nh else 0, B128, D, dtype=dtype, **z)
        self.reclaim = None  # set by a prefix cache: () -> bool, frees some cached pages (False: nothing left)
        self.token_alloc = BlockAllocator(nb, "token")
        self.c4_alloc = BlockAllocator(nb4 if nc else 0, "c4")
        self.c128_alloc = BlockAllocator(nb128 if nh else 0, "c128")

    # ---- flat per-layer views (what the ops index with slots) ------------------------------------
    @staticmethod
    def _flat(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i].view(-1, t.shape[-1])

    def swa_layer(self, layer_id: int) -> torch.Tensor:
        return self._flat(self.swa, layer_id)

    def state_layer(self, layer_id: int, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv rows, score rows) of the 'main' or 'index' compressor of a CSA/HCA layer."""
        i = self.slot_of[layer_id]
        if self.cfg.layer_kind(layer_id) == "hca":
            return self._flat(self.hca_state_kv, i), self._flat(self.hca_state_score, i)
        if which == "index":
            return self._flat(self.idx_state_kv, i), self._flat(self.idx_state_score, i)
        return self._flat(self.csa_state_kv, i), self._flat(self.csa_state_score, i)

    def entry_layer(self, layer_id: int, which: str = "main") -> torch.Tensor:
        i = self.slot_of[layer_id]
        if self.cfg.layer_kind(layer_id) == "hca":
            return self._flat(self.c128, i)
        return self._flat(self.c4_idx if which == "index" else self.c4, i)

    # ---- page management ---------------------------------------------------------------------------
    def _grow(self, table: list[int], alloc: BlockAllocator, n_items: int, page: int) -> None:
        need = -(-n_items // page) - len(table)
        if need > 0:
            table.extend(alloc.alloc(need))

    def pages_needed(self, seq: SeqBlocks, new_len: int) -> tuple[int, int, int]:
        """Pages (token, c4, c128) that growing ``seq`` to ``new_len`` tokens would allocate."""
        s = self.sizes
        tok = max(0, -(-new_len // s.block_size) - len(seq.token))
        c4 = max(0, -(-(new_len // 4) // s.c4_block_size) - len(seq.c4)) if self.csa_layers else 0
        c128 = max(0, -(-(new_len // 128) // s.c128_block_size) - len(seq.c128)) if self.hca_layers else 0
        return tok, c4, c128

    def can_grow(self, seq: SeqBlocks, new_len: int) -> bool:
        def fits() -> bool:
            tok, c4, c128 = self.pages_needed(seq, new_len)
            return tok <= self.token_alloc.num_free and c4 <= self.c4_alloc.num_free and c128 <= self.c128_alloc.num_free

        while not fits():  # let the prefix cache give pages back before saying no
            if self.reclaim is None or not self.reclaim():
                return False
        return True

    def token_tensors(self) -> list[torch.Tensor]:
        """Every pool tensor indexed by token page ([layers, pages, page_size, width])."""
        return [self.swa, self.csa_state_kv, self.csa_state_score, self.idx_state_kv, self.idx_state_score,
                self.hca_state_kv, self.hca_state_score]

    def copy_page(self, space: str, src: int, dst: int) -> None:
        """Copy page ``src`` to ``dst`` in every layer of one page space ('token' | 'c4' | 'c128')."""
        tensors = {"token": self.token_tensors(), "c4": [self.c4, self.c4_idx], "c128": [self.c128]}[space]
        for t in tensors:
            if t.shape[0]:
                t[:, dst] = t[:, src]

    def ensure(self, seq: SeqBlocks, new_len: int) -> None:
        """Allocate pages so that positions < new_len (and their compressed entries) have slots."""
        s = self.sizes
        # most decode steps allocate nothing: pages_needed == (0, 0, 0), tested inline (the graph decode step calls
        # this once per sequence on the host: ~1 -> ~0.3 us a call)
        if (new_len <= len(seq.token) * s.block_size
                and (not self.csa_layers or new_len // 4 <= len(seq.c4) * s.c4_block_size)
                and (not self.hca_layers or new_len // 128 <= len(seq.c128) * s.c128_block_size)):
            return
        if not self.can_grow(seq, new_len):
            tok, c4, c128 = self.pages_needed(seq, new_len)
            raise CapacityError(
                f"KV pools cannot hold {new_len} tokens for this sequence: need token/c4/c128 pages "
                f"{tok}/{c4}/{c128}, free {self.token_alloc.num_free}/{self.c4_alloc.num_free}/"
                f"{self.c128_alloc.num_free}")
        self._grow(seq.token, self.token_alloc, new_len, s.block_size)
        if self.csa_layers:
            self._grow(seq.c4, self.c4_alloc, new_len // 4, s.c4_block_size)
        if self.hca_layers:
            self._grow(seq.c128, self.c128_alloc, new_len // 128, s.c128_block_size)

    # ---- the pool protocol's prefix-caching questions (kv.protocol) ---------------------------------
    @property
    def radix_window(self) -> int | None:
        """Live tokens a cached prefix needs before its end: the sliding window and the open compression blocks."""
        return max(self.cfg.window_size, 128 if self.hca_layers else 0, 8 if self.csa_layers else 0)

    def entry_spaces(self) -> list[EntrySpace]:
        s = self.sizes
        return [EntrySpace(4, self.c4_alloc, s.c4_block_size, "c4"),
                EntrySpace(128, self.c128_alloc, s.c128_block_size, "c128")]

    def keep_from(self, num_tokens: int) -> int:
        """Oldest position a query at ``num_tokens`` or later can still read from the token pages."""
        keep = num_tokens - self.cfg.window_size + 1
        if self.csa_layers:
            keep = min(keep, 4 * (num_tokens // 4) - 4)
        if self.hca_layers:
            keep = min(keep, 128 * (num_tokens // 128))
        return max(keep, 0)

    def trim(self, seq: SeqBlocks) -> int:
        """Free token pages wholly older than :meth:`keep_from`; returns the number freed."""
        B = self.sizes.block_size
        last_dead = self.keep_from(seq.num_tokens) // B  # pages [0, last_dead) hold only dead positions
        head = seq.token[:last_dead]
        if head.count(-1) == len(head):  # most steps: trimmed already (a C-level scan, no Python loop)
            return 0
        dead = [p for p in head if p >= 0]
        self.token_alloc.free(dead)
        for i in range(min(last_dead, len(seq.token))):
            seq.token[i] = -1
        return len(dead)

    def free(self, seq: SeqBlocks) -> None:
        """Release every page of a finished sequence."""
        self.token_alloc.free(seq.token)
        self.c4_alloc.free(seq.c4)
        self.c128_alloc.free(seq.c128)
        seq.token, seq.c4, seq.c128, seq.num_tokens = [], [], [], 0

    def build_context(self, seqs: list[SeqBlocks], query_lens: list[int], logits: str = "last",
                      device=None) -> StepContext:
        return build_step_context(self, seqs, query_lens, logits, device)

    # ---- sizing --------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.swa, self.csa_state_kv, self.csa_state_score, self.idx_state_kv, self.idx_state_score,
            self.hca_state_kv, self.hca_state_score, self.c4, self.c4_idx, self.c128))
