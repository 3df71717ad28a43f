"""Shadow radix cache (SGLang's hybrid sliding-window radix cache, ``mem_cache/swa_radix_cache.py``; vllm-ascend #16270)."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ascend_dsv4.engine.radix_cache import RadixCache


class Pools:
    """Records what the cache frees; fails on a double free of a slot it was never given."""

    def __init__(self):
        self.full: list[int] = []
        self.swa: list[int] = []

    def cache(self, window):
        return RadixCache(window, self.full.extend, self.swa.extend)

    def take(self):
        out = (sorted(self.full), sorted(self.swa))
        self.full.clear()
        self.swa.clear()
        return out


def shape(cache):
    """(start, key, tombstone) per node, depth first."""
    return [(s, list(k), t) for s, k, t, _, _ in cache.dump()]


# ---------------------------------------------------------------------------------------------- match


def seed_chain(pools):
    """Seed scenario: A [0,1] tombstone -> B [2,3] -> C [4,5], window 4, page size 1."""
    c = pools.cache(4)
    # a request whose window state of positions 0,1 was already freed (swa_evicted_seqlen=2)
    assert c.insert([0, 1, 2, 3], [10, 11, 12, 13], [22, 23], swa_evicted_seqlen=2) == 0
    # a longer request that reused that prefix (same slots: the cache's own, nothing freed)
    assert c.insert([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], [22, 23, 24, 25], swa_evicted_seqlen=2) == 4
    assert shape(c) == [(0, [0, 1], True), (2, [2, 3], False), (4, [4, 5], False)]
    assert pools.take() == ([], [])
    c.check_invariants()
    return c


def test_seed_match_full_chain_uses_safe_point_c():
    pools = Pools()
    c = seed_chain(pools)
    m = c.match_prefix([0, 1, 2, 3, 4, 5])
    assert m.length == 6
    assert m.full_slots == [10, 11, 12, 13, 14, 15]
    assert m.swa_slots == [22, 23, 24, 25] and m.swa_start == 2  # 4 live tokens after the tombstone
    assert m.node.key == [4, 5]
    # a longer prompt gets the same hit
    assert c.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).length == 6
    c.check_invariants()


@pytest.mark.parametrize("tokens", [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 7], [0, 1], [0]])
def test_seed_match_only_to_b_is_no_hit(tokens):
    pools = Pools()
    c = seed_chain(pools)
    m = c.match_prefix(tokens)  # only 2 (or 3) live window tokens after the tombstone
    assert (m.length, m.full_slots, m.swa_slots, m.node) == (0, [], [], c.root)
    assert shape(c) == [(0, [0, 1], True), (2, [2, 3], False), (4, [4, 5], False)]  # no split on a miss
    c.check_invariants()


def test_match_falls_back_to_last_safe_point():
    pools = Pools()
    c = pools.cache(4)
    c.insert(list(range(12)), list(range(100, 112)), list(range(200, 212)))
    c.insert(list(range(8)) + [99], list(range(100, 108)) + [150], list(range(200, 208)) + [250])
    c.insert(list(range(4)) + [98], list(range(100, 104)) + [151], list(range(200, 204)) + [251])
    assert pools.take() == ([], [])
    # swa-lock R = [8..11] (a full window by itself) and X1 = [0..3]; then evict all other window state:
    # X2 = [4..7] (internal) becomes a tombstone, the 1-token leaves [99] and [98] are deleted
    handles = [c.match_prefix(t).node for t in (list(range(12)), [0, 1, 2, 3])]
    assert [h.key for h in handles] == [[8, 9, 10, 11], [0, 1, 2, 3]]
    for h in handles:
        c.lock(h)
    assert c.evict_swa(100) == 6
    assert pools.take() == ([150, 151], [204, 205, 206, 207, 250, 251])
    assert shape(c) == [(0, [0, 1, 2, 3], False), (4, [4, 5, 6, 7], True), (8, [8, 9, 10, 11], False)]
    c.check_invariants()
    m = c.match_prefix(list(range(10)))  # X1 live(4) -> X2 tomb -> R: only 2 live after the tombstone
    assert (m.length, m.full_slots, m.swa_slots) == (4, [100, 101, 102, 103], [200, 201, 202, 203])
    m = c.match_prefix(list(range(12)))  # 4 live after the tombstone: usable
    assert (m.length, m.swa_slots) == (12, [208, 209, 210, 211])
    m = c.match_prefix(list(range(8)) + [99])  # 1 live after the tombstone
    assert m.length == 4
    for h in handles:
        c.unlock(h)
    c.check_invariants()


def test_short_prefix_needs_all_of_it_alive():
    pools = Pools()
    c = pools.cache(4)
    c.insert([0, 1, 2], [10, 11, 12], [20, 21, 22])
    m = c.match_prefix([0, 1, 2])
    assert (m.length, m.swa_slots, m.swa_start) == (3, [20, 21, 22], 0)
    m = c.match_prefix([0, 1, 5])  # ends inside the node: split, still usable (shorter than window, all alive)
    assert (m.length, m.full_slots, m.swa_slots) == (2, [10, 11], [20, 21])
    assert shape(c) == [(0, [0, 1], False), (2, [2], False)]
    c2 = pools.cache(4)
    c2.insert([0, 1, 2], [10, 11, 12], [21, 22], swa_evicted_seqlen=1)
    assert shape(c2) == [(0, [0], True), (1, [1, 2], False)]
    assert c2.match_prefix([0, 1, 2]).length == 0  # shorter than the window and partly dead
    c.check_invariants()
    c2.check_invariants()


@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 130, 513, 4095])
def test_any_prompt_length_hits(n):
    """vllm-ascend #16270: prompts under a 4096-token block never hit. Here every length does."""
    pools = Pools()
    c = pools.cache(128)
    toks = [(7 * i + 3) % 1000 for i in range(n)]
    c.insert(toks, list(range(n)), list(range(n)))
    m = c.match_prefix(toks + [5000])
    assert m.length == n and m.full_slots == list(range(n))
    assert m.swa_slots == list(range(max(0, n - 128), n))
    c.check_invariants()


