"""compressor_pool against a per-entry, per-channel loop transcription of ascend_dsv4/models/deepseek_v4/README.md
§2.3 "Compressor"."""

from __future__ import annotations

import math

import pytest
import torch

import atb_ops


def oracle_pool(kv_state, score_state, cand, overlap):
    """entry[ch] = sum_k softmax_k(z_k[ch]) a_k[ch] over the valid candidates; with overlap candidates
    k < r read channel ch of the A half ([:c]) and k >= r read channel c + ch of the B half."""
    m_count, k_count = cand.shape
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    r = k_count // 2
    out = torch.zeros(m_count, c, dtype=torch.float64)
    for m in range(m_count):
        for ch in range(c):
            terms = []
            for k in range(k_count):
                row = int(cand[m, k])
                if row < 0:
                    continue
                col = ch + (c if overlap and k >= r else 0)
                terms.append((float(score_state[row, col]), float(kv_state[row, col])))
            mx = max(z for z, _ in terms)
            e = [math.exp(z - mx) for z, _ in terms]
            tot = sum(e)
            out[m, ch] = sum(w / tot * a for w, (_, a) in zip(e, terms))
    return out


def _states(seed, s, width, score_mult=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, width, generator=g), torch.randn(s, width, generator=g) * score_mult


def _overlap_cand(seq_lens, r=4):
    """Candidate rows for ragged sequences concatenated in token order (entry i: A of block i-1, B of block i)."""
    rows, start = [], 0
    for n in seq_lens:
        for i in range(n // r):
            prev = [start + r * (i - 1) + j for j in range(r)] if i > 0 else [-1] * r
            cur = [start + r * i + j for j in range(r)]
            rows.append(prev + cur)
        start += n
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2 * r)


def test_ratio128_no_overlap_matches_oracle():
    r, c = 128, 6
    kv, sc = _states(0, 2 * r + 5, c)  # 2 full blocks + a partial one that has no entry yet
    cand = torch.arange(2 * r, dtype=torch.int64).reshape(2, r)
    out = atb_ops.compressor_pool(kv, sc, cand, False)
    assert out.shape == (2, c) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle_pool(kv, sc, cand, False), rtol=1e-5, atol=1e-6)


def test_softmax_is_per_channel_across_tokens():
    # channel 0 favours token 1, channel 1 favours token 0 (per-channel softmax, not one weight per token)
    kv = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    sc = torch.tensor([[0.0, 50.0], [50.0, 0.0]])
    out = atb_ops.compressor_pool(kv, sc, torch.tensor([[0, 1]]), False)
    torch.testing.assert_close(out, torch.tensor([[30.0, 20.0]]))


def test_ratio4_overlap_matches_oracle_ragged():
    r, c = 4, 5
    seq_lens = [10, 9, 4]  # entries: 2 + 2 + 1
    kv, sc = _states(1, sum(seq_lens), 2 * c)
    cand = _overlap_cand(seq_lens, r)
    assert cand.shape == (5, 8)
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    assert out.shape == (5, c) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle_pool(kv, sc, cand, True), rtol=1e-5, atol=1e-6)


def test_ratio4_entry0_has_only_current_block_b_half():
    r, c = 4, 3
    kv, sc = _states(2, 8, 2 * c)
    cand = _overlap_cand([8], r)
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    # entry 0: softmax over the 4 B halves of tokens 0..3 only
    w = sc[0:4, c:].double().softmax(0)
    torch.testing.assert_close(out[0].double(), (w * kv[0:4, c:].double()).sum(0), rtol=1e-6, atol=1e-7)
    # entry 1: one softmax over A halves of tokens 0..3 and B halves of tokens 4..7
    z = torch.cat([sc[0:4, :c], sc[4:8, c:]]).double()
    a = torch.cat([kv[0:4, :c], kv[4:8, c:]]).double()
    torch.testing.assert_close(out[1].double(), (z.softmax(0) * a).sum(0), rtol=1e-6, atol=1e-7)


