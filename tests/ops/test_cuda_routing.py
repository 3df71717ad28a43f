"""The CUDA backend's radix-sort-free grouping of MoE rows (atb_ops/cuda/routing.py) against the stable argsort
and the reference ``moe_permute`` (plain torch ops: runs on CPU tensors; on the GPU too when one is present)."""

from __future__ import annotations

import pytest
import torch

from atb_ops.cuda.routing import SMALL, moe_permute, stable_order
from atb_ops.reference.routing import moe_permute as ref_permute

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n", [(0, 8), (1, 8), (7, 4), (192, 64), (384, 64), (SMALL, 256), (SMALL + 1, 64),
                                 (3000, 16)])
def test_stable_order_is_the_stable_argsort(device, m, n):
    g = torch.Generator().manual_seed(m * 31 + n)
    for ids in (torch.randint(0, n, (m,), generator=g),  # many repeats
                torch.full((m,), n - 1),  # one expert takes every row
                torch.arange(m) % n):  # already grouped cyclically
        ids = ids.to(device)
        got = stable_order(ids, n)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), torch.argsort(ids.cpu(), stable=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,k,e,d", [(1, 6, 64, 16), (32, 6, 64, 16), (5, 2, 3, 16), (0, 6, 8, 16), (3, 1, 4, 1030),
                                     (170, 6, 8, 24), (171, 6, 8, 24)])
