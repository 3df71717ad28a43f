"""Page bookkeeping shared by every pool kind: the block allocator, one sequence's page tables, pool sizes.

A page ("block") is a fixed number of rows of every layer's pool tensor; pages are reference counted so that
sequences and the prefix cache can share them. Nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CapacityError


class BlockAllocator:
    """A free list of page ids ``0 .. num_blocks-1`` with reference counts (sequences and the prefix cache
    share pages): :meth:`alloc` hands out pages with one reference, :meth:`incref` adds one, :meth:`free`
    drops one and returns the page to the free list at zero."""

    def __init__(self, num_blocks: int, name: str):
        self.num_blocks = num_blocks
        self.name = name
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"KV pool '{self.name}' is full: need {n} more pages, {len(self._free)} free "
                                f"of {self.num_blocks}; raise num_blocks or lower the batch / context")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._used[p] = 1
        return out

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if p < 0:
                continue
            if p not in self._used:
                raise RuntimeError(f"KV pool '{self.name}': incref of free page {p}")
            self._used[p] += 1

    def refcount(self, page: int) -> int:
        return self._used.get(page, 0)

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p < 0:
                continue
            if p not in self._used:
                raise RuntimeError(f"KV pool '{self.name}': page {p} freed twice or never allocated")
            self._used[p] -= 1
            if self._used[p] == 0:
                del self._used[p]
                self._free.append(p)


@dataclass
class SeqBlocks:
    """One sequence's page tables. ``num_tokens`` positions 0..num_tokens-1 have their KV written."""

    token: list[int] = field(default_factory=list)  # -1 where a page was trimmed
    c4: list[int] = field(default_factory=list)
    c128: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class PoolSizes:
    block_size: int = 64
    c4_block_size: int = 16
    c128_block_size: int = 2
    num_blocks: int = 256
    num_c4_blocks: int = 256
    num_c128_blocks: int = 256


@dataclass(frozen=True)
class EntrySpace:
    """A page space of compressed entries (one entry per ``ratio`` tokens) beside the token pages: its
    allocator, entries per page, and the :class:`SeqBlocks` table (and :meth:`copy_page` space) it uses."""

    ratio: int
    alloc: BlockAllocator
    page_size: int
    table: str  # "c4" | "c128"
