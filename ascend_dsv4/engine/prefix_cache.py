"""Prefix caching over the paged pools, with the Shadow Radix Cache of :mod:`.radix_cache`.

What a cached token holds (each as one reference on a page; pages are shared and reference counted):

- a pool with a window (``pools.radix_window`` set; DeepSeek-V4): "full" part = the entry pages of every
  entry space (``pools.entry_spaces()``: ratio-4 and ratio-128) that its position belongs to (entry ``p // 4``
  and ``p // 128``); "window" part = its token page (sliding-window K=V row and compressor state rows). A hit
  needs ``radix_window`` live window tokens before its end (V4: ``max(window_size, 128 with HCA layers, 8
  with CSA layers)``), which covers the sliding window and the open compression blocks.
- a pool without a window (``radix_window is None``; DeepSeek-V3's MLA latent pool): only a "full" part, its
  token page (a plain radix cache).

The cache asks the pool protocol (:mod:`ascend_dsv4.kv.protocol`), never which model family it serves.

Pages are position-aligned (logical page ``k`` holds positions ``[kB, (k+1)B)``), so a hit of length ``P``
becomes page tables directly: full pages are shared, and the partially filled pages the new request will
write into (the token page holding position ``P``, the entry pages holding entries ``P // 4`` and
``P // 128``) are copied first (copy-on-write). Compressed entries and compressor state are therefore reused
exactly, and a hit works at any prompt length at or above the window (a shorter prompt hits when all of it
is cached). A finished, aborted or preempted request inserts what it computed; the cache evicts least
recently used state when the pools run short.
"""

from __future__ import annotations

import itertools

from ..kv.protocol import KVPool
from .radix_cache import RadixCache
from .request import Request


