"""moe_gate, swiglu and grouped_matmul against naive transcriptions of ascend_dsv4/models/deepseek_v4/README.md §2.4."""

from __future__ import annotations

import math

import pytest
import torch

import atb_ops


# ----------------------------------------------------------------------------------------------- oracles
def _softplus(v: float) -> float:
    return max(v, 0.0) + math.log1p(math.exp(-abs(v)))


def oracle_sigma(x, weight):
    """sigma[t][e] = sqrt(softplus(x_t . w_e)), float64."""
    return [
        [math.sqrt(_softplus(sum(float(a) * float(b) for a, b in zip(x[t].double(), weight[e].double()))))
         for e in range(weight.shape[0])]
        for t in range(x.shape[0])
    ]


def oracle_gate(x, weight, bias, topk, route_scale, tid2eid=None, token_ids=None):
    """Returns per token a dict {expert: weight}."""
    sigma = oracle_sigma(x, weight)
    out = []
    for t, sig in enumerate(sigma):
        if tid2eid is not None:
            sel = [int(e) for e in tid2eid[int(token_ids[t])]]
        else:
            key = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(sig)]
            sel = sorted(range(len(sig)), key=lambda e: key[e], reverse=True)[:topk]
        tot = sum(sig[e] for e in sel)
        out.append({e: sig[e] / tot * route_scale for e in sel})
    return out


def check_gate(weights, ids, expected, topk):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (len(expected), topk)
    for t, exp in enumerate(expected):
        got = {int(e): float(w) for e, w in zip(ids[t], weights[t])}
        assert set(got) == set(exp), (t, got, exp)
        for e in exp:
            assert got[e] == pytest.approx(exp[e], rel=1e-5, abs=1e-7)


def oracle_swiglu(gate, up, limit):
    g, u = gate.double().reshape(-1), up.double().reshape(-1)
    out = torch.empty_like(g)
    for i in range(g.numel()):
        gv, uv = float(g[i]), float(u[i])
        if limit > 0:
            gv = min(gv, limit)
            uv = min(max(uv, -limit), limit)
        out[i] = gv / (1 + math.exp(-gv)) * uv
    return out.reshape(gate.shape)


def oracle_grouped_matmul(x, w, expert_ids):
    m_count, k_count = x.shape
    n_count = w.shape[1]
    out = torch.zeros(m_count, n_count, dtype=torch.float64)
    for m in range(m_count):
        e = int(expert_ids[m])
        for n in range(n_count):
            out[m, n] = sum(float(x[m, k]) * float(w[e, n, k]) for k in range(k_count))
    return out


# ----------------------------------------------------------------------------------------------- moe_gate
@pytest.mark.parametrize("topk,route_scale", [(2, 1.5), (3, 2.5), (1, 1.0)])
def test_moe_gate_matches_oracle(topk, route_scale):
    g = torch.Generator().manual_seed(topk)
    x = torch.randn(6, 16, generator=g)
    weight = torch.randn(8, 16, generator=g) * 0.5
    bias = torch.randn(8, generator=g) * 0.1
    w, ids = atb_ops.moe_gate(x, weight, bias, topk, route_scale)
    check_gate(w, ids, oracle_gate(x, weight, bias, topk, route_scale), topk)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), route_scale))
    w0, ids0 = atb_ops.moe_gate(x, weight, None, topk, route_scale)
    check_gate(w0, ids0, oracle_gate(x, weight, None, topk, route_scale), topk)


def test_scores_are_sqrt_softplus():
    # one expert pair; topk = 2 -> weights = sigma_e / (sigma_0 + sigma_1)
    x = torch.tensor([[1.0]])
    weight = torch.tensor([[2.0], [-3.0]])
    w, ids = atb_ops.moe_gate(x, weight, None, 2, 1.0)
    s0, s1 = math.sqrt(math.log1p(math.exp(2.0))), math.sqrt(math.log1p(math.exp(-3.0)))
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert got[0] == pytest.approx(s0 / (s0 + s1), rel=1e-6)
    assert got[1] == pytest.approx(s1 / (s0 + s1), rel=1e-6)


