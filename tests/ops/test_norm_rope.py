"""rms_norm, apply_rope and rope_inv_freq against naive transcriptions of ascend_dsv4/models/deepseek_v4/README.md
§2.0."""

from __future__ import annotations

import math

import pytest
import torch

import atb_ops


# ----------------------------------------------------------------------------------------------- oracles
def oracle_rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """y = w * x * rsqrt(mean(x^2) + eps), row by row in float64."""
    xs = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(xs)
    n = xs.shape[-1]
    for r in range(xs.shape[0]):
        ms = sum(float(v) ** 2 for v in xs[r]) / n
        inv = 1.0 / math.sqrt(ms + eps)
        for c in range(n):
            w = 1.0 if weight is None else float(weight[c])
            out[r, c] = w * float(xs[r, c]) * inv
    return out.reshape(x.shape)


def oracle_rope(x: torch.Tensor, positions, inv_freq, inverse: bool = False) -> torch.Tensor:
    """Interleaved rotation of pairs (x[D-R+2i], x[D-R+2i+1]) by pos*theta_i; other channels untouched."""
    xd = x.double()
    out = xd.clone()
    d = x.shape[-1]
    half = len(inv_freq)
    start = d - 2 * half
    sign = -1.0 if inverse else 1.0
    flat = xd.reshape(x.shape[0], -1, d)  # [T, heads, D]
    oflat = out.reshape(x.shape[0], -1, d)
    for t in range(x.shape[0]):
        pos = float(positions[t])
        for h in range(flat.shape[1]):
            for i in range(half):
                ang = sign * pos * float(inv_freq[i])
                a = float(flat[t, h, start + 2 * i])
                b = float(flat[t, h, start + 2 * i + 1])
                z = complex(a, b) * complex(math.cos(ang), math.sin(ang))
                oflat[t, h, start + 2 * i] = z.real
                oflat[t, h, start + 2 * i + 1] = z.imag
    return out


def oracle_inv_freq(rope_dim, base, factor=1.0, original_seq_len=0, beta_fast=32.0, beta_slow=1.0):
    """Spec §2.0: theta_i = base^(-2i/R); YaRN ramp between low = floor(c(beta_fast)), high = ceil(c(beta_slow))."""
    theta = [base ** (-2.0 * i / rope_dim) for i in range(rope_dim // 2)]
    if original_seq_len <= 0:
        return theta

    def c(n):
        return rope_dim * math.log(original_seq_len / (2 * math.pi * n)) / (2 * math.log(base))

    low = max(0, math.floor(c(beta_fast)))
    high = min(rope_dim - 1, math.ceil(c(beta_slow)))
    if low == high:
        high += 0.001
    out = []
    for i, th in enumerate(theta):
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))
        out.append(th * (1 - ramp) + th / factor * ramp)
    return out


# ----------------------------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 8), (1, 1)])
def test_rms_norm_weight_matches_oracle(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    y = atb_ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), oracle_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_without_weight_and_eps_effect():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=g) * 1e-2
    for eps in (1e-6, 1e-2):
        y = atb_ops.rms_norm(x, None, eps)
        torch.testing.assert_close(y.double(), oracle_rms_norm(x, None, eps), rtol=1e-5, atol=1e-7)
    # a large eps visibly shrinks the output compared with a tiny one
    assert atb_ops.rms_norm(x, None, 1e-2).abs().max() < 0.5 * atb_ops.rms_norm(x, None, 1e-6).abs().max()
    # weightless norm: every row has unit RMS
    y = atb_ops.rms_norm(x * 100, None, 0.0)
    torch.testing.assert_close(y.square().mean(-1), torch.ones(4), rtol=1e-5, atol=1e-6)


def test_rms_norm_zero_row_is_zero():
    x = torch.zeros(2, 8)
    x[1] = torch.arange(8.0)
    y = atb_ops.rms_norm(x, torch.ones(8), 1e-6)
    assert torch.all(y[0] == 0)
    assert torch.isfinite(y).all()


def test_rms_norm_bf16_in_bf16_out():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 64, generator=g) * 5).to(torch.bfloat16)
    w = torch.randn(64, generator=g)  # fp32 weight as in the model
    y = atb_ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = oracle_rms_norm(x.double(), w, 1e-6)  # computed from the exact bf16 input values
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-6)


# ----------------------------------------------------------------------------------------------- apply_rope
@pytest.mark.parametrize("shape", [(4, 3, 20), (5, 12), (3, 2, 2, 8)])
def test_apply_rope_matches_interleaved_oracle(shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g)
    half = 4
    inv_freq = atb_ops.rope_inv_freq(2 * half, 10000.0)
    positions = torch.tensor([0, 1, 7, 1000, 33][: shape[0]], dtype=torch.int64)
    y = atb_ops.apply_rope(x, positions, inv_freq)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), oracle_rope(x, positions, inv_freq), rtol=1e-5, atol=1e-5)
    # channels before the last R pass through bit-exactly
    assert torch.equal(y[..., : shape[-1] - 2 * half], x[..., : shape[-1] - 2 * half])
    # inverse matches the oracle rotated by -pos*theta
    yi = atb_ops.apply_rope(x, positions, inv_freq, inverse=True)
    torch.testing.assert_close(yi.double(), oracle_rope(x, positions, inv_freq, inverse=True), rtol=1e-5, atol=1e-5)


