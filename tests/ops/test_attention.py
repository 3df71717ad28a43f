"""sparse_attention against a naive per-token, per-head softmax with a sink (ascend_dsv4/models/deepseek_v4/README.md
§2.3 "Combined attention")."""

from __future__ import annotations

import math

import torch

import atb_ops


def oracle_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    """o_h = sum_j p_j v_j, p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink_h)), s_j = scale q_h . v_j; -1 skipped."""
    t_count, h_count, d = q.shape
    out = torch.zeros(t_count, h_count, d, dtype=torch.float64)
    for t in range(t_count):
        keys = [kv[int(j)].double() for j in idx[t] if int(j) >= 0]
        if extra_idx is not None:
            keys += [extra_kv[int(j)].double() for j in extra_idx[t] if int(j) >= 0]
        for h in range(h_count):
            qh = q[t, h].double()
            s = [scale * float((qh * v).sum()) for v in keys]
            sk = float(sink[h])
            m = max(s + [sk])
            e = [math.exp(v - m) for v in s]
            denom = sum(e) + math.exp(sk - m)
            acc = torch.zeros(d, dtype=torch.float64)
            for ej, v in zip(e, keys):
                acc += ej / denom * v
            out[t, h] = acc
    return out


def _inputs(seed, t=4, h=3, d=16, p=10, k=5, neg_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(p, d, generator=g)
    idx = torch.randint(0, p, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < neg_frac] = -1
    sink = torch.randn(h, generator=g)
    return q, kv, idx, sink


def test_matches_oracle_with_minus_one_indices():
    q, kv, idx, sink = _inputs(0)
    assert (idx < 0).any() and (idx >= 0).any()
    scale = 16**-0.5
    out = atb_ops.sparse_attention(q, kv, idx, sink, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle_attention(q, kv, idx, sink, scale), rtol=1e-5, atol=1e-6)


def test_minus_one_rows_do_not_leak():
    q, kv, idx, sink = _inputs(1, p=8)
    idx = idx.clamp(min=1, max=6)  # valid indices only use rows 1..6
    idx[:, 1] = -1
    idx[2, :] = torch.tensor([3, -1, -1, 5, -1])
    out = atb_ops.sparse_attention(q, kv, idx, sink, 0.3)
    kv2 = kv.clone()
    kv2[0] = 100.0  # what a clamped -1 would read
    kv2[-1] = -100.0  # what python's -1 would read
    torch.testing.assert_close(atb_ops.sparse_attention(q, kv2, idx, sink, 0.3), out, rtol=0, atol=0)
    # adding extra all -1 columns changes nothing
    idx_pad = torch.cat([idx, torch.full((idx.shape[0], 3), -1)], dim=1)
    torch.testing.assert_close(atb_ops.sparse_attention(q, kv, idx_pad, sink, 0.3), out, rtol=1e-6, atol=1e-7)


def test_minus_one_ignores_nan_garbage_in_unreferenced_rows():
    # a paged pool may hold uninitialised (NaN / inf) rows; -1 slots must not read them in any way
    q, kv, idx, sink = _inputs(11, p=8)
    idx = idx.clamp(min=1, max=6)
    idx[:, 0] = -1
    idx[3] = -1
    clean = atb_ops.sparse_attention(q, kv, idx, sink, 0.3)
    dirty_kv = kv.clone()
    dirty_kv[0] = float("nan")
    dirty_kv[-1] = float("inf")
    extra_kv = torch.full((2, 16), float("nan"))
    out = atb_ops.sparse_attention(q, dirty_kv, idx, sink, 0.3, extra_kv, torch.full((4, 1), -1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, rtol=1e-6, atol=1e-7)
    assert torch.all(out[3] == 0)


def test_sink_only_in_denominator():
    q, kv, idx, sink = _inputs(2, neg_frac=0.0)
    # a very negative sink = plain softmax attention
    out = atb_ops.sparse_attention(q, kv, idx, torch.full_like(sink, -1e4), 0.25)
    for t in range(q.shape[0]):
        v = kv[idx[t]].double()
        for h in range(q.shape[1]):
            p = (0.25 * (v @ q[t, h].double())).softmax(0)
            torch.testing.assert_close(out[t, h].double(), p @ v, rtol=1e-5, atol=1e-6)
    # the sink adds exp(sink) to the denominator: out(sink) = out(-inf) * Z / (Z + exp(sink))
    out_s = atb_ops.sparse_attention(q, kv, idx, sink, 0.25)
    for t in range(q.shape[0]):
        v = kv[idx[t]].double()
        for h in range(q.shape[1]):
            z = torch.exp(0.25 * (v @ q[t, h].double())).sum()
            ratio = z / (z + math.exp(float(sink[h])))
            torch.testing.assert_close(out_s[t, h].double(), out[t, h].double() * ratio, rtol=1e-5, atol=1e-6)
    # a huge sink absorbs everything
    out_big = atb_ops.sparse_attention(q, kv, idx, torch.full_like(sink, 80.0), 0.25)
    assert out_big.abs().max() < 1e-20


def test_extra_kv_joins_the_same_softmax():
    q, kv, idx, sink = _inputs(3, t=5, p=9, k=4)
    g = torch.Generator().manual_seed(33)
    extra_kv = torch.randn(6, 16, generator=g)
    extra_idx = torch.randint(0, 6, (5, 3), generator=g)
    extra_idx[0, 1] = -1
    extra_idx[3] = -1
    scale = 0.2
    out = atb_ops.sparse_attention(q, kv, idx, sink, scale, extra_kv, extra_idx)
    expected = oracle_attention(q, kv, idx, sink, scale, extra_kv, extra_idx)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    # identical to one concatenated key set
    joined = atb_ops.sparse_attention(
        q, torch.cat([kv, extra_kv]), torch.cat([idx, torch.where(extra_idx >= 0, extra_idx + 9, -1)], dim=1), sink, scale
    )
    torch.testing.assert_close(out, joined, rtol=1e-5, atol=1e-6)
    # and different from two separately normalised softmaxes added together
    separate = oracle_attention(q, kv, idx, sink, scale) + oracle_attention(
        q, extra_kv, extra_idx, sink, scale
    )
    assert (out.double() - separate).abs().max() > 1e-2
    # an empty extra set equals no extra set
    none = atb_ops.sparse_attention(q, kv, idx, sink, scale, extra_kv, extra_idx[:, :0])
    torch.testing.assert_close(none, atb_ops.sparse_attention(q, kv, idx, sink, scale))


def test_only_extra_keys_valid():
    q, kv, idx, sink = _inputs(4, t=2)
    idx[:] = -1
    extra_kv = torch.randn(3, 16, generator=torch.Generator().manual_seed(44))
    extra_idx = torch.tensor([[0, 2], [1, -1]])
    out = atb_ops.sparse_attention(q, kv, idx, sink, 0.3, extra_kv, extra_idx)
    torch.testing.assert_close(
        out.double(), oracle_attention(q, kv, idx, sink, 0.3, extra_kv, extra_idx), rtol=1e-5, atol=1e-6
    )


def test_one_token_and_empty_batch():
    q, kv, idx, sink = _inputs(5, t=1, h=2, k=1, neg_frac=0.0)
    out = atb_ops.sparse_attention(q, kv, idx, sink, 0.5)
    # a single key: o = v * exp(s) / (exp(s) + exp(sink))
    v = kv[idx[0, 0]].double()
    for h in range(2):
        s = 0.5 * float(q[0, h].double() @ v)
        p = 1 / (1 + math.exp(float(sink[h]) - s))
        torch.testing.assert_close(out[0, h].double(), p * v, rtol=1e-5, atol=1e-7)
    out = atb_ops.sparse_attention(q[:0], kv, idx[:0], sink, 0.5)
    assert out.shape == (0, 2, 16)


def test_row_without_valid_key_returns_zero():
    q, kv, idx, sink = _inputs(6)
    idx[1] = -1
    out = atb_ops.sparse_attention(q, kv, idx, sink, 0.25)
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0)
    torch.testing.assert_close(out.double(), oracle_attention(q, kv, idx, sink, 0.25), rtol=1e-5, atol=1e-6)
    # same with an (also empty) extra set
    extra_kv = torch.randn(2, 16)
    out = atb_ops.sparse_attention(q, kv, idx, sink, 0.25, extra_kv, torch.full((4, 2), -1))
    assert torch.isfinite(out).all() and torch.all(out[1] == 0)


def test_zero_width_index_returns_zero():
    # K = 0: no row has a valid key -> all zeros (not an error)
    q, kv, idx, sink = _inputs(12)
    out = atb_ops.sparse_attention(q, kv, idx[:, :0], sink, 0.25)
    assert out.shape == q.shape and torch.all(out == 0)
    # K = 0 for the window part but compressed entries present: only those are attended
    extra_idx = torch.tensor([[0], [1], [-1], [2]])
    out = atb_ops.sparse_attention(q, kv, idx[:, :0], sink, 0.25, kv[:3], extra_idx)
    torch.testing.assert_close(
        out.double(), oracle_attention(q, kv, idx[:, :0], sink, 0.25, kv[:3], extra_idx), rtol=1e-5, atol=1e-6
    )


def test_large_scores_are_stable():
    q, kv, idx, sink = _inputs(7)
    q = q * 40
    out = atb_ops.sparse_attention(q, kv, idx, sink, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), oracle_attention(q, kv, idx, sink, 1.0), rtol=1e-4, atol=1e-5)


def test_bf16_in_bf16_out():
    q, kv, idx, sink = _inputs(8)
    qb, kvb = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    out = atb_ops.sparse_attention(qb, kvb, idx, sink, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle_attention(qb, kvb, idx, sink, 0.25), rtol=2**-7, atol=1e-2)
