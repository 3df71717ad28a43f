"""fp8_act_round, fp4_act_round and hadamard against explicit transcriptions of
ascend_dsv4/models/deepseek_v4/README.md §2.0 / §6.2."""

from __future__ import annotations

import bisect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import atb_ops

# ----------------------------------------------------------------------------------------------- grids
# e4m3 (fn): code = e * 8 + m; e = 0 subnormal m/8 * 2^-6; else (1 + m/8) * 2^(e-7); code 127 is NaN.
E4M3 = [(m / 8) * 2.0**-6 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
E4M3 = E4M3[:127]
assert E4M3[-1] == 448.0 and len(E4M3) == 127
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def round_to_grid(v: float, grid: list[float]) -> float:
    """Nearest grid magnitude (grid index = code), ties to the even code; sign kept."""
    a = abs(v)
    assert a <= grid[-1]
    hi = bisect.bisect_left(grid, a)
    if hi < len(grid) and grid[hi] == a:
        mag = grid[hi]
    else:
        lo = hi - 1
        d_lo, d_hi = a - grid[lo], grid[hi] - a
        if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0):
            mag = grid[lo]
        else:
            mag = grid[hi]
    return math.copysign(mag, v) if mag != 0 else 0.0 * (1 if v >= 0 else -1)


def pow2_ceil_exact(a: float, qmax: float) -> float:
    """Exact 2^ceil(log2(a / qmax)): the smallest power of two s with qmax * s >= a (no rounding of a/qmax)."""
    k = math.ceil(math.log2(a / qmax))
    while qmax * 2.0 ** (k - 1) >= a:
        k -= 1
    while qmax * 2.0**k < a:
        k += 1
    return 2.0**k


def oracle_round(x: torch.Tensor, block: int, qmax: float, floor: float, grid: list[float]):
    """Per block: amax = max(|x|, floor); s = pow2ceil(amax / qmax); y = grid_rne(clamp(x / s)) * s (float64)."""
    xs = x.double().reshape(-1, block)
    y = torch.empty_like(xs)
    scales = []
    for b in range(xs.shape[0]):
        vals = [float(v) for v in xs[b]]
        amax = max(max(abs(v) for v in vals), floor)
        s = pow2_ceil_exact(amax, qmax)
        scales.append(s)
        for i, v in enumerate(vals):
            q = min(max(v / s, -qmax), qmax)
            y[b, i] = round_to_grid(q, grid) * s
    return y.reshape(x.shape), scales


def oracle_fp8(x, block):
    return oracle_round(x, block, 448.0, 1e-4, E4M3)


def oracle_fp4(x, block):
    return oracle_round(x, block, 6.0, 6.0 * 2.0**-126, E2M1)