def test_apply_rope_pairs_are_interleaved_not_halves():
    # one pair only in the rope slice: (x[-2], x[-1]) rotated by 90 degrees -> (-b, a)
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0, 5.0]])
    inv_freq = torch.tensor([math.pi / 2, 1e-30], dtype=torch.float32)  # R = 4: pairs (1,2) and (3,4)
    y = atb_ops.apply_rope(x, torch.tensor([1]), inv_freq)
    expected = torch.tensor([[9.0, -2.0, 1.0, 3.0, 5.0]])
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)


def test_apply_rope_inverse_undoes_forward_and_position_zero_is_identity():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 2, 32, generator=g)
    inv_freq = atb_ops.rope_inv_freq(16, 160000.0, 16.0, 65536, 32.0, 1.0)
    pos = torch.tensor([0, 3, 100, 4096, 65535, 12], dtype=torch.int64)
    y = atb_ops.apply_rope(x, pos, inv_freq)
    back = atb_ops.apply_rope(y, pos, inv_freq, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y[1:], x[1:], atol=1e-3)  # it did rotate something
    torch.testing.assert_close(y[0], x[0], rtol=0, atol=0)  # position 0 is the identity
    # rotation preserves the norm of every pair
    pairs_x = x[..., -16:].unflatten(-1, (8, 2)).norm(dim=-1)
    pairs_y = y[..., -16:].unflatten(-1, (8, 2)).norm(dim=-1)
    torch.testing.assert_close(pairs_x, pairs_y, rtol=1e-5, atol=1e-6)


def test_apply_rope_bf16_returns_bf16_and_new_tensor():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    inv_freq = atb_ops.rope_inv_freq(8, 10000.0)
    pos = torch.tensor([1, 2, 50])
    x_before = x.clone()
    y = atb_ops.apply_rope(x, pos, inv_freq)
    assert y.dtype == torch.bfloat16
    assert torch.equal(x, x_before)  # input not modified
    torch.testing.assert_close(y.double(), oracle_rope(x, pos, inv_freq), rtol=2**-7, atol=2**-8)


# ----------------------------------------------------------------------------------------------- inv_freq
def test_rope_inv_freq_plain_base_10000():
    f = atb_ops.rope_inv_freq(64, 10000.0)
    assert f.dtype == torch.float32 and f.shape == (32,)
    expected = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(f.double(), expected, rtol=1e-6, atol=0)


def test_rope_inv_freq_yarn_spec_numbers():
    R, base, factor, L = 64, 160000.0, 16.0, 65536
    # the spec's worked numbers: c(32) = 15.45, c(1) = 24.71 -> low = 15, high = 25
    c = lambda n: R * math.log(L / (2 * math.pi * n)) / (2 * math.log(base))  # noqa: E731
    assert abs(c(32) - 15.45) < 0.01 and abs(c(1) - 24.71) < 0.01
    low, high = max(0, math.floor(c(32))), min(R - 1, math.ceil(c(1)))
    assert (low, high) == (15, 25)

    f = atb_ops.rope_inv_freq(R, base, factor, L, 32.0, 1.0).double()
    theta = [base ** (-2 * i / R) for i in range(R // 2)]
    for i in range(R // 2):
        if i <= 15:
            expected = theta[i]  # high-frequency pairs unchanged
        elif i >= 25:
            expected = theta[i] / 16  # low-frequency pairs divided by the factor
        else:
            ramp = (i - 15) / 10
            expected = theta[i] * (1 - ramp) + theta[i] / 16 * ramp
            assert theta[i] / 16 < f[i] < theta[i]
        assert math.isclose(float(f[i]), expected, rel_tol=1e-6), i
    # strictly decreasing frequencies overall
    assert torch.all(f[1:] < f[:-1])


@pytest.mark.parametrize(
    "args",
    [
        (64, 160000.0, 16.0, 65536, 32.0, 1.0),
        (64, 10000.0, 16.0, 65536, 32.0, 1.0),
        (16, 10000.0, 4.0, 4096, 32.0, 1.0),
        (64, 160000.0, 1.0, 65536, 32.0, 1.0),  # YaRN with factor 1 = plain
        (8, 10000.0, 8.0, 10, 32.0, 1.0),  # correction dims clamp to [0, R-1]
    ],
)
def test_rope_inv_freq_matches_oracle(args):
    f = atb_ops.rope_inv_freq(*args)
    torch.testing.assert_close(f.double(), torch.tensor(oracle_inv_freq(*args), dtype=torch.float64), rtol=2e-6, atol=0)


def test_rope_inv_freq_without_yarn_ignores_factor():
    a = atb_ops.rope_inv_freq(64, 10000.0, 16.0, 0)
    b = atb_ops.rope_inv_freq(64, 10000.0)
    assert torch.equal(a, b)