def test_short_prompt_129_of_130_hits_with_window_128():
    pools = Pools()
    c = pools.cache(128)
    prompt = list(range(1000, 1130))
    c.insert(prompt, list(range(130)), list(range(500, 630)))
    m = c.match_prefix(prompt[:129] + [7, 8, 9])
    assert m.length == 129
    assert m.full_slots == list(range(129))
    assert m.swa_slots == list(range(501, 629)) and m.swa_start == 1
    assert shape(c) == [(0, prompt[:129], False), (129, [1129], False)]
    c.lock(m.node)
    assert c.evict_swa(1000) == 1 and c.evict_full(1000) == 0  # only the unlocked 1-token leaf goes
    assert pools.take() == ([129], [629])
    c.unlock(m.node)
    c.check_invariants()


# ---------------------------------------------------------------------------------------------- insert


def q_tree(pools):
    """Seed insert scenario: tombstoned node Q [0,1,2,3] (internal: a live child [8..11] hangs below)."""
    c = pools.cache(4)
    c.insert([0, 1, 2, 3, 8, 9, 10, 11], [100, 101, 102, 103, 104, 105, 106, 107], [204, 205, 206, 207],
             swa_evicted_seqlen=4)
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [8, 9, 10, 11], False)]
    return c


def test_insert_branch1_revives_whole_node():
    pools = Pools()
    c = q_tree(pools)
    assert c.insert(list(range(8)), list(range(10, 18)), list(range(20, 28)), swa_evicted_seqlen=0) == 4
    assert shape(c) == [(0, [0, 1, 2, 3], False), (4, [4, 5, 6, 7], False), (4, [8, 9, 10, 11], False)]
    d = {s: (f, w) for s, k, t, f, w in c.dump() if k[0] != 8}
    assert d[0] == ((100, 101, 102, 103), (20, 21, 22, 23))  # Q keeps its full slots, adopts the new window
    assert d[4] == ((14, 15, 16, 17), (24, 25, 26, 27))
    assert pools.take() == ([10, 11, 12, 13], [])  # duplicate full slots freed by the cache
    assert c.match_prefix(list(range(8))).length == 8
    assert c.match_prefix([0, 1, 2, 3]).length == 4
    c.check_invariants()


