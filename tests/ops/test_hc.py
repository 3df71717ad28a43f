"""hc_pre (with Sinkhorn), hc_post and hc_head against loop transcriptions of
ascend_dsv4/models/deepseek_v4/README.md §2.2 and §2.5."""

from __future__ import annotations

import math

import pytest
import torch

import atb_ops


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _mix(x_t: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> list[float]:
    """m = (flat(x) . fn_i) * rsqrt(mean(flat(x)^2) + eps) for one token, float64."""
    flat = [float(v) for v in x_t.double().reshape(-1)]
    r = 1.0 / math.sqrt(sum(v * v for v in flat) / len(flat) + norm_eps)
    return [sum(a * float(b) for a, b in zip(flat, fn[i].double())) * r for i in range(fn.shape[0])]


def oracle_hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps):
    t_count, n, d = x.shape
    us, posts, combs = [], [], []
    for t in range(t_count):
        m = _mix(x[t], fn, norm_eps)
        s0, s1, s2 = (float(v) for v in scale)
        b = [float(v) for v in base]
        pre = [_sigmoid(s0 * m[j] + b[j]) + hc_eps for j in range(n)]
        post = [2 * _sigmoid(s1 * m[n + j] + b[n + j]) for j in range(n)]
        c = [[s2 * m[2 * n + n * j + k] + b[2 * n + n * j + k] for k in range(n)] for j in range(n)]
        # row softmax + eps
        for j in range(n):
            mx = max(c[j])
            e = [math.exp(v - mx) for v in c[j]]
            tot = sum(e)
            c[j] = [v / tot + hc_eps for v in e]

        def col_norm():
            for k in range(n):
                tot = sum(c[j][k] for j in range(n))
                for j in range(n):
                    c[j][k] = c[j][k] / (tot + hc_eps)

        def row_norm():
            for j in range(n):
                tot = sum(c[j])
                c[j] = [v / (tot + hc_eps) for v in c[j]]

        col_norm()
        for _ in range(iters - 1):
            row_norm()
            col_norm()
        u = [sum(pre[j] * float(x[t, j, ch]) for j in range(n)) for ch in range(d)]
        us.append(u)
        posts.append(post)
        combs.append(c)
    return (
        torch.tensor(us, dtype=torch.float64).reshape(t_count, d),
        torch.tensor(posts, dtype=torch.float64).reshape(t_count, n),
        torch.tensor(combs, dtype=torch.float64).reshape(t_count, n, n),
    )


def oracle_hc_post(y, x, post, comb):
    t_count, n, d = x.shape
    out = torch.zeros(t_count, n, d, dtype=torch.float64)
    for t in range(t_count):
        for k in range(n):
            for ch in range(d):
                acc = float(post[t, k]) * float(y[t, ch])
                for j in range(n):
                    acc += float(comb[t, j, k]) * float(x[t, j, ch])
                out[t, k, ch] = acc
    return out


def oracle_hc_head(x, fn, base, scale, hc_eps, norm_eps):
    t_count, n, d = x.shape
    out = torch.zeros(t_count, d, dtype=torch.float64)
    for t in range(t_count):
        m = _mix(x[t], fn, norm_eps)
        pre = [_sigmoid(m[j] * float(scale[0]) + float(base[j])) + hc_eps for j in range(n)]
        for ch in range(d):
            out[t, ch] = sum(pre[j] * float(x[t, j, ch]) for j in range(n))
    return out


def _hc_inputs(seed, t=3, n=4, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, d, generator=g) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.2
    base = torch.randn((2 + n) * n, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return x, fn, base, scale


# ----------------------------------------------------------------------------------------------- hc_pre
@pytest.mark.parametrize("iters", [20, 1, 3])
def test_hc_pre_matches_loop_oracle(iters):
    x, fn, base, scale = _hc_inputs(10 + iters)
    u, post, comb = atb_ops.hc_pre(x, fn, base, scale, iters, 1e-6, 1e-6)
    eu, epost, ecomb = oracle_hc_pre(x, fn, base, scale, iters, 1e-6, 1e-6)
    assert u.shape == (3, 8) and post.shape == (3, 4) and comb.shape == (3, 4, 4)
    assert u.dtype == x.dtype and post.dtype == torch.float32 and comb.dtype == torch.float32
    torch.testing.assert_close(u.double(), eu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post.double(), epost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), ecomb, rtol=1e-5, atol=1e-6)


def test_hc_pre_large_eps_is_visible():
    # hc_eps enters pre, the softmax and every Sinkhorn denominator; a large value must change the result
    x, fn, base, scale = _hc_inputs(20)
    u, post, comb = atb_ops.hc_pre(x, fn, base, scale, 5, 0.1, 1e-6)
    eu, epost, ecomb = oracle_hc_pre(x, fn, base, scale, 5, 0.1, 1e-6)
    torch.testing.assert_close(u.double(), eu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb.double(), ecomb, rtol=1e-5, atol=1e-6)


