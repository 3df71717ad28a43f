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
@pytest.mark.parametrize("t,k,e", [(1, 6, 64), (32, 6, 64), (5, 2, 3), (0, 6, 8)])
def test_moe_permute_equals_reference(device, t, k, e):
    g = torch.Generator().manual_seed(t + k + e)
    x = torch.randn(t, 16, generator=g).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    ids = ids.to(device)
    for a, b in zip(moe_permute(x, ids, e), ref_permute(x, ids, e)):
        assert torch.equal(a.cpu(), b.cpu())