def test_insert_branch2_splits_node():
    pools = Pools()
    c = q_tree(pools)
    assert c.insert(list(range(8)), list(range(10, 18)), list(range(22, 28)), swa_evicted_seqlen=2) == 4
    assert shape(c) == [(0, [0, 1], True), (2, [2, 3], False), (4, [4, 5, 6, 7], False),
                        (4, [8, 9, 10, 11], False)]
    d = {s: (f, w) for s, k, t, f, w in c.dump() if k[0] != 8}
    assert d[0] == ((100, 101), None)
    assert d[2] == ((102, 103), (22, 23))
    assert d[4] == ((14, 15, 16, 17), (24, 25, 26, 27))
    assert pools.take() == ([10, 11, 12, 13], [])
    assert c.match_prefix(list(range(8))).length == 8  # 6 live after the tombstone
    assert c.match_prefix([0, 1, 2, 3]).length == 0
    c.check_invariants()


def test_insert_branch3_nothing_revived():
    pools = Pools()
    c = q_tree(pools)
    assert c.insert(list(range(8)), list(range(10, 18)), list(range(24, 28)), swa_evicted_seqlen=4) == 4
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [4, 5, 6, 7], False), (4, [8, 9, 10, 11], False)]
    assert pools.take() == ([10, 11, 12, 13], [])  # free(new_v0..new_v3), then the remaining key is added
    assert c.match_prefix(list(range(8))).length == 8
    c.check_invariants()


def test_insert_branch3_whole_key_evicted():
    # seed: swa_evicted_seqlen = 8; the remainder [4..7] has no window state and cannot become a
    # (tombstone) leaf: its full slots are freed as well
    pools = Pools()
    c = q_tree(pools)
    assert c.insert(list(range(8)), list(range(10, 18)), [], swa_evicted_seqlen=8) == 4
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [8, 9, 10, 11], False)]
    assert pools.take() == (list(range(10, 18)), [])
    c.check_invariants()


def test_insert_new_key_with_evicted_head_and_duplicates():
    pools = Pools()
    c = pools.cache(4)
    assert c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15], [33, 34, 35], swa_evicted_seqlen=3) == 0
    assert shape(c) == [(0, [1, 2, 3], True), (3, [4, 5, 6], False)]
    # same key, other slots: all duplicates are freed (window slots too, for the live part)
    assert c.insert([1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45], [51, 52, 53, 54, 55], swa_evicted_seqlen=1) == 6
    assert shape(c) == [(0, [1], True), (1, [2, 3], False), (3, [4, 5, 6], False)]  # branch 2 on [1,2,3]
    assert pools.take() == ([40, 41, 42, 43, 44, 45], [53, 54, 55])
    # the cache's own slots handed back (from a match) are not freed
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.length == 6 and m.swa_start == 2
    c.lock(m.node)
    assert c.insert([1, 2, 3, 4, 5, 6, 7], m.full_slots + [60], m.swa_slots + [70], swa_evicted_seqlen=2) == 6
    c.unlock(m.node)
    assert pools.take() == ([], [])
    # no window state at all on an empty path: nothing stored
    assert c.insert([9, 9], [80, 81], [], swa_evicted_seqlen=2) == 0
    assert pools.take() == ([80, 81], [])
    c.check_invariants()


def test_insert_rejects_bad_arguments():
    c = Pools().cache(4)
    with pytest.raises(ValueError):
        c.insert([1, 2], [1], [1, 2])
    with pytest.raises(ValueError):
        c.insert([1, 2], [1, 2], [1, 2], swa_evicted_seqlen=1)
    with pytest.raises(ValueError):
        c.insert([1, 2], [1, 2], None)
    with pytest.raises(ValueError):
        c.insert([1, 2], [1, 2], [], swa_evicted_seqlen=3)
    with pytest.raises(ValueError):
        Pools().cache(None).insert([1], [1], [5])
    with pytest.raises(ValueError):
        RadixCache(0, print, print)
    assert c.full_size() == 0


# -------------------------------------------------------------------------------------------- eviction


def two_leaves(pools, window=4):
    c = pools.cache(window)
    c.insert([0, 1, 2, 3, 10, 11, 12, 13], list(range(100, 108)), list(range(200, 208)))
    c.insert([0, 1, 2, 3, 20, 21, 22, 23], list(range(110, 118)), list(range(210, 218)))
    assert pools.take() == ([110, 111, 112, 113], [210, 211, 212, 213])
    assert shape(c) == [(0, [0, 1, 2, 3], False), (4, [10, 11, 12, 13], False), (4, [20, 21, 22, 23], False)]
    return c


