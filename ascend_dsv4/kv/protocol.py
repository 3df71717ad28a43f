"""The pool protocol: what the engine's scheduler, the prefix cache and the runner may ask of any KV pool.

Both pool kinds satisfy it: :class:`~ascend_dsv4.kv.compressed_pools.V4KVPools` (DeepSeek-V4: sliding window,
compressor state, compressed entries) and :class:`~ascend_dsv4.kv.latent_pool.MLAKVPools` (DeepSeek-V3: the MLA
latent of every position). Callers never ask which kind they hold; where the two differ they ask the protocol:

* ``radix_window``: how many trailing tokens a cached prefix needs live in the token pages for a hit (the
  "window part" of the Shadow Radix Cache; tokens older than that may be tombstoned), or None when the pool
  keeps every position (full attention: a cached token holds its token page only);
* :meth:`entry_spaces`: the compressed-entry page spaces whose pages a cached token also holds (its "full
  part"), empty for the latent pool;
* :meth:`keep_from`: the oldest position a query at a given length can still read from the token pages.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from .blocks import BlockAllocator, EntrySpace, PoolSizes, SeqBlocks


@runtime_checkable
class KVPool(Protocol):
    sizes: PoolSizes
    dtype: torch.dtype
    device: torch.device
    token_alloc: BlockAllocator
    reclaim: Callable[[], bool] | None  # set by a prefix cache: frees some cached pages (False: nothing left)

    @property
    def radix_window(self) -> int | None: ...

    def entry_spaces(self) -> list[EntrySpace]: ...

    def keep_from(self, num_tokens: int) -> int: ...

    def can_grow(self, seq: SeqBlocks, new_len: int) -> bool: ...

    def ensure(self, seq: SeqBlocks, new_len: int) -> None: ...

    def trim(self, seq: SeqBlocks) -> int: ...

    def free(self, seq: SeqBlocks) -> None: ...

    def copy_page(self, space: str, src: int, dst: int) -> None: ...

    def build_context(self, seqs: list[SeqBlocks], query_lens: list[int], logits: str = "last", device=None): ...

    def nbytes(self) -> int: ...