def test_bias_affects_selection_only():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, 8, generator=g)
    weight = torch.randn(6, 8, generator=g)
    bias = torch.zeros(6)
    bias[4] = 100.0
    bias[5] = 90.0  # experts 4 and 5 always win the selection...
    w, ids = atb_ops.moe_gate(x, weight, bias, 2, 1.5)
    sigma = oracle_sigma(x, weight)
    for t in range(5):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert set(got) == {4, 5}
        # ...but their weights come from sigma alone, not sigma + bias
        tot = sigma[t][4] + sigma[t][5]
        assert got[4] == pytest.approx(sigma[t][4] / tot * 1.5, rel=1e-5)
        assert got[5] == pytest.approx(sigma[t][5] / tot * 1.5, rel=1e-5)
    check_gate(w, ids, oracle_gate(x, weight, bias, 2, 1.5), 2)


def test_hash_routing_through_tid2eid():
    g = torch.Generator().manual_seed(11)
    vocab, n_exp, k = 20, 8, 3
    x = torch.randn(7, 12, generator=g)
    weight = torch.randn(n_exp, 12, generator=g)
    tid2eid = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(vocab)]).to(torch.int32)
    token_ids = torch.tensor([0, 5, 19, 5, 3, 11, 0])
    w, ids = atb_ops.moe_gate(x, weight, None, k, 2.5, tid2eid, token_ids)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, tid2eid[token_ids].long())  # the table's experts, in the table's order
    check_gate(w, ids, oracle_gate(x, weight, None, k, 2.5, tid2eid, token_ids), k)
    # routing depends on the token id, not on the activations
    w2, ids2 = atb_ops.moe_gate(torch.randn(7, 12, generator=g), weight, None, k, 2.5, tid2eid, token_ids)
    assert torch.equal(ids2, ids)


def test_moe_gate_bf16_input_and_empty_batch():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    weight = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    w, ids = atb_ops.moe_gate(x, weight, None, 2, 1.5)
    check_gate(w, ids, oracle_gate(x, weight, None, 2, 1.5), 2)
    w, ids = atb_ops.moe_gate(x[:0], weight, None, 2, 1.5)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


# ----------------------------------------------------------------------------------------------- swiglu
def test_swiglu_matches_oracle_with_clamp():
    g = torch.Generator().manual_seed(20)
    gate = torch.randn(4, 32, generator=g) * 12
    up = torch.randn(4, 32, generator=g) * 12
    h = atb_ops.swiglu(gate, up, 10.0)
    assert h.dtype == torch.float32 and h.shape == gate.shape
    torch.testing.assert_close(h.double(), oracle_swiglu(gate, up, 10.0), rtol=1e-5, atol=1e-8)


def test_swiglu_clamp_sides():
    gate = torch.tensor([-12.0, 15.0, 1.0, 1.0, 11.0])
    up = torch.tensor([1.0, 1.0, 25.0, -25.0, -3.0])
    h = atb_ops.swiglu(gate, up, 10.0)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    expected = [silu(-12.0) * 1, silu(10.0) * 1, silu(1.0) * 10, silu(1.0) * -10, silu(10.0) * -3]
    for a, b in zip(h.tolist(), expected):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    # gate is not clamped from below: silu(-12) != silu(-10)
    assert h[0].item() == pytest.approx(silu(-12.0), rel=1e-5)
    assert abs(h[0].item() - silu(-10.0)) > 1e-4


@pytest.mark.parametrize("limit", [0.0, -1.0])
def test_swiglu_no_clamp_when_limit_not_positive(limit):
    gate = torch.tensor([20.0, -20.0, 3.0])
    up = torch.tensor([20.0, -30.0, 50.0])
    h = atb_ops.swiglu(gate, up, limit)
    torch.testing.assert_close(h.double(), oracle_swiglu(gate, up, 0.0), rtol=1e-6, atol=1e-9)
    assert h[0].item() == pytest.approx(20.0 / (1 + math.exp(-20.0)) * 20.0, rel=1e-6)