def test_evict_swa_tombstones_internal_and_deletes_leaves():
    pools = Pools()
    c = two_leaves(pools)
    assert (c.full_size(), c.swa_size(), c.evictable_full(), c.evictable_swa()) == (12, 12, 12, 12)
    assert c.evict_swa(1) == 4  # LRU: the older leaf [10..13] goes entirely
    assert pools.take() == ([104, 105, 106, 107], [204, 205, 206, 207])
    assert c.evict_swa(1) == 4  # next: Q, internal -> tombstone, full slots kept
    assert pools.take() == ([], [200, 201, 202, 203])
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [20, 21, 22, 23], False)]
    assert (c.full_size(), c.swa_size()) == (8, 4)
    c.check_invariants()
    assert c.match_prefix([0, 1, 2, 3, 20, 21, 22, 23]).length == 8
    assert c.match_prefix([0, 1, 2, 3]).length == 0
    # full eviction: the leaf, then its tombstoned parent in cascade
    assert c.evict_full(1) == 8
    assert pools.take() == ([100, 101, 102, 103, 114, 115, 116, 117], [214, 215, 216, 217])
    assert shape(c) == [] and (c.full_size(), c.swa_size()) == (0, 0)
    c.check_invariants()


def test_swa_eviction_of_last_leaf_cascades():
    pools = Pools()
    c = two_leaves(pools)
    c.evict_swa(8)
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [20, 21, 22, 23], False)]
    pools.take()
    assert c.evict_swa(1) == 4  # the leaf; its tombstone parent becomes a leaf and is deleted too
    assert pools.take() == ([100, 101, 102, 103, 114, 115, 116, 117], [214, 215, 216, 217])
    assert shape(c) == []
    c.check_invariants()


def test_locked_nodes_survive_eviction():
    pools = Pools()
    c = two_leaves(pools)
    m = c.match_prefix([0, 1, 2, 3, 20, 21, 22, 23])
    c.lock(m.node)  # full: Q and L2; window (4 tokens): L2 only
    assert (c.evictable_full(), c.evictable_swa()) == (4, 8)
    assert c.evict_swa(100) == 8  # L1 deleted, Q tombstoned (it is not in the locked window)
    assert c.evict_full(100) == 0
    assert shape(c) == [(0, [0, 1, 2, 3], True), (4, [20, 21, 22, 23], False)]
    c.check_invariants()
    c.unlock(m.node)
    assert (c.evictable_full(), c.evictable_swa()) == (8, 4)
    assert c.evict_full(100) == 8 and shape(c) == []
    c.check_invariants()

    pools = Pools()
    c = two_leaves(pools, window=6)
    m = c.match_prefix([0, 1, 2, 3, 20, 21, 22, 23])
    c.lock(m.node)  # the 6-token window reaches into Q: Q's window state is locked too
    assert c.evict_swa(100) == 4
    assert shape(c) == [(0, [0, 1, 2, 3], False), (4, [20, 21, 22, 23], False)]
    with pytest.raises(ValueError):
        c.unlock(c.root.children[0])  # not the locked node
    c.unlock(m.node)
    c.check_invariants()
    with pytest.raises(ValueError):
        c.unlock(m.node)


def test_lock_survives_split_of_window_boundary():
    pools = Pools()
    c = pools.cache(4)
    c.insert(list(range(10)), list(range(10)), list(range(10)))
    a = c.match_prefix(list(range(10))).node
    c.lock(a)  # one node: whole of it swa-locked
    c.insert(list(range(3)) + [50], [0, 1, 2, 60], [0, 1, 2, 70])  # splits at 3
    c.insert(list(range(8)) + [51], list(range(8)) + [61], list(range(8)) + [71])  # splits at 8
    assert [(n[0], n[1]) for n in c.dump()] == [(0, (0, 1, 2)), (3, (3, 4, 5, 6, 7)), (8, (8, 9)), (8, (51,)),
                                                (3, (50,))]
    b = c.match_prefix(list(range(10))).node
    assert b is a
    c.lock(b)  # second lock: window boundary now at node [3..8)
    c.check_invariants()
    assert c.evict_swa(100) == 2  # only the two unlocked 1-token leaves
    c.unlock(a)
    c.check_invariants()
    c.unlock(a)
    c.check_invariants()
    assert c.evictable_full() == c.full_size() == 10
    assert c.evict_swa(100) == 10
    assert c.full_size() == 0 and pools.take() == (list(range(10)) + [60, 61], list(range(10)) + [70, 71])