def test_moe_permute_equals_reference(device, t, k, e, d):
    """Bitwise the reference: one launch up to SMALL rows (rows over several blocks, hot experts, d over column
    blocks; 170 x 6 = 1020 rows), the indexing path beyond (171 x 6 > SMALL)."""
    g = torch.Generator().manual_seed(t + k + e)
    x = torch.randn(t, d, generator=g).to(device, torch.bfloat16 if d > 1000 else torch.float32)
    if t and e < 10:  # few experts: many rows each, ties broken by row order
        ids = torch.randint(0, e, (t, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    ids = ids.to(device)
    got, want = moe_permute(x, ids, e), ref_permute(x, ids, e)
    assert [a.dtype for a in got] == [b.dtype for b in want]
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_stable_order_both_paths(monkeypatch, path):
    """The one-launch kernel (group_rows.stable_positions; Triton's interpreter off the GPU) and the torch counting
    sort (CPU tensors outside the interpreter) give the stable argsort."""
    import atb_ops.cuda.routing as routing

    if path == "torch":
        monkeypatch.setattr(routing, "INTERPRET", False)
    g = torch.Generator().manual_seed(5)
    for m, n in [(1, 1), (63, 3), (65, 64), (300, 256), (SMALL, 384)]:
        ids = torch.randint(0, n, (m,), generator=g)
        dev = "cuda" if path == "kernel" and torch.cuda.is_available() else "cpu"
        got = routing.stable_order(ids.to(dev), n)
        assert torch.equal(got.cpu(), torch.argsort(ids, stable=True)), (m, n)


def _tiles_oracle(ids, n_experts, bm, n_tiles):
    counts = torch.bincount(ids, minlength=n_experts)
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    row_start = torch.cumsum(counts, 0) - counts
    out = []
    for t in range(n_tiles):
        e = int((tile_end <= t).sum())
        valid = e < n_experts
        e = min(e, n_experts - 1)
        r0 = int(row_start[e] + (t - (tile_end[e] - tiles[e])) * bm)
        r1 = min(int(row_start[e] + counts[e]), r0 + bm) if valid else r0
        out.append((e, r0, r1))
    return torch.tensor(out, dtype=torch.long).reshape(-1, 3).t()


@pytest.mark.parametrize("m,e,bm", [(0, 8, 16), (1, 8, 16), (37, 6, 16), (192, 64, 16), (200, 4, 64),
                                    (384, 256, 16), (1024, 384, 32), (50, 1, 16)])
def test_tile_table_equals_its_formula(monkeypatch, m, e, bm):
    """group_rows.tile_table (one program; interpreter off the GPU) against the formula written out per tile, for
    skewed and uniform routings, and gemm.expert_tiles' torch path against the same."""
    import triton

    import atb_ops.cuda.gemm as gemm
    from atb_ops.cuda.group_rows import tile_table

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + e + bm)
    n_tiles = triton.cdiv(m, bm) + min(e, m)
    for ids in (torch.randint(0, e, (m,), generator=g), torch.full((m,), e - 1), torch.arange(m) % e):
        want = _tiles_oracle(ids, e, bm, n_tiles)
        got = torch.stack(tile_table(ids.to(dev), e, bm, n_tiles)).cpu()
        assert torch.equal(got, want), (m, e, bm)
        # expert_tiles: one more bucket, E (rows of no expert here, grouped_matmul's contract), sorted last
        ids_e = torch.cat([ids, torch.full((m // 3,), e)])[torch.randperm(m + m // 3, generator=g)]
        for x in (ids, ids_e):
            n_x = triton.cdiv(x.numel(), bm) + min(e + 1, x.numel())
            want_x = _tiles_oracle(x, e + 1, bm, n_x)
            order, *rest = gemm.expert_tiles(x.to(dev), e, bm)
            assert torch.equal(order.cpu(), torch.argsort(x, stable=True))
            assert torch.equal(torch.stack(rest).cpu(), want_x)
            with monkeypatch.context() as mp:  # the torch formulation (CPU tensors outside the interpreter)
                mp.setattr(gemm, "INTERPRET", False)
                order, *rest = gemm.expert_tiles(x, e, bm)
                assert torch.equal(torch.stack(rest), want_x)


@pytest.mark.parametrize("t,k,d,dtype", [(1, 6, 16, torch.float32), (32, 6, 4096, torch.float32),
                                         (5, 2, 33, torch.bfloat16), (7, 1, 8, torch.float32), (0, 6, 8, torch.float32),
                                         (170, 6, 8, torch.float32), (171, 6, 8, torch.float32)])
def test_moe_unpermute_equals_reference_bitwise(t, k, d, dtype):
    """The cuda moe_unpermute (Triton's interpreter off the GPU) sums each token's rows in the reference's order:
    bitwise its CPU result, through a real permute (ties in expert ids, tokens routed to the same experts); token
    rows found in the order itself up to SMALL rows (170 x 6), through the inverse permutation beyond (171 x 6)."""
    from atb_ops.cuda.routing import moe_unpermute
    from atb_ops.reference.routing import moe_unpermute as ref_unpermute

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(t * 7 + k + d)
    e = 4
    ids = torch.randint(0, e, (t, k), generator=g)
    x = torch.randn(t, d, generator=g)
    _, _, order = ref_permute(x, ids, e)
    y = (torch.randn(t * k, d, generator=g) * torch.logspace(-4, 4, d)).to(dtype)
    got = moe_unpermute(y.to(dev), order.to(dev), t)
    want = ref_unpermute(y, order, t)
    assert got.dtype == torch.float32 and got.shape == (t, d)
    assert torch.equal(got.cpu(), want)
    skip = (torch.randn(t, d, generator=g) * 100).to(torch.bfloat16)  # the shared expert's output: + after the rows
    want = ref_unpermute(y, order, t, skip)
    assert torch.equal(moe_unpermute(y.to(dev), order.to(dev), t, skip.to(dev)).cpu(), want)
    got = moe_unpermute(y.to(dev), order.to(dev), t, skip.to(dev), torch.bfloat16).cpu()
    if dev == "cuda":  # rounded to nearest even, as torch's .to(bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref_unpermute(y, order, t, skip, torch.bfloat16))
    else:  # Triton's interpreter rounds float32 -> bfloat16 toward zero (checked: -122.26 -> -122, torch: -122.5)
        assert torch.equal(got, (want.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16))
