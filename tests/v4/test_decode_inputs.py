"""The decode fast path's device-side step context (kv/decode_inputs.py) equals build_step_context's.

Random batches of sequences at random positions and at the window / ratio boundaries, several page geometries and
layer mixes, padded rows, stale host rows; run on CPU tensors (the torch ops; a captured graph on CUDA runs the
one-launch kernel instead, checked against these ops by test_decode_context_kernel.py)."""

from __future__ import annotations

import random

import pytest
import torch

from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder, _width
from ascend_dsv4.kv import PoolSizes, SeqBlocks, V4KVPools
from ascend_dsv4.kv.context import build_step_context
from ascend_dsv4.kv.decode_inputs import DecodeInputs, DecodeLayout, derive_decode_context, token_span
from ascend_dsv4.models import preset

TRASH_TOKEN, TRASH_ENTRY = 10 ** 6, {4: 10 ** 6 + 1, 128: 10 ** 6 + 2}


def _pools(window: int, ratios: tuple, pages: tuple[int, int, int], cap: int = 4096, n_seqs: int = 24,
           device: str = "cpu"):
    cfg = preset("toy-v4").replace(window_size=window, n_layers=len(ratios), n_mtp_layers=0,
                                   n_hash_layers=min(1, len(ratios)), compress_ratios=ratios)
    B, B4, B128 = pages
    sizes = PoolSizes(block_size=B, c4_block_size=B4, c128_block_size=B128,
                      num_blocks=n_seqs * (-(-cap // B) + 1), num_c4_blocks=n_seqs * (-(-cap // (4 * B4)) + 1),
                      num_c128_blocks=n_seqs * (-(-cap // (128 * B128)) + 1))
    return V4KVPools(cfg, sizes, torch.bfloat16, device)


def _seq(pools, t: int, extra: int = 0) -> SeqBlocks:
    """A sequence with t tokens computed (old pages trimmed), its pages grown for t + 1 (+ extra: pages a rolled
    back draft left allocated)."""
    s = SeqBlocks()
    pools.ensure(s, t + extra)
    s.num_tokens = t
    pools.trim(s)
    pools.ensure(s, t + 1)
    return s


def _positions(window: int, rng: random.Random, n: int) -> list[int]:
    special = [0, 1, 3, 4, 7, 8, window - 1, window, window + 1, 127, 128, 255, 256, 511, 1023, 1024]
    special += [4 * rng.randint(1, 700) - 1 for _ in range(4)] + [128 * rng.randint(1, 20) - 1 for _ in range(3)]
    return [rng.choice(special) if rng.random() < 0.6 else rng.randint(0, 3000) for _ in range(n)]


def _derive(pools, seqs, bucket: int, extra_width: int = 0):
    tmax = max(s.num_tokens for s in seqs)
    ratios = [r for r, ls in ((4, pools.csa_layers), (128, pools.hca_layers)) if ls]
    layout = DecodeLayout.for_pools(pools, bucket, {r: _width((tmax + 1) // r) + extra_width for r in ratios})
    inp = DecodeInputs(layout, "cpu")
    ids = list(range(5, 5 + len(seqs)))
    inp.fill(seqs, ids)
    inp.upload()
    return inp, derive_decode_context(inp, pools, TRASH_TOKEN, TRASH_ENTRY)


def assert_same_context(d, e, n: int, b: int) -> None:
    """``d`` (derived, b static rows) equals ``e`` (build_step_context, n rows) up to the padding conventions."""
    assert d.positions.shape == (b,) and torch.equal(d.positions[:n], e.positions)
    assert (d.positions[n:] == 0).all()
    assert torch.equal(d.seq_index[:n], e.seq_index) and torch.equal(d.logits_index, torch.arange(b, device=d.logits_index.device))
    assert torch.equal(d.swa_slot[:n], e.swa_slot) and (d.swa_slot[n:] == TRASH_TOKEN).all()
    assert d.window.shape == (b, e.window.shape[1])
    assert torch.equal(d.window[:n], e.window) and (d.window[n:] == -1).all()
    assert sorted(d.compress) == sorted(e.compress)
    for r, ec in e.compress.items():
        dc = d.compress[r]
        done = dc.new_slot != TRASH_ENTRY[r]
        assert not done[n:].any()
        # the completed entries, in token order, are build_step_context's [M] rows
        assert torch.equal(dc.new_slot[done], ec.new_slot)
        assert torch.equal(dc.new_cand[done], ec.new_cand)
        assert torch.equal(dc.new_pos[done], ec.new_pos)
        assert (dc.new_cand[~done] == -1).all() and (dc.new_pos[~done] == 0).all()
        m = ec.visible.shape[1]
        assert dc.visible.shape[0] == b and dc.visible.shape[1] >= m
        assert torch.equal(dc.visible[:n, :m], ec.visible)
        assert (dc.visible[:n, m:] == -1).all() and (dc.visible[n:] == -1).all()


GEOMETRIES = [
    (128, (0, 4, 128), (64, 64, 8)),  # Flash window, bench_decode's pages
    (128, (0, 4, 128), (16, 16, 2)),  # plan_pool_sizes' pages
    (32, (0, 0, 4, 128, 4), (16, 4, 1)),  # toy window, tiny entry pages
    (32, (0, 4, 4), (8, 2, 1)),  # CSA only: token span 31
    (128, (0, 128), (32, 16, 1)),  # HCA only: token span 127
    (16, (0, 0), (8, 16, 2)),  # window only
]


@pytest.mark.parametrize("window,ratios,pages", GEOMETRIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_derived_context_equals_build_step_context(window, ratios, pages, seed):
    pools = _pools(window, ratios, pages)
    rng = random.Random(seed)
    n = rng.randint(1, 11)
    seqs = [_seq(pools, t, extra=rng.choice([0, 0, 3, 70])) for t in _positions(window, rng, n)]
    for bucket in (n, n + 5):  # exact and with padded rows
        inp, d = _derive(pools, seqs, bucket, extra_width=rng.choice([0, 16]))
        e = build_step_context(pools, seqs, [1] * n, "last", "cpu")
        assert_same_context(d, e, n, bucket)
        assert torch.equal(inp.ids[:n], torch.arange(5, 5 + n)) and (inp.ids[n:] == 0).all()


def test_token_table_is_the_pages_a_decode_token_reads():
    for window, ratios, pages in GEOMETRIES:
        pools = _pools(window, ratios, pages, cap=64, n_seqs=2)
        S = token_span(pools)
        assert S == max(window - 1, 7 if 4 in ratios else 0, 127 if 128 in ratios else 0)
        layout = DecodeLayout.for_pools(pools, 1, {})
        B = pages[0]
        # pages (t - S) // B .. t // B of every t fit in the static width
        assert max(t // B - max(t - S, 0) // B + 1 for t in range(4 * B + S)) <= layout.token_cols


def test_one_position_at_a_time_through_boundaries():
    """One sequence decoding 0 .. 600 next to one at a fixed position: every step's derived context is exact."""
    pools = _pools(32, (0, 4, 128), (16, 4, 1), cap=1024, n_seqs=4)
    a, other = SeqBlocks(), _seq(pools, 300)
    for t in range(600):
        pools.ensure(a, t + 1)
        _, d = _derive(pools, [a, other], 4)
        assert_same_context(d, build_step_context(pools, [a, other], [1, 1], "last", "cpu"), 2, 4)
        a.num_tokens += 1
        pools.trim(a)


def test_fill_rewrites_only_what_changed_and_stays_exact():
    """A reused bucket (the host keeps its rows between steps): different sequences per row, a shrinking batch,
    page tables changed in place (a trimmed token page, a replaced entry page) all land in the device buffer."""
    pools = _pools(32, (0, 4, 128), (16, 4, 1), cap=2048, n_seqs=12)
    rng = random.Random(7)
    seqs = [_seq(pools, t) for t in (5, 300, 131, 1000, 64, 127)]
    layout = DecodeLayout.for_pools(pools, 8, {4: _width(1001 // 4 + 64), 128: _width(1001 // 128 + 1)})
    inp = DecodeInputs(layout, "cpu")
    for step in range(40):
        batch = rng.sample(seqs, rng.randint(1, len(seqs)))
        if step % 5 == 4:  # an entry page replaced in place (as a copy-on-write would)
            s = rng.choice(batch)
            if s.c4:
                s.c4[0] = pools.c4_alloc.alloc(1)[0]
        inp.fill(batch, [1] * len(batch))
        inp.upload()
        fresh = DecodeInputs(layout, "cpu")
        fresh.fill(batch, [1] * len(batch))
        fresh.upload()
        n = len(batch)
        assert torch.equal(inp.positions, fresh.positions) and torch.equal(inp.ids, fresh.ids)
        assert torch.equal(inp.token_table[:n], fresh.token_table[:n])
        for r in inp.tables:
            assert torch.equal(inp.tables[r][:n], fresh.tables[r][:n])
        d = derive_decode_context(inp, pools, TRASH_TOKEN, TRASH_ENTRY)
        assert_same_context(d, build_step_context(pools, batch, [1] * n, "last", "cpu"), n, 8)
        for s in batch:  # advance the batch by one token
            s.num_tokens += 1
            pools.trim(s)
            pools.ensure(s, s.num_tokens + 1)


def test_shapes_are_static_per_bucket():
    """Nothing of the derived context's shapes depends on the data (what a captured graph needs); int64, contiguous."""
    pools = _pools(128, (0, 4, 128), (64, 64, 8))
    layout = DecodeLayout.for_pools(pools, 16, {4: 512, 128: 16})
    inp = DecodeInputs(layout, "cpu")
    shapes = None
    for ts in ([0], [127, 128, 2000], [2047] * 16, [3, 7, 11, 15, 19]):
        inp.fill([_seq(pools, t) for t in ts], [0] * len(ts))
        inp.upload()
        d = derive_decode_context(inp, pools, TRASH_TOKEN, TRASH_ENTRY)
        tensors = [d.positions, d.swa_slot, d.window]
        tensors += [x for cc in d.compress.values() for x in (cc.new_cand, cc.new_pos, cc.new_slot, cc.visible)]
        assert all(x.is_contiguous() and x.dtype == torch.long for x in tensors)  # what the kernels index with
        got = [tuple(x.shape) for x in tensors]
        assert shapes is None or got == shapes
        shapes = got
    assert shapes[:3] == [(16,), (16,), (16, 128)]
    assert shapes[3:] == [(16, 8), (16,), (16,), (16, 512), (16, 128), (16,), (16,), (16, 16)]


def test_fill_refuses_more_rows_than_the_bucket():
    pools = _pools(32, (0, 4), (16, 4, 1), cap=64, n_seqs=4)
    inp = DecodeInputs(DecodeLayout.for_pools(pools, 2, {4: 16}), "cpu")
    with pytest.raises(ValueError):
        inp.fill([_seq(pools, 1) for _ in range(3)], [0, 0, 0])


def test_decoder_key_buckets_pure_decode_steps_only():
    pools = _pools(32, (0, 4, 128), (16, 4, 1), cap=512, n_seqs=8)
    dec = CudaGraphDecoder(None, pools, max_batch=6)
    seqs = [_seq(pools, t) for t in (10, 300, 5)]
    assert dec.key(seqs, [[1]] * 3, [0, 1, 2]) == (4, (4, _width(301 // 4)), (128, 16))
    assert dec.key(seqs, [[1], [1, 2], [1]], [0, 1, 2]) is None  # a verification step
    assert dec.key(seqs, [[1]] * 3, [2]) is None  # not every row's logits
    assert dec.key([], [], []) is None
    many = [_seq(pools, 1) for _ in range(7)]
    assert dec.key(many, [[1]] * 7, list(range(7))) is None  # above the largest bucket (6)


@pytest.mark.parametrize("ratios", [(0, 4, 128), (0, 4), (0, 128), (0, 0)])
def test_ensure_allocates_exactly_the_pages_needed(ratios):
    # ensure's inline "nothing to allocate" test (the decode step's host path) agrees with pages_needed at every
    # length across page boundaries, with and without compressed layers, from tables of every length
    pools = _pools(128, ratios, (8, 2, 1), cap=2048, n_seqs=4)
    rng = random.Random(7)
    for _ in range(300):
        s = SeqBlocks()
        pools.ensure(s, rng.randint(0, 1500))
        new_len = len(s.token) * 8 + rng.randint(-20, 20)
        need = pools.pages_needed(s, max(new_len, 0))
        before = (len(s.token), len(s.c4), len(s.c128))
        pools.ensure(s, max(new_len, 0))
        assert (len(s.token) - before[0], len(s.c4) - before[1], len(s.c128) - before[2]) == need
        assert pools.pages_needed(s, max(new_len, 0)) == (0, 0, 0)
        for table, alloc in ((s.token, pools.token_alloc), (s.c4, pools.c4_alloc), (s.c128, pools.c128_alloc)):
            alloc.free([p for p in table if p >= 0])