def test_lock_rejects_dead_window_and_evicted_nodes():
    pools = Pools()
    c = seed_chain(pools)
    b = c.root.children[0].children[2]
    with pytest.raises(ValueError):
        c.lock(b)  # window of B reaches the tombstone A
    c.check_invariants()
    m = c.match_prefix([0, 1, 2, 3, 4, 5])
    c.evict_full(100)
    with pytest.raises(ValueError):
        c.lock(m.node)
    c.lock(c.root)
    c.unlock(c.root)


def test_reset_frees_everything():
    pools = Pools()
    c = two_leaves(pools)
    c.lock(c.match_prefix([0, 1, 2, 3, 10]).node)
    c.reset()
    full, swa = pools.take()
    assert full == [100, 101, 102, 103, 104, 105, 106, 107, 114, 115, 116, 117]
    assert swa == [200, 201, 202, 203, 204, 205, 206, 207, 214, 215, 216, 217]
    assert (c.full_size(), c.swa_size(), c.evictable_full()) == (0, 0, 0)
    assert c.match_prefix([0, 1, 2]).length == 0
    c.check_invariants()


# ------------------------------------------------------------------------------------- plain radix (V3)


def test_window_none_is_plain_radix_cache():
    pools = Pools()
    c = pools.cache(None)
    assert c.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert c.insert([1, 2, 5], [20, 21, 22], None) == 2
    assert pools.take() == ([20, 21], [])
    assert shape(c) == [(0, [1, 2], False), (2, [3, 4], False), (2, [5], False)]
    m = c.match_prefix([1, 2, 3, 9])
    assert (m.length, m.full_slots, m.swa_slots, m.swa_start) == (3, [10, 11, 12], [], 3)
    assert c.match_prefix([1]).length == 1 and c.match_prefix([7]).length == 0
    c.lock(m.node)
    assert c.evict_swa(100) == 0 and c.swa_size() == 0 and c.evictable_swa() == 0
    assert c.evict_full(100) == 2  # [4] and [5]; [1,2] -> [3] locked
    assert pools.take() == ([13, 22], [])
    c.check_invariants()
    c.unlock(m.node)
    assert c.evict_full(1) == 1  # the leaf [3]; [1,2] is live: no cascade
    assert c.evict_full(2) == 2 and pools.take() == ([10, 11, 12], [])
    c.check_invariants()


def test_evict_full_is_lru_over_leaves():
    pools = Pools()
    c = pools.cache(None)
    c.insert([1, 1], [1, 2])
    c.insert([2, 2], [3, 4])
    c.insert([3, 3], [5, 6])
    c.match_prefix([1, 1])  # touch
    assert c.evict_full(1) == 2 and pools.take() == ([3, 4], [])
    assert c.evict_full(3) == 4 and pools.take() == ([1, 2, 5, 6], [])


# ------------------------------------------------------------------------------------ stateful (random)


TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=10)