def test_swiglu_bf16_inputs_return_float32():
    g = torch.Generator().manual_seed(21)
    gate = (torch.randn(3, 2, 16, generator=g) * 8).to(torch.bfloat16)
    up = (torch.randn(3, 2, 16, generator=g) * 8).to(torch.bfloat16)
    h = atb_ops.swiglu(gate, up, 10.0)
    assert h.dtype == torch.float32 and h.shape == (3, 2, 16)
    torch.testing.assert_close(h.double(), oracle_swiglu(gate, up, 10.0), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- grouped_matmul
def test_grouped_matmul_matches_loop_with_idle_experts():
    g = torch.Generator().manual_seed(30)
    e_count, n_count, k_count = 5, 6, 8
    x = torch.randn(12, k_count, generator=g)
    w = torch.randn(e_count, n_count, k_count, generator=g)
    expert_ids = torch.tensor([0, 2, 2, 4, 0, 4, 4, 2, 0, 0, 4, 2])  # experts 1 and 3 get no rows
    out = atb_ops.grouped_matmul(x, w, expert_ids)
    assert out.shape == (12, n_count) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle_grouped_matmul(x, w, expert_ids), rtol=1e-5, atol=1e-5)


def test_grouped_matmul_id_e_gives_zero_rows():
    """Id E (one past the last expert: another rank's expert, marked so by the capture-safe expert-parallel
    path) is a zero row; the other rows as if it were absent. Also the int8 dynamic form."""
    g = torch.Generator().manual_seed(33)
    x = torch.randn(9, 8, generator=g)
    w = torch.randn(3, 5, 8, generator=g)
    ids = torch.tensor([3, 0, 2, 3, 3, 1, 0, 3, 2])
    out = atb_ops.grouped_matmul(x, w, ids)
    keep = ids < 3
    assert not out[~keep].any()
    torch.testing.assert_close(out[keep], atb_ops.grouped_matmul(x[keep], w, ids[keep]), rtol=0, atol=0)
    wq = torch.randint(-127, 128, (3, 8, 5), generator=g, dtype=torch.int8)
    sc = torch.rand(3, 5, generator=g) / 100
    q = atb_ops.quant_grouped_matmul(x, wq, ids, sc)
    assert not q[~keep].any()
    torch.testing.assert_close(q[keep], atb_ops.quant_grouped_matmul(x[keep], wq, ids[keep], sc), rtol=0, atol=0)
    with atb_ops.batch_invariant():  # the batch-invariant variants keep the contract
        assert not atb_ops.grouped_matmul(x, w, ids)[~keep].any()
        assert not atb_ops.quant_grouped_matmul(x, wq, ids, sc)[~keep].any()
        torch.testing.assert_close(atb_ops.grouped_matmul(x, w, ids)[keep], out[keep], rtol=1e-5, atol=1e-5)


def test_grouped_matmul_single_expert_and_single_row():
    g = torch.Generator().manual_seed(31)
    x = torch.randn(1, 4, generator=g)
    w = torch.randn(3, 2, 4, generator=g)
    out = atb_ops.grouped_matmul(x, w, torch.tensor([2]))
    torch.testing.assert_close(out.double(), oracle_grouped_matmul(x, w, torch.tensor([2])), rtol=1e-6, atol=1e-6)


def test_grouped_matmul_empty():
    w = torch.randn(3, 5, 4)
    out = atb_ops.grouped_matmul(torch.empty(0, 4), w, torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 5) and out.dtype == torch.float32
    out = atb_ops.grouped_matmul(torch.empty(0, 4, dtype=torch.bfloat16), w.bfloat16(), torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 5) and out.dtype == torch.bfloat16