def test_ratio4_halves_are_read_from_the_right_channels():
    # A halves hold 1.0, B halves hold 2.0 in every token; whichever half dominates the softmax decides the value
    r, c = 4, 2
    kv = torch.cat([torch.full((8, c), 1.0), torch.full((8, c), 2.0)], dim=1)
    sc = torch.zeros(8, 2 * c)
    sc[:, :c] = 60.0  # A halves win
    cand = _overlap_cand([8], r)
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    torch.testing.assert_close(out[1], torch.full((c,), 1.0))  # entry 1 has a previous block -> A values
    torch.testing.assert_close(out[0], torch.full((c,), 2.0))  # entry 0 has none -> B values only
    sc = torch.zeros(8, 2 * c)
    sc[:, c:] = 60.0  # B halves win
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    torch.testing.assert_close(out, torch.full((2, c), 2.0))
    sc = torch.zeros(8, 2 * c)  # equal logits: 4 A + 4 B candidates -> mean 1.5
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    torch.testing.assert_close(out[1], torch.full((c,), 1.5))


@pytest.mark.parametrize("overlap", [False, True])
def test_empty(overlap):
    width = 6
    kv, sc = _states(3, 4, width)
    k = 8 if overlap else 4
    out = atb_ops.compressor_pool(kv, sc, torch.empty(0, k, dtype=torch.int64), overlap)
    assert out.shape == (0, width // 2 if overlap else width) and out.dtype == torch.float32
    # no tokens at all
    out = atb_ops.compressor_pool(torch.empty(0, width), torch.empty(0, width), torch.empty(0, k, dtype=torch.int64), overlap)
    assert out.shape == (0, width // 2 if overlap else width)


def test_all_but_one_candidate_absent():
    c = 4
    kv, sc = _states(4, 12, 2 * c, score_mult=100.0)
    # overlap: only one previous-block candidate (reads the A half), only one current-block candidate (B half)
    cand = torch.full((2, 8), -1, dtype=torch.int64)
    cand[0, 2] = 5
    cand[1, 6] = 9
    out = atb_ops.compressor_pool(kv, sc, cand, True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], kv[5, :c])
    torch.testing.assert_close(out[1], kv[9, c:])
    # no overlap
    kv2, sc2 = _states(5, 12, c, score_mult=100.0)
    cand = torch.full((1, 4), -1, dtype=torch.int64)
    cand[0, 3] = 7
    out = atb_ops.compressor_pool(kv2, sc2, cand, False)
    torch.testing.assert_close(out[0], kv2[7])


def test_absent_candidates_ignore_their_rows_and_large_logits_are_stable():
    c = 3
    kv, sc = _states(6, 10, c)
    cand = torch.tensor([[2, -1, 4, -1], [-1, 5, 6, 7]], dtype=torch.int64)
    out = atb_ops.compressor_pool(kv, sc, cand, False)
    torch.testing.assert_close(out.double(), oracle_pool(kv, sc, cand, False), rtol=1e-5, atol=1e-6)
    # rows no candidate points at (incl. row 0 and the last row, which a naive -1 gather would read) do not matter
    kv_b, sc_b = kv.clone(), sc.clone()
    for row in (0, 1, 3, 8, 9):
        kv_b[row] = 1e6
        sc_b[row] = 1e3
    torch.testing.assert_close(atb_ops.compressor_pool(kv_b, sc_b, cand, False), out)
    kv_b[0], sc_b[0], kv_b[9], sc_b[9] = float("nan"), float("nan"), float("inf"), float("inf")
    torch.testing.assert_close(atb_ops.compressor_pool(kv_b, sc_b, cand, False), out)
    # softmax is shift invariant and must not overflow with large gate logits
    out_big = atb_ops.compressor_pool(kv, sc + 1000.0, cand, False)
    assert torch.isfinite(out_big).all()
    torch.testing.assert_close(out_big, out, rtol=1e-4, atol=1e-5)
