"""Paged latent pool for DeepSeek-V3 MLA (the compressed latent of the DeepSeek-V2 paper, §2.1).

One pool of token pages, ``block_size`` tokens each; per layer (backbone + MTP) and token it holds only the
compressed latent ``[c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe (qk_rope_head_dim, RoPE applied)]``:
(512 + 64) x 2 B = 1,152 B per token per layer in BF16 at V3 sizes, against 81,920 B for decompressed K and V.
Attention is full (causal), so no page is trimmed before the sequence is freed.

Layout: one ``[c_kv | k_pe]`` row per token (the reference layout, read by ``atb_ops.mla_decode``), or, when the
backend's ``atb_ops.KVLayout`` asks for ``mla_split_rope`` (the NPU backend: ``npu_fused_infer_attention_score``'s
paged MLA form takes separate contiguous nope / rope caches), two caches ``c_kv`` and ``k_pe`` of the same pages
(read by ``atb_ops.mla_decode_split``). :meth:`MLAKVPools.write` / :meth:`MLAKVPools.rows` serve both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CapacityError
from .blocks import BlockAllocator, EntrySpace, PoolSizes, SeqBlocks
from .tables import logits_rows, lookup_slots, page_tables, token_positions


@dataclass
class MLAStepContext:
    pools: "MLAKVPools"
    positions: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T]
    swa_slot: torch.Tensor  # [T] slot each new token's latent is written to
    context: torch.Tensor  # [T, Lmax] slots of positions 0..t (-1 padded)
    prefill: torch.Tensor  # [T] bool: token of a sequence with more than one new token (decompressed path)
    logits_index: torch.Tensor
    query_lens: list[int]
    starts: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class MLAKVPools:
    """The MLA latent of every position of every layer (backbone + MTP), paged (see module docstring)."""

    def __init__(self, cfg, sizes: PoolSizes, dtype: torch.dtype, device="cpu", split_rope: bool = False):
        self.cfg, self.sizes, self.dtype, self.device = cfg, sizes, dtype, torch.device(device)
        self.split_rope = split_rope
        shape = (cfg.n_layers + cfg.n_mtp_layers, sizes.num_blocks, sizes.block_size)
        C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if split_rope:
            self.latent = None
            self.c_kv = torch.zeros(*shape, C, dtype=dtype, device=self.device)
            self.k_pe = torch.zeros(*shape, R, dtype=dtype, device=self.device)
        else:
            self.latent = torch.zeros(*shape, C + R, dtype=dtype, device=self.device)
        self.token_alloc = BlockAllocator(sizes.num_blocks, "mla latent")
        self.reclaim = None  # set by a prefix cache

    def _tensors(self) -> list[torch.Tensor]:
        return [self.c_kv, self.k_pe] if self.split_rope else [self.latent]

    def layer(self, layer_id: int) -> torch.Tensor:
        """The ``[P, C + R]`` rows of one layer (reference layout only; see :meth:`layer_split`)."""
        if self.split_rope:
            raise RuntimeError("MLAKVPools.layer: this pool keeps c_kv and k_pe apart; use layer_split")
        return self.latent[layer_id].view(-1, self.latent.shape[-1])

    def layer_split(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c_kv [P, C], k_pe [P, R])`` of one layer (split layout only)."""
        return self.c_kv[layer_id].view(-1, self.c_kv.shape[-1]), self.k_pe[layer_id].view(-1, self.k_pe.shape[-1])

    def write(self, layer_id: int, slot: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store the latents of this step's tokens (``c_kv`` [T, C], ``k_pe`` [T, R]) at pool rows ``slot`` [T]."""
        if self.split_rope:
            c, r = self.layer_split(layer_id)
            c.index_copy_(0, slot, c_kv.to(c.dtype))
            r.index_copy_(0, slot, k_pe.to(r.dtype))
        else:
            pool = self.layer(layer_id)
            pool.index_copy_(0, slot, torch.cat([c_kv, k_pe], dim=-1).to(pool.dtype))

    def rows(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """``[c_kv | k_pe]`` ``[n, C + R]`` of pool rows ``slots`` (either layout)."""
        if self.split_rope:
            c, r = self.layer_split(layer_id)
            return torch.cat([c[slots], r[slots]], dim=-1)
        return self.layer(layer_id)[slots]

    def pages_needed(self, seq: SeqBlocks, new_len: int) -> int:
        return max(0, -(-new_len // self.sizes.block_size) - len(seq.token))

    def can_grow(self, seq: SeqBlocks, new_len: int) -> bool:
        while self.pages_needed(seq, new_len) > self.token_alloc.num_free:
            if self.reclaim is None or not self.reclaim():
                return False
        return True

    def copy_page(self, space: str, src: int, dst: int) -> None:
        for t in self._tensors():
            t[:, dst] = t[:, src]

    def ensure(self, seq: SeqBlocks, new_len: int) -> None:
        need = self.pages_needed(seq, new_len)
        if not self.can_grow(seq, new_len):
            raise CapacityError(f"MLA latent pool cannot hold {new_len} tokens for this sequence: need {need} "
                                f"pages, {self.token_alloc.num_free} free")
        if need:
            seq.token.extend(self.token_alloc.alloc(need))

    # ---- the pool protocol's prefix-caching questions (kv.protocol) ---------------------------------
    radix_window = None  # full attention: a cached token holds its latent page, no window part

    def entry_spaces(self) -> list[EntrySpace]:
        return []

    def keep_from(self, num_tokens: int) -> int:
        return 0

    def trim(self, seq: SeqBlocks) -> int:
        return 0  # full attention: every position stays readable

    def free(self, seq: SeqBlocks) -> None:
        self.token_alloc.free(seq.token)
        seq.token, seq.c4, seq.c128, seq.num_tokens = [], [], [], 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def build_context(self, seqs: list[SeqBlocks], query_lens: list[int], logits: str = "last",
                      device=None) -> MLAStepContext:
        device = self.device if device is None else device
        starts = [s.num_tokens for s in seqs]
        lens, seq_index, positions = token_positions(starts, query_lens)
        tables = page_tables([s.token for s in seqs])
        B = self.sizes.block_size
        slot = lookup_slots(tables, seq_index, positions, B)
        if bool((slot < 0).any()):
            raise RuntimeError("MLA step: a new token has no page; call ensure first")
        lmax = int(positions.max()) + 1 if len(positions) else 0
        ctx_pos = torch.arange(lmax).unsqueeze(0).expand(len(positions), -1)
        ctx_pos = torch.where(ctx_pos <= positions.unsqueeze(1), ctx_pos, torch.full_like(ctx_pos, -1))
        context = lookup_slots(tables, seq_index.unsqueeze(1).expand_as(ctx_pos), ctx_pos, B)
        prefill = (lens > 1)[seq_index]
        logits_index = logits_rows(lens, logits)
        return MLAStepContext(self, positions.to(device), seq_index.to(device), slot.to(device), context.to(device),
                              prefill.to(device), logits_index.to(device), list(query_lens), starts)