def test_grouped_matmul_bf16():
    g = torch.Generator().manual_seed(32)
    x = torch.randn(7, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    ids = torch.tensor([1, 0, 1, 1, 0, 2, 1])
    out = atb_ops.grouped_matmul(x, w, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle_grouped_matmul(x, w, ids), rtol=2**-7, atol=2e-2)


# ----------------------------------------------------------------------------------------------- V3 routing
def _oracle_v3_gate(x, w, bias, k, scale, n_groups, topk_groups, normalize):
    """Naive transcription of DeepSeek-V3 group-limited routing, token by token, in float64."""
    out_w, out_i = [], []
    E = w.shape[0]
    per = E // n_groups
    for t in range(x.shape[0]):
        s = [1 / (1 + math.exp(-float(x[t].double() @ w[e].double()))) for e in range(E)]
        b = [s[e] + float(bias[e]) for e in range(E)]
        gs = [sum(sorted(b[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_groups)]
        groups = sorted(range(n_groups), key=lambda g: -gs[g])[:topk_groups]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -b[e])[:k]
        ws = [s[e] for e in chosen]
        tot = sum(ws) if normalize else 1.0
        out_w.append([v / tot * scale for v in ws])
        out_i.append(chosen)
    return torch.tensor(out_w, dtype=torch.float64), torch.tensor(out_i)


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_gate_sigmoid_group_limited(normalize):
    g = torch.Generator().manual_seed(11)
    T, d, E, k = 7, 16, 16, 3
    x, w = torch.randn(T, d, generator=g), torch.randn(E, d, generator=g) * 0.5
    bias = torch.randn(E, generator=g) * 0.3
    wt, ids = atb_ops.moe_gate(x, w, bias, k, 2.5, score_func="sigmoid", n_groups=4, topk_groups=2, normalize=normalize)
    ow, oi = _oracle_v3_gate(x, w, bias, k, 2.5, 4, 2, normalize)
    for t in range(T):
        order, oorder = ids[t].argsort(), oi[t].argsort()
        assert ids[t][order].tolist() == oi[t][oorder].tolist()
        assert torch.allclose(wt[t][order].double(), ow[t][oorder], atol=1e-6)
    # selected experts all lie in at most topk_groups groups
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in ids)


def test_moe_permute_groups_rows_and_unpermute_sums_them():
    g = torch.Generator().manual_seed(4)
    t, k, e = 6, 3, 5
    x = torch.randn(t, 4, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    xs, se, order = atb_ops.moe_permute(x, ids, e)
    assert bool((se[1:] >= se[:-1]).all()) and torch.equal(se, ids.flatten()[order])
    assert torch.equal(xs, x[order // k])
    assert torch.allclose(atb_ops.moe_unpermute(xs, order, t), x * k)  # every token's k copies summed back
    assert atb_ops.moe_unpermute(xs[:0], order[:0], 0).shape == (0, 4)


def test_moe_unpermute_adds_skip_after_the_rows_and_rounds_once():
    """skip (the shared expert's output) joins the float32 sum after the rows, then one rounding to out_dtype:
    bitwise (sum + float(skip)).to(dtype), the two-kernel form it replaces; a token routed nowhere still gets skip."""
    g = torch.Generator().manual_seed(6)
    t, k, e = 5, 2, 4
    x = torch.randn(t, 8, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    _, _, order = atb_ops.moe_permute(x, ids, e)
    y = torch.randn(t * k, 8, generator=g) * 3
    skip = (torch.randn(t, 8, generator=g) * 3).to(torch.bfloat16)
    plain = atb_ops.moe_unpermute(y, order, t)
    got = atb_ops.moe_unpermute(y, order, t, skip, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (plain + skip.float()).to(torch.bfloat16))
    assert torch.equal(atb_ops.moe_unpermute(y, order, t, skip), plain + skip.float())
    assert torch.equal(atb_ops.moe_unpermute(y[:0], order[:0], t, skip, torch.bfloat16), skip)
    with pytest.raises(ValueError, match=r"moe_unpermute: skip \(5, 7\) must be \[num_tokens, d\] = \(5, 8\)"):
        atb_ops.moe_unpermute(y, order, t, skip[:, :7])
