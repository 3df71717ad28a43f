"""MoE token permutation on the NPU backend: the emulated npu_moe_init_routing_v2 / npu_moe_finalize_routing
against a transcription of their documented numpy references, and atb_ops.moe_permute / moe_unpermute on npu
against the reference ops (random, one token, empty batch, experts without tokens, k = 1)."""

import pytest
import torch

import atb_ops
from atb_ops._dispatch import _registry

g = torch.Generator().manual_seed(13)


@pytest.fixture(autouse=True)
def _contracts(checker):
    yield
    assert not checker.violations, checker.violations


def _init_routing_numpy(x, expert_idx, start, end, row_idx_type, count_type):
    """The doc's numpy reference, line by line (drop_pad_mode 0, no quant)."""
    n, k = expert_idx.shape
    e = expert_idx.flatten().long().clone()
    e[(e < start) | (e >= end)] = 2**31 - 1
    order = torch.tensor(sorted(range(n * k), key=lambda i: (int(e[i]), i)))  # stable
    n_valid = int(((expert_idx >= start) & (expert_idx < end)).sum())
    if row_idx_type == 1:
        row_idx = order.clone()
    else:
        row_idx = torch.full((n * k,), -1, dtype=torch.long)
        for dst in range(n_valid):
            row_idx[order[dst]] = dst
    e_sorted = e[order][:n_valid] - start
    counts = torch.bincount(e_sorted, minlength=end - start)
    tokens = counts.cumsum(0) if count_type == 0 else counts
    expanded_x = torch.stack([x[int(order[i]) // k] for i in range(n_valid)]) if n_valid else x[:0]
    return expanded_x, row_idx, tokens, n_valid


@pytest.mark.parametrize("row_idx_type", [0, 1])
@pytest.mark.parametrize("count_type", [0, 1])
@pytest.mark.parametrize("rng", [None, (2, 5)])
def test_init_routing_v2_emulation(emu, row_idx_type, count_type, rng):
    n, k, e = 7, 3, 6
    x = torch.randn(n, 10, generator=g)
    idx = torch.randint(0, e, (n, k), generator=g, dtype=torch.int32)
    start, end = rng or (0, e)
    xs, ri, tok, _ = emu.npu_moe_init_routing_v2(
        x, idx, expert_num=e, expert_tokens_num_type=count_type, expert_tokens_num_flag=True,
        row_idx_type=row_idx_type, active_expert_range=list(rng) if rng else [])
    wx, wri, wtok, nv = _init_routing_numpy(x, idx, start, end, row_idx_type, count_type)
    assert xs.shape == (n * k, 10) and ri.dtype == torch.int32 and tok.dtype == torch.int64
    assert torch.equal(xs[:nv], wx) and torch.equal(ri.long(), wri) and torch.equal(tok, wtok)


@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_emulation(emu, mode):
    n, k, h = 5, 2, 6
    rows = torch.randn(n * k, h, generator=g)
    src2dst = torch.randperm(n * k, generator=g).to(torch.int32)
    src2dst[3] = -1  # contributes 0
    scales = torch.rand(n, k, generator=g)
    skip1, skip2 = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    bias, ex = torch.randn(4, h, generator=g), torch.randint(0, 4, (n * k,), generator=g, dtype=torch.int32)
    out = emu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src2dst, ex, drop_pad_mode=mode)
    want = torch.zeros(n, h)
    for i in range(n):
        want[i] = skip1[i] + skip2[i]
        for j in range(k):
            pos = j * n + i if mode == 0 else i * k + j
            if int(src2dst[pos]) >= 0:
                want[i] += scales[i, j] * (rows[int(src2dst[pos])] + bias[int(ex[pos])])
    assert torch.allclose(out, want, atol=1e-6)


@pytest.mark.parametrize("t,k,e", [(0, 2, 4), (1, 1, 4), (1, 3, 8), (9, 2, 16), (6, 3, 3)])
def test_moe_permute_unpermute_on_npu(emu, checker, t, k, e):
    x = torch.randn(t, 12, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    with atb_ops.use_backend("npu"):
        xs, se, order = atb_ops.moe_permute(x, ids, e)
    wxs, wse, worder = _registry["reference"]["moe_permute"](x, ids, e)
    assert torch.equal(xs, wxs) and torch.equal(se, wse) and torch.equal(order, worder)
    assert se.dtype == order.dtype == torch.int64
    y = torch.randn(t * k, 12, generator=g)
    with atb_ops.use_backend("npu"):
        out = atb_ops.moe_unpermute(y, order, t)
    want = _registry["reference"]["moe_unpermute"](y, worder, t)
    assert out.shape == want.shape == (t, 12) and out.dtype == torch.float32
    assert torch.allclose(out, want, atol=1e-5)
    skip = torch.randn(t, 12, generator=g).bfloat16()  # the shared expert's output as finalize_routing's skip1
    with atb_ops.use_backend("npu"):
        out = atb_ops.moe_unpermute(y, order, t, skip, torch.bfloat16)
    want = _registry["reference"]["moe_unpermute"](y, worder, t, skip, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    if t:
        assert checker.ops["npu_moe_init_routing_v2"].checked and checker.ops["npu_moe_finalize_routing"].checked