class CacheMachine(RuleBasedStateMachine):
    @initialize(window=st.sampled_from([None, 1, 2, 3, 4, 6]))
    def init(self, window):
        self.window = window
        self.cache = RadixCache(window, self._free_full, self._free_swa)
        self.next_slot = 0
        self.held_full: set[int] = set()  # slots owned by the cache (handed in, not yet freed)
        self.held_swa: set[int] = set()
        self.handed_full: list[int] = []
        self.handed_swa: list[int] = []
        self.freed_full: list[int] = []
        self.freed_swa: list[int] = []
        self.locks: list[tuple] = []  # (node, full_slots, swa_slots)

    # ---- the pools
    def _free_full(self, slots):
        assert slots
        for s in slots:
            assert s in self.held_full, f"full slot {s} freed twice or never handed in"
            self.held_full.remove(s)
        self.freed_full.extend(slots)

    def _free_swa(self, slots):
        assert slots and self.window is not None
        for s in slots:
            assert s in self.held_swa, f"swa slot {s} freed twice or never handed in"
            self.held_swa.remove(s)
        self.freed_swa.extend(slots)

    def _fresh(self, n, kind):
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        (self.handed_full if kind == "full" else self.handed_swa).extend(out)
        (self.held_full if kind == "full" else self.held_swa).update(out)
        return out

    # ---- reference
    def _reference(self, tokens):
        node, pos, per = self.cache.root, 0, []
        while pos < len(tokens):
            ch = node.children.get(tokens[pos])
            if ch is None:
                break
            k = 0
            while k < len(ch.key) and pos + k < len(tokens) and ch.key[k] == tokens[pos + k]:
                per.append((ch.full[k], None if ch.swa is None else ch.swa[k]))
                k += 1
            pos, node = pos + k, ch
            if k < len(ch.key):
                break
        best = run = 0
        for p, (_, s) in enumerate(per, 1):
            run = run + 1 if s is not None else 0
            if self.window is None or run >= min(self.window, p):
                best = p
        swa = [] if self.window is None or best == 0 else [s for _, s in per[best - min(self.window, best):best]]
        return best, [f for f, _ in per[:best]], swa

    # ---- rules
    @rule(tokens=TOKENS, data=st.data())
    def insert_fresh(self, tokens, data):
        n = len(tokens)
        full = self._fresh(n, "full")
        if self.window is None:
            self.cache.insert(tokens, full)
            assert self.cache.match_prefix(tokens).length == n
            return
        ev = data.draw(st.integers(0, n))
        self.cache.insert(tokens, full, self._fresh(n - ev, "swa"), swa_evicted_seqlen=ev)
        if n - ev >= min(self.window, n):  # a live window tail was inserted: it must hit, at any length
            assert self.cache.match_prefix(tokens).length == n

    @rule(prefix=TOKENS, extra=st.lists(st.integers(0, 3), max_size=6), data=st.data(),
          evict=st.integers(0, 12))
    def extend_a_match(self, prefix, extra, data, evict):
        """A request reuses a match (holding the lock), computes more tokens, then inserts them."""
        m = self.cache.match_prefix(prefix)
        self.cache.lock(m.node)
        self.cache.evict_swa(evict)  # pressure while the request runs: its state must survive
        self.cache.evict_full(evict)
        tokens = prefix[:m.length] + extra
        n = len(tokens)
        if n == 0:
            self.cache.unlock(m.node)
            return
        full = m.full_slots + self._fresh(n - m.length, "full")
        if self.window is None:
            self.cache.insert(tokens, full)
        else:
            ev = data.draw(st.integers(m.swa_start, n))
            swa = m.swa_slots[ev - m.swa_start:] + self._fresh(n - max(ev, m.length), "swa")
            self.cache.insert(tokens, full, swa, swa_evicted_seqlen=ev)
        self.cache.unlock(m.node)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        ref = self._reference(tokens)
        m = self.cache.match_prefix(tokens)
        assert (m.length, m.full_slots, m.swa_slots) == ref
        assert m.node is self.cache.root if m.length == 0 else m.node.end == m.length

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens)
        if m.length:
            self.cache.lock(m.node)
            self.locks.append((m.node, m.full_slots, m.swa_slots))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(k=st.integers(0, 20))
    def evict_swa(self, k):
        before = self.cache.evictable_swa()
        got = self.cache.evict_swa(k)
        assert got >= min(k, before) if self.window is not None else got == 0

    @rule(k=st.integers(0, 20))
    def evict_full(self, k):
        before = self.cache.evictable_full()
        assert self.cache.evict_full(k) >= min(k, before)

    @rule()
    def reset(self):
        self.cache.reset()
        self.locks.clear()
        assert not self.held_full and not self.held_swa

    # ---- invariants
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.check_invariants()
        dump = c.dump()
        assert sorted(f for d in dump for f in d[3]) == sorted(self.held_full)
        assert sorted(s for d in dump for s in (d[4] or ())) == sorted(self.held_swa)
        for node, full, swa in self.locks:  # locked state is still there, unchanged
            assert not node.deleted
            path, x = [], node
            while x is not c.root:
                path.append(x)
                x = x.parent
            assert [f for y in reversed(path) for f in y.full] == full
            if self.window is not None:
                live = [s for y in reversed(path) for s in (y.swa or [None] * len(y.key))]
                assert live[len(live) - len(swa):] == swa

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        for node, _, _ in self.locks:
            c.unlock(node)
        self.locks.clear()
        c.check_invariants()
        assert c.evictable_full() == c.full_size() and c.evictable_swa() == c.swa_size()
        c.evict_swa(10 ** 9)
        assert c.swa_size() == 0
        c.evict_full(10 ** 9)
        assert c.full_size() == 0 and c.dump() == []
        c.reset()
        c.check_invariants()
        # every slot ever handed in was freed exactly once
        assert Counter(self.freed_full) == Counter(self.handed_full)
        assert Counter(self.freed_swa) == Counter(self.handed_swa)


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_state_machine = CacheMachine.TestCase
