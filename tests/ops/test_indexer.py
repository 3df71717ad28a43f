"""indexer_topk against a naive score loop (ascend_dsv4/models/deepseek_v4/README.md §2.3 "CSA Indexer"); rows are
compared as sets."""

from __future__ import annotations

import pytest
import torch

import atb_ops


def oracle_scores(q, weights, k_cache, cand):
    """{row: score} per token with score = sum_h w_h * relu(q_h . k_row), float64, valid candidates only."""
    out = []
    for t in range(cand.shape[0]):
        row_scores = {}
        for n in range(cand.shape[1]):
            row = int(cand[t, n])
            if row < 0:
                continue
            s = 0.0
            for h in range(q.shape[1]):
                dot = sum(float(a) * float(b) for a, b in zip(q[t, h].double(), k_cache[row].double()))
                s += float(weights[t, h]) * max(dot, 0.0)
            row_scores[row] = s
        out.append(row_scores)
    return out


def check_topk(result, scores, topk, n_cand):
    """Exact set comparison unless the oracle has a tie at the selection boundary (then compare scores)."""
    width = min(topk, n_cand)
    assert result.dtype == torch.int64
    assert result.shape == (len(scores), width)
    for t, row_scores in enumerate(scores):
        got = [int(v) for v in result[t]]
        valid = [v for v in got if v >= 0]
        n_valid = min(width, len(row_scores))
        assert len(valid) == n_valid, (t, got)
        assert got.count(-1) == width - n_valid
        assert len(set(valid)) == len(valid)  # no duplicates
        assert set(valid) <= set(row_scores)  # only this token's candidates
        ranked = sorted(row_scores.values(), reverse=True)
        boundary_tie = n_valid < len(ranked) and abs(ranked[n_valid - 1] - ranked[n_valid]) < 1e-5
        if boundary_tie:
            got_scores = sorted((row_scores[v] for v in valid), reverse=True)
            assert got_scores == pytest.approx(ranked[:n_valid], abs=1e-5)
        else:
            expected = set(sorted(row_scores, key=row_scores.get, reverse=True)[:n_valid])
            assert set(valid) == expected, (t, valid, expected)


def _inputs(seed, t=6, hi=3, di=8, p=24, n=10, positive_weights=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hi, di, generator=g)
    w = torch.rand(t, hi, generator=g) if positive_weights else torch.randn(t, hi, generator=g)
    k = torch.randn(p, di, generator=g)
    # causal-looking ragged candidates: token t sees 3 + t distinct rows, rest padded with -1
    cand = torch.full((t, n), -1, dtype=torch.int64)
    for i in range(t):
        cnt = min(n, 3 + i)
        cand[i, :cnt] = torch.randperm(p, generator=g)[:cnt]
    return q, w, k, cand


@pytest.mark.parametrize("topk", [1, 4, 7])
def test_indexer_topk_matches_oracle(topk):
    q, w, k, cand = _inputs(topk)
    res = atb_ops.indexer_topk(q, w, k, cand, topk)
    check_topk(res, oracle_scores(q, w, k, cand), topk, cand.shape[1])


def test_indexer_topk_many_tokens_positive_weights():
    q, w, k, cand = _inputs(11, t=8, hi=4, di=16, p=40, n=20, positive_weights=True)
    res = atb_ops.indexer_topk(q, w, k, cand, 5)
    check_topk(res, oracle_scores(q, w, k, cand), 5, 20)