def _varied(seed, rows, cols, block):
    """Random values whose per-block magnitude spans many decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    mag = 10.0 ** (torch.rand(rows, cols // block, 1, generator=g) * 10 - 6)  # 1e-6 .. 1e4
    return (x.view(rows, cols // block, block) * mag).view(rows, cols)


# ----------------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("block", [16, 128])
def test_fp8_matches_oracle_exactly(block):
    x = _varied(0, 3, 2 * block, block)
    y = atb_ops.fp8_act_round(x, block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    expected, scales = oracle_fp8(x, block)
    assert torch.equal(y.double(), expected)
    # every block: y / s is a representable e4m3 value
    grid = set(E4M3) | {-v for v in E4M3}
    for b, s in enumerate(scales):
        blk = y.double().reshape(-1, block)[b]
        assert all(float(v) / s in grid for v in blk)


def test_fp8_wide_dynamic_range_hits_subnormals():
    # per-element magnitudes over 8 decades: many values land in the e4m3 subnormal range or flush to 0
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 32, generator=g).sign() * 10.0 ** (torch.rand(4, 32, generator=g) * 8 - 6)
    y = atb_ops.fp8_act_round(x, 32)
    expected, scales = oracle_fp8(x, 32)
    assert torch.equal(y.double(), expected)
    q = (y.double().reshape(4, 32) / torch.tensor(scales, dtype=torch.float64).view(4, 1)).abs()
    assert ((q > 0) & (q < 2.0**-6)).any() and (q == 0).any()


def test_fp8_default_block_is_128():
    x = _varied(1, 2, 256, 128)
    assert torch.equal(atb_ops.fp8_act_round(x), atb_ops.fp8_act_round(x, 128))
    assert torch.equal(atb_ops.fp8_act_round(x).double(), oracle_fp8(x, 128)[0])


def test_fp8_zero_block_stays_zero_and_amax_floor():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-5e-5, 5e-5, 16)  # amax < 1e-4: the floor sets the scale
    y = atb_ops.fp8_act_round(x, 16)
    assert torch.all(y[0] == 0) and torch.all(y[1, :16] == 0)
    assert torch.isfinite(y).all()
    expected, scales = oracle_fp8(x, 16)
    assert scales[3] == 2.0 ** math.ceil(math.log2(1e-4 / 448))
    assert torch.equal(y.double(), expected)


@pytest.mark.parametrize("k", [-12, -3, 0, 1, 5])
def test_fp8_exact_power_of_two_scale_is_not_bumped(k):
    s = 2.0**k
    # amax / 448 == 2^k exactly -> scale 2^k; the smallest subnormal at that scale survives
    x = torch.zeros(1, 16)
    x[0, 0] = 448.0 * s
    x[0, 1] = 2.0**-9 * s
    x[0, 2] = -3 * 2.0**-9 * s
    y = atb_ops.fp8_act_round(x, 16)
    assert torch.equal(y, x), "exponent bumped although amax/448 is a power of two"
    # one ulp more -> the scale doubles and the tiny values round (ties to even) at the coarser scale
    x2 = x.clone()
    x2[0, 0] = torch.nextafter(x[0, 0], torch.tensor(math.inf))
    y2 = atb_ops.fp8_act_round(x2, 16)
    assert y2[0, 0].item() == 448.0 * s
    assert y2[0, 1].item() == 0.0  # 0.5 * 2^-9 at scale 2s: tie between codes 0 and 1 -> 0
    assert y2[0, 2].item() == -4 * 2.0**-9 * s  # 1.5 * 2^-9 at scale 2s: tie between codes 1 and 2 -> 2
    assert torch.equal(y2.double(), oracle_fp8(x2, 16)[0])


def test_fp8_bf16_in_bf16_out():
    x = _varied(2, 2, 64, 32).to(torch.bfloat16)
    y = atb_ops.fp8_act_round(x, 32)
    assert y.dtype == torch.bfloat16
    # e4m3 values (4 significant bits) times a power of two are exact in bf16
    assert torch.equal(y.double(), oracle_fp8(x, 32)[0])


_fp8_vals = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(_fp8_vals, min_size=16, max_size=16), st.floats(min_value=1e-6, max_value=1e3))
def test_fp8_properties(vals, mult):
    x = torch.tensor(vals, dtype=torch.float32).view(1, 16) * mult
    y = atb_ops.fp8_act_round(x, 16)
    assert torch.equal(y.double(), oracle_fp8(x, 16)[0])
    assert torch.equal(atb_ops.fp8_act_round(y, 16), y)  # idempotent
    assert torch.equal(atb_ops.fp8_act_round(-x, 16), -y)  # sign symmetric
    # relative error of the largest element is within half an e4m3 ulp (2^-4), unless the block is below
    # the 1e-4 amax floor (then the scale is set by the floor and tiny values may round to 0)
    i = x.abs().argmax()
    if abs(float(x.view(-1)[i])) >= 1e-4:
        assert abs(float(y.view(-1)[i]) - float(x.view(-1)[i])) <= 2.0**-4 * abs(float(x.view(-1)[i]))


# ----------------------------------------------------------------------------------------------- fp4
@pytest.mark.parametrize("block", [8, 32])
def test_fp4_matches_oracle_exactly(block):
    x = _varied(3, 4, 2 * block, block)
    y = atb_ops.fp4_act_round(x, block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    expected, scales = oracle_fp4(x, block)
    assert torch.equal(y.double(), expected)
    grid = set(E2M1) | {-v for v in E2M1}
    for b, s in enumerate(scales):
        assert all(float(v) / s in grid for v in y.double().reshape(-1, block)[b])


def test_fp4_ties_to_even_code():
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor(vals)
    x[0, 8:16] = -torch.tensor(vals)
    y = atb_ops.fp4_act_round(x, 32)  # amax 6 -> scale exactly 1
    assert y[0, :8].tolist() == expected
    assert y[0, 8:16].tolist() == [-v for v in expected]
    assert torch.all(y[0, 16:] == 0)
    # same pattern at scale 4 (amax 24): the grid scales with it
    y4 = atb_ops.fp4_act_round(x * 4, 32)
    assert y4[0, :8].tolist() == [4 * v for v in expected]


def test_fp4_default_block_is_32():
    x = _varied(4, 2, 64, 32)
    assert torch.equal(atb_ops.fp4_act_round(x), atb_ops.fp4_act_round(x, 32))


def test_fp4_amax_floor_and_zero_block():
    x = torch.zeros(3, 8)
    x[1, 0] = 2.0**-127  # amax below the floor 6 * 2^-126 -> scale 2^-126
    x[1, 1] = 2.0**-128
    x[1, 2] = -(2.0**-127)
    x[2, :] = torch.tensor([1e-39, -1e-39, 3e-39, 0, 0, 0, 0, 0])
    y = atb_ops.fp4_act_round(x, 8)
    assert torch.isfinite(y).all()
    assert torch.all(y[0] == 0)
    assert y[1, 0].item() == 2.0**-127  # 0.5 at scale 2^-126
    assert y[1, 1].item() == 0.0  # 0.25 -> tie -> 0
    assert y[1, 2].item() == -(2.0**-127)
    assert torch.equal(y.double(), oracle_fp4(x, 8)[0])


def test_fp4_exact_power_of_two_scale():
    # amax / 6 == 2^-2 exactly -> scale 2^-2 (not 2^-1): 0.5 * scale survives
    x = torch.zeros(1, 8)
    x[0, 0] = 6 * 0.25
    x[0, 1] = 0.5 * 0.25
    y = atb_ops.fp4_act_round(x, 8)
    assert torch.equal(y, x)
    assert torch.equal(y.double(), oracle_fp4(x, 8)[0])


def test_fp4_bf16_in_bf16_out():
    x = _varied(5, 2, 64, 32).to(torch.bfloat16)
    y = atb_ops.fp4_act_round(x, 32)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.double(), oracle_fp4(x, 32)[0])


_fp4_vals = st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(_fp4_vals, min_size=8, max_size=8), st.floats(min_value=1e-8, max_value=1e4))
def test_fp4_properties(vals, mult):
    x = torch.tensor(vals, dtype=torch.float32).view(1, 8) * mult
    y = atb_ops.fp4_act_round(x, 8)
    assert torch.equal(y.double(), oracle_fp4(x, 8)[0])
    assert torch.equal(atb_ops.fp4_act_round(y, 8), y)  # idempotent
    assert torch.equal(atb_ops.fp4_act_round(-x, 8), -y)  # sign symmetric
    assert y.abs().max() <= x.abs().max() * 2  # 6 * s < 2 * 6 * amax / 6


# ----------------------------------------------------------------------------------------------- hadamard
def sylvester(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) (the Sylvester / Walsh-Hadamard matrix in natural order)."""
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64)


