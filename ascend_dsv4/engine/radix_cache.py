"""Prefix (radix) cache for hybrid full / sliding-window state (the design of SGLang's sliding-window radix cache,
``python/sglang/srt/mem_cache/swa_radix_cache.py``: window tombstones, two LRU lists).
About 640 lines for one data structure: the tree, its two eviction lists and the ownership contract below must
change together, so they stay in one module.

Pure Python, page size 1: every cached token owns

* one **full slot** (an ``int``): state that every later token may need -- for DeepSeek-V4 the
  compressed C4 / C128 entries and their compressor bookkeeping, for DeepSeek-V3 the MLA latent;
* one **swa slot** (an ``int``), optional: state only the last ``window`` tokens before a match end
  need -- the sliding-window KV and the open compressor window. It can be freed on its own while the
  full slot stays: the node then becomes a **tombstone**.

The caller maps slots to its own pages; the cache never interprets them. It gives slots back through
``on_free_full(list[int])`` / ``on_free_swa(list[int])`` (never called with an empty list).

With ``window=None`` there is no window state at all (V3): nothing is ever a tombstone, ``swa_slots``
are ``None`` / empty everywhere and the cache is a plain radix cache.

Why not a block-size threshold: vllm-ascend issue #16270 registers a prefix only in blocks of
``LCM(block sizes) = 4096`` tokens, so prompts under 4096 tokens never hit. Here a prefix of ANY length is
usable as soon as its window tail is alive (see :meth:`RadixCache.match_prefix`).

Ownership rules (the contract the engine relies on)
---------------------------------------------------
* :meth:`RadixCache.insert` **takes ownership of every slot handed to it**. Each one is either stored in
  the tree or freed at once through the callbacks -- the caller never frees a slot it passed to
  ``insert``. The one exception is a slot that is *identical* to the slot the tree already stores at
  the same position (the request got it from :meth:`match_prefix`): it is the cache's own slot and is
  left alone (neither freed nor counted twice).
* Slots returned by :meth:`match_prefix` stay owned by the cache. Lock the match node
  (:meth:`lock`) before using them and keep the lock until after the request's ``insert``; then
  :meth:`unlock`. Locked state is never evicted.
* :meth:`reset` frees every held slot through the callbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

FreeFn = Callable[[list[int]], None]


class TreeNode:
    """One radix-tree edge: ``key`` tokens occupying absolute positions ``[start, end)``.

    ``swa`` is ``None`` when the node is a tombstone (window state freed) or when the cache has no
    window. ``lock_bounds`` holds one entry per outstanding :meth:`RadixCache.lock` whose lock node is
    this node: the start position of the topmost node of that lock's window region (our equivalent of
    SGLang's ``swa_uuid``: it is invariant under node splits, which only subdivide the locked nodes).
    """

    __slots__ = ("key", "full", "swa", "tombstone", "children", "parent", "end",
                 "full_lock_ref", "swa_lock_ref", "lock_bounds", "deleted")

    def __init__(self, key: list[int], full: list[int], swa: Optional[list[int]], tombstone: bool,
                 parent: Optional["TreeNode"], end: int):
        self.key = key
        self.full = full
        self.swa = swa
        self.tombstone = tombstone
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.end = end
        self.full_lock_ref = 0
        self.swa_lock_ref = 0
        self.lock_bounds: list[Optional[int]] = []
        self.deleted = False

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"TreeNode([{self.start},{self.end}) key={self.key} tomb={self.tombstone} "
                f"full_ref={self.full_lock_ref} swa_ref={self.swa_lock_ref})")


class _LRUList:
    """Intrusive-style doubly linked list (least recent first), keyed by node identity."""

    def __init__(self):
        self._head = object()  # sentinels
        self._tail = object()
        self._next: dict[object, object] = {self._head: self._tail}
        self._prev: dict[object, object] = {self._tail: self._head}

    def __contains__(self, node) -> bool:
        return node in self._next

    def __len__(self) -> int:
        return len(self._next) - 1

    def _link_before(self, node, ref) -> None:
        p = self._prev[ref]
        self._next[p] = node
        self._prev[node] = p
        self._next[node] = ref
        self._prev[ref] = node

    def push_mru(self, node) -> None:
        if node in self._next:
            self.remove(node)
        self._link_before(node, self._tail)

    def insert_before(self, node, ref) -> None:
        """Link ``node`` just before (= less recent than) ``ref``, which must be in the list."""
        if node in self._next:
            self.remove(node)
        self._link_before(node, ref)

    def remove(self, node) -> None:
        p, n = self._prev.pop(node), self._next.pop(node)
        self._next[p] = n
        self._prev[n] = p

    def __iter__(self) -> Iterator[TreeNode]:
        x = self._next[self._head]
        while x is not self._tail:
            yield x
            x = self._next[x]

    def snapshot(self) -> list[TreeNode]:
        return list(self)


@dataclass(frozen=True)
class Match:
    """Result of :meth:`RadixCache.match_prefix`.

    * ``length``: number of usable leading tokens (0: no hit).
    * ``full_slots``: ``length`` full slots, one per position ``0 .. length-1``.
    * ``swa_slots``: the window slots of the last ``min(window, length)`` positions, i.e. positions
      ``swa_start .. length-1`` (all alive by construction); ``[]`` when ``window is None`` or on a miss.
    * ``node``: handle of the node ending at ``length`` (the root on a miss) for :meth:`RadixCache.lock`.
    """

    length: int
    full_slots: list[int]
    swa_slots: list[int]
    node: TreeNode

    @property
    def swa_start(self) -> int:
        """Position of ``swa_slots[0]``; a request that reuses this match holds no window state before
        it, so its ``swa_evicted_seqlen`` for :meth:`RadixCache.insert` is at least this."""
        return self.length - len(self.swa_slots)


class RadixCache:
    """Radix prefix cache with tombstoned sliding-window state (SGLang ``SWARadixCache`` semantics).

    Invariants (checked by :meth:`check_invariants`):

    * a leaf is never a tombstone (tombstoned parents left childless are deleted in cascade);
    * ``full_lock_ref >= swa_lock_ref`` on every node, ``full_lock_ref`` never grows going down the
      tree, a tombstone has ``swa_lock_ref == 0``;
    * the full LRU list holds every node, the swa LRU list exactly the non-tombstone nodes;
    * every held slot appears exactly once.
    """

    def __init__(self, window: Optional[int], on_free_full: FreeFn, on_free_swa: FreeFn):
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        self.window = window
        self._on_free_full = on_free_full
        self._on_free_swa = on_free_swa
        self._clear()

    # ------------------------------------------------------------------ sizes

    def full_size(self) -> int:
        """Tokens whose full slot the cache holds."""
        return self._full_size

    def swa_size(self) -> int:
        """Tokens whose window slot the cache holds (non-tombstone tokens)."""
        return self._swa_size

    def evictable_full(self) -> int:
        """Full tokens :meth:`evict_full` can free (not locked)."""
        return self._full_size - self._full_protected

    def evictable_swa(self) -> int:
        """Window tokens :meth:`evict_swa` can free (not swa-locked)."""
        return self._swa_size - self._swa_protected

    def reset(self) -> None:
        """Drop the whole tree, freeing every held slot through the callbacks; locks are forgotten."""
        full: list[int] = []
        swa: list[int] = []
        for node in self._iter_nodes():
            full.extend(node.full)
            if node.swa is not None:
                swa.extend(node.swa)
            node.deleted = True
        self._clear()
        self._free(full, swa)

    def _clear(self) -> None:
        self.root = TreeNode([], [], [], False, None, 0)
        self._full_lru = _LRUList()
        self._swa_lru = _LRUList()
        self._full_size = 0
        self._swa_size = 0
        self._full_protected = 0
        self._swa_protected = 0

    # ------------------------------------------------------------------ match

    def _usable(self, run: int, end: int) -> bool:
        """Rule of the seed: at least ``window`` live tokens right before ``end`` (or, for a prefix
        shorter than the window, all of it alive)."""
        return self.window is None or run >= min(self.window, end)

    def match_prefix(self, tokens: list[int]) -> Match:
        """Longest usable cached prefix of ``tokens``.

        Walk the tree along ``tokens``; a tombstone resets the count of consecutive live tokens. A
        prefix ending at ``p`` is usable iff the last ``min(window, p)`` tokens before ``p`` are all
        alive; the result is the deepest usable ``p`` ("else fall back to the last safe point"). A
        match ending inside a node splits it, so the returned node ends exactly at ``length``. The
        path to the result node is touched (moved to MRU in both LRU lists, root side least recent).

        To keep at least one token to compute, pass ``tokens[:-1]``.
        """
        node = self.root
        pos = 0
        run = 0
        best, best_end = self.root, 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common_len(child.key, tokens, pos)
            end = pos + k
            run = 0 if child.tombstone else run + k
            usable = not child.tombstone and self._usable(run, end)
            if k < len(child.key):  # the match ends inside this node
                if usable:
                    child = self._split(child, k)
                    best, best_end = child, end
                break
            if usable:
                best, best_end = child, end
            pos = end
            node = child
        return self._make_match(best, best_end)

    def _make_match(self, node: TreeNode, length: int) -> Match:
        path = self._path(node)
        full: list[int] = []
        for x in path:
            full.extend(x.full)
        swa: list[int] = []
        if self.window is not None and length > 0:
            need = min(self.window, length)
            for x in reversed(path):
                assert x.swa is not None
                take = min(need - len(swa), len(x.swa))
                swa[:0] = x.swa[len(x.swa) - take:]
                if len(swa) == need:
                    break
        self._touch(path)
        return Match(length, full, swa, node)

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: list[int], full_slots: list[int], swa_slots: Optional[list[int]] = None,
               swa_evicted_seqlen: int = 0) -> int:
        """Insert ``tokens`` with their slots; return how many leading tokens were already cached.

        * ``full_slots``: one per token.
        * ``swa_slots``: the request's live window slots for positions ``swa_evicted_seqlen ..
          len(tokens)-1`` (so ``len(swa_slots) == len(tokens) - swa_evicted_seqlen``); the request
          holds no window state before ``swa_evicted_seqlen``. Must be ``None`` / ``[]`` when
          ``window is None`` (``swa_evicted_seqlen`` is then ignored).

        The cache takes ownership of every slot passed in (see module docstring): slots it does not
        keep are freed through the callbacks before this returns; slots identical to the ones already
        stored at the same position are the cache's own and are left alone.

        Walking into an existing node covering ``[s, e)``: its full slots stay, the passed ones are
        duplicates. If the node is a tombstone (seed's insert branches):

        1. ``swa_evicted_seqlen <= s``: revived with the passed window slots;
        2. ``s < swa_evicted_seqlen < e``: split at ``swa_evicted_seqlen``; the first part stays a
           tombstone, the second is revived;
        3. ``swa_evicted_seqlen >= e``: nothing revived (no window slots were passed for it).

        If the node is alive, passed window slots for it are duplicates. The remaining key becomes new
        nodes: a tombstone for ``[.., swa_evicted_seqlen)`` and a live leaf after it. A remainder with
        no window state at all (``swa_evicted_seqlen >= len(tokens)``) cannot be stored (a leaf may not
        be a tombstone): its full slots are freed.
        """
        n = len(tokens)
        if len(full_slots) != n:
            raise ValueError(f"insert: {n} tokens but {len(full_slots)} full slots")
        if self.window is None:
            if swa_slots:
                raise ValueError("insert: this cache has no window state; pass swa_slots=None")
            ev = 0
            swa_slots = []
        else:
            if swa_slots is None:
                raise ValueError("insert: swa_slots is required when window is set")
            ev = swa_evicted_seqlen
            if not 0 <= ev <= n:
                raise ValueError(f"insert: swa_evicted_seqlen={ev} outside [0, {n}]")
            if len(swa_slots) != n - ev:
                raise ValueError(f"insert: expected {n - ev} swa slots (positions {ev}..{n - 1}), "
                                 f"got {len(swa_slots)}")
        free_full: list[int] = []
        free_swa: list[int] = []
        path: list[TreeNode] = []
        node = self.root
        pos = 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common_len(child.key, tokens, pos)
            if k < len(child.key):
                child = self._split(child, k)
            s, e = pos, pos + k
            free_full.extend(f for f, mine in zip(full_slots[s:e], child.full) if f != mine)
            if self.window is not None:
                if child.tombstone:
                    if ev <= s:  # branch 1: revive the whole node
                        self._revive(child, list(swa_slots[s - ev:e - ev]))
                    elif ev < e:  # branch 2: [s, ev) stays dead, [ev, e) revived
                        upper = self._split(child, ev - s)
                        path.append(upper)
                        self._revive(child, list(swa_slots[0:e - ev]))
                    # branch 3 (ev >= e): nothing passed for this node, nothing revived
                else:
                    lo = max(s, ev)
                    free_swa.extend(w for w, mine in zip(swa_slots[lo - ev:e - ev], child.swa[lo - s:])
                                    if w != mine)
            path.append(child)
            node = child
            pos = e
        already = pos
        if pos < n:
            if self.window is None:
                path.append(self._add_node(node, tokens[pos:], full_slots[pos:], None))
            elif ev >= n:
                free_full.extend(full_slots[pos:])
            else:
                if ev > pos:
                    node = self._add_node(node, tokens[pos:ev], full_slots[pos:ev], None)
                    path.append(node)
                    pos = ev
                path.append(self._add_node(node, tokens[pos:], full_slots[pos:],
                                           list(swa_slots[pos - ev:])))
        self._touch(path)
        self._free(free_full, free_swa)
        return already

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """Protect the full state of ``node``'s whole path and the window state of its last
        ``window`` tokens (whole nodes) from eviction. ``lock(root)`` is a no-op."""
        if node is self.root:
            return
        if node.deleted:
            raise ValueError("lock: node was evicted; match again")
        bound: Optional[int] = None
        if self.window is not None:
            lo = max(0, node.end - self.window)
            x = node
            while x is not self.root and x.end > lo:
                if x.tombstone:
                    raise ValueError("lock: the window before this node is not alive (tombstone); "
                                     "only nodes returned by match_prefix can be locked")
                bound = x.start
                x = x.parent
            x = node
            while x is not self.root and x.start >= bound:
                if x.swa_lock_ref == 0:
                    self._swa_protected += len(x.key)
                x.swa_lock_ref += 1
                x = x.parent
        x = node
        while x is not self.root:
            if x.full_lock_ref == 0:
                self._full_protected += len(x.key)
            x.full_lock_ref += 1
            x = x.parent
        node.lock_bounds.append(bound)

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``. ``unlock(root)`` is a no-op."""
        if node is self.root:
            return
        if not node.lock_bounds:
            raise ValueError("unlock: node is not locked")
        bound = node.lock_bounds.pop()
        x = node
        while x is not self.root:
            x.full_lock_ref -= 1
            if x.full_lock_ref == 0:
                self._full_protected -= len(x.key)
            if bound is not None and x.start >= bound:
                x.swa_lock_ref -= 1
                if x.swa_lock_ref == 0:
                    self._swa_protected -= len(x.key)
            x = x.parent

    # ------------------------------------------------------------------ eviction

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` window slots (if possible), least recently used first.

        An internal node loses its window slots and becomes a tombstone (full slots and tree shape
        stay); a leaf is deleted with all its slots (then tombstoned parents left childless too).
        Swa-locked nodes are skipped. Returns the number of window slots freed."""
        if self.window is None:
            return 0
        freed = 0
        free_full: list[int] = []
        free_swa: list[int] = []
        for x in self._swa_lru.snapshot():
            if freed >= num_tokens:
                break
            if x.deleted or x.tombstone or x.swa_lock_ref > 0:
                continue
            if x.children:
                free_swa.extend(x.swa)
                freed += len(x.swa)
                self._swa_lru.remove(x)
                self._swa_size -= len(x.swa)
                x.swa = None
                x.tombstone = True
            elif x.full_lock_ref == 0:
                freed += len(x.key)
                self._delete_leaf_cascade(x, free_full, free_swa)
        self._free(free_full, free_swa)
        return freed

    def evict_full(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` full slots (if possible): unlocked leaves, least recently used
        first, with their window slots; tombstoned parents left childless go too. Returns the number
        of full slots freed."""
        freed = 0
        free_full: list[int] = []
        free_swa: list[int] = []
        while freed < num_tokens:
            restart = False
            for x in self._full_lru.snapshot():
                if freed >= num_tokens:
                    break
                if x.deleted or x.children or x.full_lock_ref > 0:
                    continue
                before = len(free_full)
                parent = self._delete_leaf_cascade(x, free_full, free_swa)
                freed += len(free_full) - before
                if parent is not self.root and not parent.children and parent.full_lock_ref == 0:
                    restart = True  # the parent became an evictable leaf, maybe older than the rest
                    break
            if not restart:
                break
        self._free(free_full, free_swa)
        return freed

    # ------------------------------------------------------------------ internals

    def _free(self, full: list[int], swa: list[int]) -> None:
        if full:
            self._on_free_full(full)
        if swa:
            self._on_free_swa(swa)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _touch(self, path: list[TreeNode]) -> None:
        """Move the path (root side first) to the MRU end of both lists; deepest = most recent."""
        swa = self.window is not None
        for x in path:
            self._full_lru.push_mru(x)
            if swa and not x.tombstone:
                self._swa_lru.push_mru(x)

    def _add_node(self, parent: TreeNode, key: list[int], full: list[int],
                  swa: Optional[list[int]]) -> TreeNode:
        tomb = self.window is not None and swa is None
        x = TreeNode(list(key), list(full), None if self.window is None else swa, tomb, parent,
                     parent.end + len(key))
        parent.children[key[0]] = x
        self._full_size += len(key)
        self._full_lru.push_mru(x)
        if self.window is not None and not tomb:
            self._swa_size += len(key)
            self._swa_lru.push_mru(x)
        return x

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after ``k`` tokens. A new node takes the first part and becomes the parent;
        ``child`` keeps the rest (so handles to ``child`` still end at the same position). Lock refs
        are copied (both parts were locked); the new node is slightly older in both LRU lists."""
        assert 0 < k < len(child.key)
        parent = child.parent
        new = TreeNode(child.key[:k], child.full[:k], None if child.swa is None else child.swa[:k],
                       child.tombstone, parent, child.start + k)
        new.full_lock_ref = child.full_lock_ref
        new.swa_lock_ref = child.swa_lock_ref
        child.key = child.key[k:]
        child.full = child.full[k:]
        if child.swa is not None:
            child.swa = child.swa[k:]
        parent.children[new.key[0]] = new
        new.children[child.key[0]] = child
        child.parent = new
        self._full_lru.insert_before(new, child)
        if child in self._swa_lru:
            self._swa_lru.insert_before(new, child)
        return new

    def _revive(self, node: TreeNode, swa: list[int]) -> None:
        assert node.tombstone and node.swa_lock_ref == 0 and len(swa) == len(node.key)
        node.swa = swa
        node.tombstone = False
        self._swa_size += len(swa)
        self._swa_lru.push_mru(node)

    def _delete_leaf_cascade(self, x: TreeNode, free_full: list[int], free_swa: list[int]) -> TreeNode:
        """Delete leaf ``x`` (collecting its slots), then every tombstoned ancestor left childless.
        Returns the first surviving ancestor."""
        while True:
            assert not x.children and x.full_lock_ref == 0 and x is not self.root
            free_full.extend(x.full)
            self._full_size -= len(x.full)
            self._full_lru.remove(x)
            if not x.tombstone and self.window is not None:
                free_swa.extend(x.swa)
                self._swa_size -= len(x.swa)
                self._swa_lru.remove(x)
            parent = x.parent
            del parent.children[x.key[0]]
            x.deleted = True
            x.parent = None
            if parent is self.root or parent.children or not parent.tombstone:
                return parent
            x = parent

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    # ------------------------------------------------------------------ checks / debugging

    def dump(self) -> list[tuple[int, tuple[int, ...], bool, tuple[int, ...], Optional[tuple[int, ...]]]]:
        """Every node as ``(start, key, tombstone, full_slots, swa_slots)``, depth first, children in
        key order (for tests and debugging)."""
        out = []

        def rec(x: TreeNode) -> None:
            for t in sorted(x.children):
                c = x.children[t]
                out.append((c.start, tuple(c.key), c.tombstone, tuple(c.full),
                            None if c.swa is None else tuple(c.swa)))
                rec(c)

        rec(self.root)
        return out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any structural invariant is broken."""
        nodes = list(self._iter_nodes())
        w = self.window
        full_seen: set[int] = set()
        swa_seen: set[int] = set()
        exp_full_ref = {id(x): 0 for x in nodes}
        exp_swa_ref = {id(x): 0 for x in nodes}
        full_size = swa_size = full_prot = swa_prot = 0
        assert self.root.full_lock_ref == 0 and self.root.swa_lock_ref == 0 and not self.root.lock_bounds
        for x in nodes:
            assert not x.deleted, "deleted node still in the tree"
            assert x.key and len(x.key) == len(x.full), "empty key or full slots / key length mismatch"
            assert x.parent.children.get(x.key[0]) is x, "parent link broken"
            assert x.end == x.parent.end + len(x.key), "positions broken"
            assert all(c.key[0] == t for t, c in x.children.items()), "child keyed by wrong token"
            if w is None:
                assert not x.tombstone and x.swa is None and x.swa_lock_ref == 0
            elif x.tombstone:
                assert x.swa is None and x.swa_lock_ref == 0, "tombstone holds window state / swa lock"
                assert x.children, "leaf tombstone"
            else:
                assert x.swa is not None and len(x.swa) == len(x.key)
            for s in x.full:
                assert s not in full_seen, f"full slot {s} held twice"
                full_seen.add(s)
            for s in x.swa or ():
                assert s not in swa_seen, f"swa slot {s} held twice"
                swa_seen.add(s)
            full_size += len(x.key)
            swa_size += 0 if x.swa is None else len(x.swa)
            assert x.full_lock_ref >= x.swa_lock_ref >= 0
            assert x.full_lock_ref <= x.parent.full_lock_ref or x.parent is self.root
            if x.full_lock_ref:
                full_prot += len(x.key)
            if x.swa_lock_ref:
                swa_prot += len(x.key)
            for bound in x.lock_bounds:  # recompute lock refs from the outstanding locks
                y = x
                while y is not self.root:
                    exp_full_ref[id(y)] += 1
                    if bound is not None and y.start >= bound:
                        exp_swa_ref[id(y)] += 1
                    y = y.parent
                if w is None:
                    assert bound is None
                else:
                    assert bound is not None and bound <= max(0, x.end - w), "swa lock misses the window"
        for x in nodes:
            assert x.full_lock_ref == exp_full_ref[id(x)], "full_lock_ref mismatch"
            assert x.swa_lock_ref == exp_swa_ref[id(x)], "swa_lock_ref mismatch"
        assert (full_size, swa_size) == (self._full_size, self._swa_size), "size counters"
        assert (full_prot, swa_prot) == (self._full_protected, self._swa_protected), "protected counters"
        full_list = self._full_lru.snapshot()
        swa_list = self._swa_lru.snapshot()
        assert len(full_list) == len(nodes) and {id(x) for x in full_list} == {id(x) for x in nodes}, \
            "full LRU list != tree nodes"
        live = {id(x) for x in nodes if w is not None and not x.tombstone}
        assert len(swa_list) == len(live) and {id(x) for x in swa_list} == live, \
            "swa LRU list != live nodes"


def _common_len(key: list[int], tokens: list[int], pos: int) -> int:
    k = 0
    m = min(len(key), len(tokens) - pos)
    while k < m and key[k] == tokens[pos + k]:
        k += 1
    return k
