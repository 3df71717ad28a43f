"""Lossless FP4 -> FP8 block conversion (ascend_dsv4/models/deepseek_v4/README.md §3.2): exactness, block scale rule,
large-spread edge cases."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant import QuantFormatError, dequant_fp4, dequant_fp8_block, fp4_to_fp8, pack_fp4


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These tensors are small: one intra-op thread avoids OpenMP oversubscription slowdowns on busy CPUs."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _codes(shape, gen):
    return torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)


def _check_exact(packed, sb, **kw):
    q, blk = fp4_to_fp8(packed, sb, **kw)
    ref = dequant_fp4(packed, sb, dtype=torch.float32)
    got = dequant_fp8_block(q, blk, dtype=torch.float32)
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # even -0.0 survives
    return q, blk


@settings(max_examples=20, deadline=None)
@given(
    lead=st.sampled_from([(), (2,)]),
    ob=st.integers(1, 2),
    ib=st.integers(1, 2),
    spread=st.integers(0, 14),
    base=st.integers(0, 240),
    seed=st.integers(0, 2**31 - 1),
    as_e8m0=st.booleans(),
)
def test_conversion_is_exact(lead, ob, ib, spread, base, seed, as_e8m0):
    """Spread up to 2^14 between the per-32 scales of one 128x128 block is always exact (covers the 2^6 case)."""
    gen = torch.Generator().manual_seed(seed)
    out, in_ = 128 * ob, 128 * ib
    codes = _codes((*lead, out, in_), gen)
    sb = (base + torch.randint(0, spread + 1, (*lead, out, in_ // 32), generator=gen)).clamp(max=254)
    sb = sb.to(torch.uint8)
    packed = pack_fp4(codes)
    q, blk = _check_exact(packed, sb.view(torch.float8_e8m0fnu) if as_e8m0 else sb)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (*lead, out, in_)
    assert blk.dtype == torch.uint8 and blk.shape == (*lead, ob, ib)
    smax = sb.to(torch.int32).reshape(*lead, ob, 128, ib, 4).amax(dim=(-3, -1))
    assert torch.equal(blk.to(torch.int32), (smax - 6).clamp(min=0))
    assert q.float().abs().max().item() <= 384


def test_block_scale_is_max_over_2_pow_6():
    sb = torch.full((256, 8), 120, dtype=torch.uint8)
    sb[5, 2] = 130   # block (0, 0)
    sb[200, 7] = 110  # block (1, 1): max stays 120 (spread 2^10, still exact)
    codes = torch.full((256, 256), 7, dtype=torch.uint8)  # all 6.0
    q, blk = _check_exact(pack_fp4(codes), sb)
    assert blk.tolist() == [[124, 114], [114, 114]]
    assert q[5, 64].float().item() == 384.0 and q[0, 0].float().item() == 6.0 * 2.0**-4


def test_tiny_scales_clamp_block_byte_to_zero():
    gen = torch.Generator().manual_seed(5)
    sb = torch.randint(0, 5, (128, 4), generator=gen, dtype=torch.uint8)  # max < 6
    q, blk = _check_exact(pack_fp4(_codes((128, 128), gen)), sb)
    assert blk.tolist() == [[0]]


@pytest.mark.parametrize("spread", [15, 16, 17, 18, 30])
@pytest.mark.parametrize("code", range(16))
def test_large_spread_exact_iff_on_e4m3_grid(spread, code):
    """A per-32 group 2^spread below the block max gives fp4 * 2^(6 - spread): exact iff a multiple of 2^-9."""
    sb = torch.full((128, 4), 140, dtype=torch.uint8)
    sb[0, 0] = 140 - spread
    codes = torch.zeros(128, 128, dtype=torch.uint8)
    codes[0, 3] = code
    packed = pack_fp4(codes)
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][code & 7]
    value = mag * 2.0 ** (6 - spread)
    representable = (value / 2.0**-9) == int(value / 2.0**-9)
    if representable:
        _check_exact(packed, sb)
    else:
        with pytest.raises(QuantFormatError) as ei:
            fp4_to_fp8(packed, sb, name="layers.1.ffn.experts.0.w2.weight")
        msg = str(ei.value)
        assert "layers.1.ffn.experts.0.w2.weight" in msg and f"2^{spread}" in msg and "(0, 0)" in msg
        # strict=False: round-to-nearest-even onto the e4m3 grid (lossy, possibly to zero)
        q, blk = fp4_to_fp8(packed, sb, strict=False)
        got = dequant_fp8_block(q, blk, dtype=torch.float64)[0, 3].item()
        ref = dequant_fp4(packed, sb, dtype=torch.float64)[0, 3].item()
        assert got != ref
        expected = torch.tensor(value, dtype=torch.float64).to(torch.float8_e4m3fn).double().item()
        assert got == (-expected if code & 8 else expected) * 2.0 ** (140 - 6 - 127)


def test_large_spread_with_only_representable_codes_is_accepted():
    sb = torch.full((128, 4), 140, dtype=torch.uint8)
    sb[:, 1] = 140 - 17  # only +-4 and 0 survive 2^-11
    codes = torch.randint(0, 16, (128, 128), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    codes[:, 32:64] = torch.tensor([0, 6, 8, 14], dtype=torch.uint8).repeat(128, 8)
    _check_exact(pack_fp4(codes), sb)
    sb[:, 2] = 0  # spread 140: zero codes only
    codes[:, 64:96] = torch.tensor([0, 8], dtype=torch.uint8).repeat(128, 16)
    _check_exact(pack_fp4(codes), sb)


@pytest.mark.parametrize("shape", [(64, 128), (128, 192), (200, 256)])
def test_dims_must_be_multiples_of_128(shape):
    out, in_ = shape
    packed = torch.zeros(out, in_ // 2, dtype=torch.int8)
    sb = torch.full((out, in_ // 32), 127, dtype=torch.uint8)
    with pytest.raises(QuantFormatError, match="experts.3.w1"):
        fp4_to_fp8(packed, sb, name="experts.3.w1.weight")


def test_bad_scales_rejected():
    packed = torch.zeros(128, 64, dtype=torch.int8)
    sb = torch.full((128, 4), 127, dtype=torch.uint8)
    sb[7, 3] = 255
    with pytest.raises(QuantFormatError, match="w3.scale"):
        fp4_to_fp8(packed, sb, name="w3.scale")
    with pytest.raises(QuantFormatError, match="w3.scale"):
        fp4_to_fp8(packed, torch.full((128, 2), 127, dtype=torch.uint8), name="w3.scale")