def test_hadamard_n4_explicit():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 0.0]])
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64)
    assert torch.equal(sylvester(4), h4)
    y = atb_ops.hadamard(x)
    torch.testing.assert_close(y.double(), x.double() @ h4 / 2, rtol=0, atol=1e-6)
    assert y[0].tolist() == [5.0, -1.0, -2.0, 0.0]


@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_hadamard_matches_sylvester_and_is_orthonormal(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2, n, generator=g)
    y = atb_ops.hadamard(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    h = sylvester(n) / math.sqrt(n)
    torch.testing.assert_close(y.double(), x.double() @ h, rtol=1e-5, atol=1e-5)
    # H H^T = I: the transform of the identity is H / sqrt(n)
    m = atb_ops.hadamard(torch.eye(n)).double()
    torch.testing.assert_close(m @ m.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-5)
    # norm preserved, and applying it twice is the identity (H symmetric)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(atb_ops.hadamard(y), x, rtol=1e-5, atol=1e-5)


def test_hadamard_bf16():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    y = atb_ops.hadamard(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ (sylvester(128) / math.sqrt(128)), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("n", [3, 6, 96, 130])
def test_hadamard_rejects_non_power_of_two(n):
    with pytest.raises(ValueError):
        atb_ops.hadamard(torch.randn(2, n))