class PrefixCache:
    def __init__(self, pools: KVPool, stats):
        self.pools, self.stats = pools, stats
        self.B = pools.sizes.block_size
        window = pools.radix_window
        self.windowed = window is not None
        self.radix = RadixCache(window, self._free_full, self._free_swa)
        self.full_refs: dict[int, list[tuple[object, int]]] = {}  # windowed: full slot -> (allocator, page) refs
        self._ids = itertools.count()
        self.matches: dict[str, object] = {}  # request id -> (locked node, Match)
        pools.reclaim = self.reclaim

    # ---- slot ownership callbacks ------------------------------------------------------------------------
    def _free_full(self, slots: list[int]) -> None:
        if not self.windowed:
            self.pools.token_alloc.free([s // self.B for s in slots])
            return
        for s in slots:
            for alloc, page in self.full_refs.pop(s):
                alloc.free([page])

    def _free_swa(self, slots: list[int]) -> None:
        self.pools.token_alloc.free([s // self.B for s in slots])

    def reclaim(self) -> bool:
        """Evict some least recently used cached state; False when nothing is left to evict."""
        freed = self.radix.evict_swa(64) if self.windowed else 0
        freed += self.radix.evict_full(64)
        return freed > 0

    # ---- admission: attach a cached prefix -----------------------------------------------------------------
    def attach(self, req: Request) -> None:
        ids = req.all_ids
        m = self.radix.match_prefix(ids[:-1])  # keep at least one token to compute
        self.stats.prefix_queries += 1
        self.stats.prefix_query_tokens += len(ids) - 1
        P = m.length
        if P == 0:
            return
        try:
            self._build_tables(req, m)
        except Exception:  # no room for the copy-on-write pages: run without the hit
            self.pools.free(req.seq)
            return
        self.radix.lock(m.node)
        self.matches[req.request_id] = (m.node, m)
        req.seq.num_tokens = P
        req.num_cached_tokens = min(P, len(req.prompt_ids))
        self.stats.prefix_hit_tokens += P

    def _page_of(self, table_pages: dict[int, int], k: int, page: int) -> None:
        table_pages[k] = page  # the last (largest-position) donor page wins: it holds all earlier rows too

    def _build_tables(self, req: Request, m) -> None:
        pools, B, P, seq = self.pools, self.B, m.length, req.seq
        tok_pages: dict[int, int] = {}
        if self.windowed:
            for i, slot in enumerate(m.swa_slots):
                pos = m.swa_start + i
                if pos >= pools.keep_from(P):
                    tok_pages[pos // B] = slot // B
            for sp in pools.entry_spaces():
                r, pages = sp.ratio, {}
                for e in range(P // r):  # complete entries: take the page from the token that completed it
                    for a, page in self.full_refs[m.full_slots[e * r + r - 1]]:
                        if a is sp.alloc:
                            pages[e // sp.page_size] = page
                setattr(seq, sp.table, self._share(sp.alloc, pages, sp.table, (P // r) % sp.page_size != 0))
        else:
            for pos, slot in enumerate(m.full_slots):
                tok_pages[pos // B] = slot // B
        seq.token = self._share(pools.token_alloc, tok_pages, "token", P % B != 0)

    def _share(self, alloc, pages: dict[int, int], space: str, last_partial: bool) -> list[int]:
        """A page table sharing ``pages`` (logical -> physical); the last one is copied when the new request
        will write into it (copy-on-write)."""
        if not pages:
            return []
        n = max(pages) + 1
        table = [pages.get(k, -1) for k in range(n)]
        if last_partial and table[-1] >= 0:
            new = alloc.alloc(1)[0]
            self.pools.copy_page(space, table[-1], new)
            table[-1] = new
            alloc.incref([p for p in table[:-1] if p >= 0])
        else:
            alloc.incref([p for p in table if p >= 0])
        return table

    # ---- insertion: what a request computed becomes cached --------------------------------------------------
    def _insert(self, req: Request) -> None:
        """Insert ``req``'s computed tokens (the cache takes one reference per token on their pages)."""
        seq, pools, B = req.seq, self.pools, self.B
        L = seq.num_tokens
        node_m = self.matches.get(req.request_id)
        m = node_m[1] if node_m else None
        P = m.length if m else 0
        if L <= P:
            return
        tokens = req.all_ids[:L]
        full = list(m.full_slots) if m else []
        for pos in range(P, L):
            full.append(self._new_full_slot(seq, pos))
        if not self.windowed:
            self.radix.insert(tokens, full)
            return
        live = [k for k, p in enumerate(seq.token) if p >= 0]
        evicted = live[0] * B if live else L
        if m is not None:
            evicted = max(evicted, m.swa_start)
        evicted = min(evicted, L)
        swa = []
        for pos in range(evicted, L):
            if m is not None and pos < P:
                swa.append(m.swa_slots[pos - m.swa_start])
            else:
                page = seq.token[pos // B]
                pools.token_alloc.incref([page])
                swa.append(page * B + pos % B)
        self.radix.insert(tokens, full, swa, evicted)

    def cache_unfinished(self, req: Request) -> None:
        """Cache a running request's computed tokens now (called after its prefill chunks, before its window
        pages are trimmed), so that requests sharing its prompt hit before it finishes — and whatever its own
        window trimming drops stays cached until evicted under memory pressure."""
        self._insert(req)
        m = self.radix.match_prefix(req.all_ids[: req.seq.num_tokens])
        old = self.matches.pop(req.request_id, None)
        if m.length == req.seq.num_tokens and m.length > 0:
            self.radix.lock(m.node)
            self.matches[req.request_id] = (m.node, m)
        if old:
            self.radix.unlock(old[0])

    def release(self, req: Request) -> None:
        """Insert what ``req`` computed, unlock its prefix, drop its own page references."""
        self._insert(req)
        node_m = self.matches.pop(req.request_id, None)
        if node_m:
            self.radix.unlock(node_m[0])
        self.pools.free(req.seq)

    def _new_full_slot(self, seq, pos: int) -> int:
        if not self.windowed:
            page = seq.token[pos // self.B]
            self.pools.token_alloc.incref([page])
            return page * self.B + pos % self.B
        refs = []
        for sp in self.pools.entry_spaces():
            table = getattr(seq, sp.table)
            k = (pos // sp.ratio) // sp.page_size
            if k < len(table) and table[k] >= 0:
                sp.alloc.incref([table[k]])
                refs.append((sp.alloc, table[k]))
        sid = next(self._ids)
        self.full_refs[sid] = refs
        return sid