def test_indexer_relu_is_per_head_and_weights_can_be_negative():
    # candidate 0: head dots (5, -10); candidate 1: (2, 2).
    # with the per-head ReLU and weights (1, 1): scores 5 vs 4 -> candidate 0 (without ReLU it would be 1).
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    k = torch.tensor([[5.0, -10.0], [2.0, 2.0]])
    cand = torch.tensor([[0, 1]])
    assert atb_ops.indexer_topk(q, torch.tensor([[1.0, 1.0]]), k, cand, 1).tolist() == [[0]]
    # a negative weight on head 1 penalises candidate 1 (score 2 - 2*0.9) and leaves 0 at 5
    assert atb_ops.indexer_topk(q, torch.tensor([[0.1, -0.9]]), k, cand, 1).tolist() == [[0]]
    # weights (0.1, 1): scores 0.5 vs 2.2 -> candidate 1
    assert atb_ops.indexer_topk(q, torch.tensor([[0.1, 1.0]]), k, cand, 1).tolist() == [[1]]


def test_indexer_returns_k_cache_rows_not_candidate_positions():
    q = torch.ones(1, 1, 2)
    k = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0], [3.0, 3.0]])
    cand = torch.tensor([[3, 2, -1, 1]])
    res = atb_ops.indexer_topk(q, torch.ones(1, 1), k, cand, 2)
    assert set(res[0].tolist()) == {2, 3}


def test_topk_larger_than_valid_candidates_pads_with_minus_one():
    q, w, k, cand = _inputs(21, t=3, n=6)
    cand[0] = torch.tensor([4, -1, 9, -1, -1, -1])  # 2 valid
    cand[1] = torch.tensor([-1, -1, -1, -1, -1, 13])  # 1 valid, at the end
    res = atb_ops.indexer_topk(q, w, k, cand, 5)
    assert res.shape == (3, 5)
    assert sorted(res[0].tolist()) == [-1, -1, -1, 4, 9]
    assert sorted(res[1].tolist()) == [-1, -1, -1, -1, 13]
    check_topk(res, oracle_scores(q, w, k, cand), 5, 6)
    # topk larger than N: width N
    res = atb_ops.indexer_topk(q, w, k, cand, 100)
    assert res.shape == (3, 6)
    check_topk(res, oracle_scores(q, w, k, cand), 100, 6)


def test_row_with_no_valid_candidate_returns_all_minus_one():
    q, w, k, cand = _inputs(22, t=3, n=5)
    cand[1] = -1
    res = atb_ops.indexer_topk(q, w, k, cand, 3)
    assert res[1].tolist() == [-1, -1, -1]
    check_topk(res, oracle_scores(q, w, k, cand), 3, 5)


def test_minus_one_ignores_nan_garbage_in_unreferenced_rows():
    q, w, k, cand = _inputs(25, t=4, p=12, n=6)
    g = torch.Generator().manual_seed(26)
    for t in range(4):  # valid rows 1..10 only, distinct per token
        cnt = int((cand[t] >= 0).sum())
        cand[t, :cnt] = torch.randperm(10, generator=g)[:cnt] + 1
    expected = atb_ops.indexer_topk(q, w, k, cand, 4)
    k_dirty = k.clone()
    k_dirty[0] = float("nan")
    k_dirty[-1] = float("nan")
    got = atb_ops.indexer_topk(q, w, k_dirty, cand, 4)
    for t in range(4):
        assert sorted(got[t].tolist()) == sorted(expected[t].tolist())
    check_topk(got, oracle_scores(q, w, k, cand), 4, 6)


def test_empty_token_batch_and_no_candidates():
    q, w, k, cand = _inputs(23)
    res = atb_ops.indexer_topk(q[:0], w[:0], k, cand[:0], 4)
    assert res.shape == (0, 4) and res.dtype == torch.int64
    res = atb_ops.indexer_topk(q, w, k, cand[:, :0], 4)
    assert res.shape == (q.shape[0], 0) and res.dtype == torch.int64


def test_bf16_inputs():
    q, w, k, cand = _inputs(24, positive_weights=True)
    qb, wb, kb = q.to(torch.bfloat16), w.to(torch.bfloat16), k.to(torch.bfloat16)
    res = atb_ops.indexer_topk(qb, wb, kb, cand, 4)
    check_topk(res, oracle_scores(qb, wb, kb, cand), 4, cand.shape[1])