def test_hc_pre_sinkhorn_is_nearly_doubly_stochastic():
    x, fn, base, scale = _hc_inputs(30, t=5)
    _, _, comb = atb_ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    assert torch.all(comb > 0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)  # columns
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), atol=1e-3, rtol=0)  # rows
    # with a single iteration only the columns are normalised; rows generally are not
    _, _, comb1 = atb_ops.hc_pre(x, fn, base, scale, 1, 1e-6, 1e-6)
    torch.testing.assert_close(comb1.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)
    assert (comb1.sum(-1) - 1).abs().max() > 1e-2


def test_hc_pre_post_range_and_bf16():
    x, fn, base, scale = _hc_inputs(40, dtype=torch.bfloat16)
    u, post, comb = atb_ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    assert u.dtype == torch.bfloat16 and post.dtype == torch.float32 and comb.dtype == torch.float32
    assert torch.all((post > 0) & (post < 2))
    eu, epost, ecomb = oracle_hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(u.double(), eu, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(post.double(), epost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), ecomb, rtol=1e-5, atol=1e-6)


def test_hc_pre_empty_batch():
    x, fn, base, scale = _hc_inputs(41, t=0)
    u, post, comb = atb_ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    assert u.shape == (0, 8) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


# ----------------------------------------------------------------------------------------------- hc_post
def test_hc_post_matches_oracle_with_nonsymmetric_comb():
    g = torch.Generator().manual_seed(50)
    t, n, d = 3, 4, 6
    y = torch.randn(t, d, generator=g)
    x = torch.randn(t, n, d, generator=g)
    post = torch.rand(t, n, generator=g) * 2
    comb = torch.rand(t, n, n, generator=g)
    assert (comb - comb.transpose(-1, -2)).abs().max() > 0.1
    out = atb_ops.hc_post(y, x, post, comb)
    assert out.shape == (t, n, d) and out.dtype == x.dtype
    expected = oracle_hc_post(y, x, post, comb)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and it is NOT the untransposed application
    wrong = oracle_hc_post(y, x, post, comb.transpose(-1, -2))
    assert (out.double() - wrong).abs().max() > 1e-2


def test_hc_post_permutation_routes_stream_j_to_k():
    # comb[j, k] = 1 iff k == (j + 1) mod N  =>  out_k = x_{k-1} (post = 0)
    t, n, d = 2, 4, 5
    g = torch.Generator().manual_seed(51)
    x = torch.randn(t, n, d, generator=g)
    y = torch.randn(t, d, generator=g)
    comb = torch.zeros(t, n, n)
    for j in range(n):
        comb[:, j, (j + 1) % n] = 1.0
    out = atb_ops.hc_post(y, x, torch.zeros(t, n), comb)
    for k in range(n):
        assert torch.equal(out[:, k], x[:, (k - 1) % n])
    # post only: out_k = post_k * y
    post = torch.tensor([[0.5, 1.0, 1.5, 2.0]] * t)
    out = atb_ops.hc_post(y, x, post, torch.zeros(t, n, n))
    for k in range(n):
        torch.testing.assert_close(out[:, k], post[:, k : k + 1] * y)


def test_hc_post_bf16():
    g = torch.Generator().manual_seed(52)
    t, n, d = 2, 4, 8
    x = torch.randn(t, n, d, generator=g).to(torch.bfloat16)
    y = torch.randn(t, d, generator=g).to(torch.bfloat16)
    post = torch.rand(t, n, generator=g) * 2
    comb = torch.rand(t, n, n, generator=g)
    out = atb_ops.hc_post(y, x, post, comb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle_hc_post(y, x, post, comb), rtol=2**-7, atol=1e-2)


# ----------------------------------------------------------------------------------------------- hc_head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_oracle(dtype):
    g = torch.Generator().manual_seed(60)
    t, n, d = 4, 4, 8
    x = (torch.randn(t, n, d, generator=g) * 3).to(dtype)
    fn = torch.randn(n, n * d, generator=g) * 0.3
    base = torch.randn(n, generator=g)
    scale = torch.tensor([0.7])
    out = atb_ops.hc_head(x, fn, base, scale, 1e-6, 1e-6)
    assert out.shape == (t, d) and out.dtype == dtype
    expected = oracle_hc_head(x, fn, base, scale, 1e-6, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=2e-2)


def test_hc_head_eps_is_added_to_pre():
    # base -> -inf makes sigmoid 0, so pre = hc_eps exactly: out = hc_eps * sum_j x_j
    t, n, d = 2, 4, 3
    x = torch.arange(t * n * d, dtype=torch.float32).reshape(t, n, d) + 1
    fn = torch.zeros(n, n * d)
    base = torch.full((n,), -1e4)
    out = atb_ops.hc_head(x, fn, base, torch.ones(1), 0.25, 1e-6)
    torch.testing.assert_close(out, 0.25 * x.sum(1))
