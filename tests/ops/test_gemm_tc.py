"""The swap-AB tensor-core FP4 / FP8-block GEMM of the CUDA backend (atb_ops/cuda/gemm_tc.py).

- Its FP4 word decoder (4 codes per int16) runs here on the CPU through the PTX emulator of test_gemm_decode.py,
  over every 16-bit word, against quant's dequantisation.
- The kernel runs through Triton's interpreter at small shapes (decoders replaced by plain Triton arithmetic) and
  on the GPU at DeepSeek-V4 shapes (``cuda``): every output within one bfloat16 rounding (plus float32 summation
  noise) of the exact float64 product, and within the existing tolerance of the reference op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import gemm_tc as tc  # noqa: E402
from quant.fp4 import dequant_fp4  # noqa: E402

from test_gemm_decode import _bf16_bits_to_f32, _ids, _weights, _weights_on_device, check_close, run_ptx  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("one_mul", [False, True])
@pytest.mark.parametrize("sc", [0, 1, 100, 127, 128, 129, 254])
def test_fp4x4_ptx_decodes_every_word(sc, one_mul):
    """Every int16 word (4 codes) under E8M0 scale byte sc, as quant.fp4 decodes it; output i = code i."""
    if one_mul and sc > 128:
        pytest.skip("one multiply only for scale bytes <= 128")
    words16 = np.arange(65536, dtype=np.uint32)
    regs = words16[0::2] | (words16[1::2] << 16)  # two words per register, word 2j in the low half
    sbits = np.uint32((sc + 126) << 7 if one_mul else (0x40 if sc == 0 else sc << 7))
    s_pair = np.full(regs.shape, sbits | (sbits << 16), dtype=np.uint32)
    outs = run_ptx(tc.FP4X4_PTX_1MUL if one_mul else tc.FP4X4_PTX, [regs, s_pair], 4)
    got = torch.stack([torch.stack([_bf16_bits_to_f32(q & 0xFFFF), _bf16_bits_to_f32(q >> 16)], 1).flatten()
                       for q in outs], 1)  # [65536 words, 4 codes]
    packed = torch.from_numpy(words16.astype(np.int32)).to(torch.int16).view(torch.int8).view(1, -1)
    want = dequant_fp4(packed, torch.full((1, packed.shape[1] // 16), sc, dtype=torch.uint8), dtype=torch.float32)
    assert torch.equal(got.flatten(), want[0])



def test_fp8x2_ptx_decodes_every_word():
    """Every int16 word (2 e4m3 codes) through the fp8 decoder's PTX: output 0 = the even (low) code, output 1 the
    odd one, bit-exact against torch's e4m3 -> bfloat16 for every code but the NaNs (0x7F, 0xFF: +-480)."""
    words16 = np.arange(65536, dtype=np.uint32)
    regs = words16[0::2] | (words16[1::2] << 16)  # two words per register, word 2j in the low half
    outs = run_ptx(tc.FP8X2_PTX, [regs], 2)
    # output $0 = (even code of word 2j, even code of word 2j+1), $1 the odd codes
    even = torch.stack([_bf16_bits_to_f32(outs[0] & 0xFFFF), _bf16_bits_to_f32(outs[0] >> 16)], 1).flatten()
    odd = torch.stack([_bf16_bits_to_f32(outs[1] & 0xFFFF), _bf16_bits_to_f32(outs[1] >> 16)], 1).flatten()
    codes = torch.from_numpy(words16.astype(np.int64))
    lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    lut[0x7F], lut[0xFF] = 480.0, -480.0
    assert torch.equal(even, lut[codes & 0xFF]) and torch.equal(odd, lut[codes >> 8])
    sign = lambda t: torch.signbit(t)
    assert torch.equal(sign(even), sign(lut[codes & 0xFF])) and torch.equal(sign(odd), sign(lut[codes >> 8]))


def test_fp8_pair_ptx_decodes_every_pair():
    """Every 16-bit pair of e4m3 codes through the in-order pair decoder (d8=2): the low code to the low bfloat16,
    bit-exact against torch's conversion for every code but the NaNs (0x7F, 0xFF: +-480), signs of zeros included."""
    pairs = np.arange(65536, dtype=np.uint32)
    (out,) = run_ptx(tc.FP8P_PTX, [pairs | 0xABCD0000], 1)  # upper bits of the input register must not matter
    got = torch.stack([_bf16_bits_to_f32(out & 0xFFFF), _bf16_bits_to_f32(out >> 16)], 1)
    lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    lut[0x7F], lut[0xFF] = 480.0, -480.0
    codes = torch.from_numpy(pairs.astype(np.int64))
    want = torch.stack([lut[codes & 0xFF], lut[codes >> 8]], 1)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("var,bad", [("ATB_CUDA_TC_CFG", "xsplit=3"), ("ATB_CUDA_TC_CFG", "d8=9"),
                                     ("ATB_CUDA_TC_CFG", "scpre=1"), ("ATB_CUDA_TC_CFG", "d8"),
                                     ("ATB_CUDA_TC_CFG", "ctas=two"), ("ATB_CUDA_TCL_CFG", "words=3")])
def test_cfg_override_errors_name_the_variable(monkeypatch, var, bad):
    """A benchmark override that would pick no code path (or a wrong one) is refused before any launch, naming the
    variable, the entry and what the keys take; good entries still apply."""
    from atb_ops.cuda import gemm_tc_large as tcl

    config = tc._config if var == "ATB_CUDA_TC_CFG" else tcl._config
    monkeypatch.setenv(var, "ctas=1")
    assert config("fp8_block", 8, False)["ctas"] == 1
    monkeypatch.setenv(var, f"ctas=1,{bad}")
    with pytest.raises(ValueError, match=rf"{var}: '{bad}' is not one of .*ctas=<int>"):
        config("fp8_block", 8, False)


def test_fp8_linear_split_k_epilogue_by_rows(monkeypatch):
    """fp8 linears of up to 16 rows add their split-K partials in the kernel (fixup=1, measured faster at 8 rows),
    more rows in a second kernel (fixup=0); grouped calls always in the kernel."""
    monkeypatch.delenv("ATB_CUDA_TC_CFG", raising=False)
    assert [tc._config("fp8_block", m, False)["fixup"] for m in (1, 8, 16, 17, 32, 64)] == [1, 1, 1, 0, 0, 0]
    assert tc._config("fp8_block", 32, True)["fixup"] == 1


@pytest.mark.parametrize("cfg", ["", "xsplit=1,regs=168", "xsplit=2"])
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_grouped_matmul_tc(fmt, m, cfg, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_TC_CFG", cfg)
    g = torch.Generator().manual_seed(31)
    e, n, k = 5, 72, 320 if fmt == "fp4" else 384  # N, K not multiples of the tiles; experts without rows
    w, s = _weights(fmt, e, n, k, g)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(m, e, g, hot=3 if m > 20 else None).to(DEV)  # m = 37: 20+ rows on one expert (two passes of 16)
    got = tc.grouped_matmul(x, w, ids, s, fmt)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, fmt, ids)
    ref = atb_ops.implementations("grouped_matmul")["reference"](x, w, ids, s, fmt)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
def test_grouped_matmul_tc_prologue_and_wide_tiles(fmt, monkeypatch):
    """The active-expert prologue kernel (large M * E), 64-row weight tiles and 32 rows per pass."""
    from atb_ops.cuda import gemm_decode as gd

    monkeypatch.setattr(gd, "FUSED_ACTIVE", 0)
    monkeypatch.setenv("ATB_CUDA_TC_CFG", "bw=64,bt=32")
    g = torch.Generator().manual_seed(32)
    e, n, k = 3, 136, 256
    w, s = _weights(fmt, e, n, k, g)
    x = torch.randn(45, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(45, e, g)
    ids[:40] = 1
    ids = ids.to(DEV)
    check_close(tc.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)


@pytest.mark.parametrize("fixup", [1, 0])  # partial sums added by the last program of a tile / by a second kernel
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("float_scale", [False, True])
def test_linear_tc_split_k(fmt, float_scale, fixup, monkeypatch):
    """Split-K partial sums (float32, added in split order); fp8 with float32 and E8M0 block scales; fp4 with
    fixup=0 decoded in order (xsplit=2)."""
    if fmt == "fp4" and float_scale:
        pytest.skip("fp4 scales are E8M0")
    monkeypatch.setenv("ATB_CUDA_TC_CFG", f"fixup={fixup}" + (",xsplit=2" if fmt == "fp4" and not fixup else ""))
    g = torch.Generator().manual_seed(33)
    n, k = 200, 2048
    w, s = _weights(fmt, 1, n, k, g, float_scale=float_scale)
    for m in (1, 3, 40):  # 40 rows: two row tiles of 32
        x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
        for split in (1, 3):
            monkeypatch.setattr(tc, "_splits", lambda *a, _s=split: _s)
            check_close(tc.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)
    assert int(tc._counters(x.device).abs().sum()) == 0  # every launch leaves its arrival counters at zero


def test_grouped_matmul_tc_split_k_passes(monkeypatch):
    """Split-K with several passes of rows per expert (a counter per tile and pass)."""
    monkeypatch.setattr(tc, "_splits", lambda *a: 2)
    g = torch.Generator().manual_seed(38)
    e, n, k = 3, 64, 512
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(40, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(40, e, g)
    ids[:35] = 2  # three passes of 16 on expert 2
    ids = ids.to(DEV)
    check_close(tc.grouped_matmul(x, w, ids, s, "fp4"), x, w, s, "fp4", ids)
    assert int(tc._counters(x.device).abs().sum()) == 0


def test_tc_edge_cases():
    """M = 0, ids outside [0, E) (zeros), int32 ids, scale bytes > 128 (two-multiply decoder)."""
    g = torch.Generator().manual_seed(34)
    e, n, k = 4, 64, 128
    w, s = _weights("fp4", e, n, k, g)
    x0 = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    assert tc.grouped_matmul(x0, w, torch.zeros(0, dtype=torch.long, device=DEV), s, "fp4").shape == (0, n)
    assert tc.linear(x0, w[0], s[0], "fp4").shape == (0, n)
    x = torch.randn(9, k, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([0, -1, 2, 4, 2, 1, 7, 0, 3], dtype=torch.int32).to(DEV)
    s2 = s.clone()
    s2[2, :3] = 140
    got = tc.grouped_matmul(x, w, ids, s2, "fp4")
    bad = (ids < 0) | (ids >= e)
    assert bool((got[bad] == 0).all())
    check_close(got[~bad], x[~bad], w, s2, "fp4", ids[~bad])


def test_dispatch_tc(monkeypatch):
    """ATB_CUDA_GEMM=tc routes eligible calls to this kernel (through the public ops)."""
    from atb_ops.cuda import gemm

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    s = torch.zeros(8, 2, dtype=torch.uint8)
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)  # auto: the measured shape rules
    assert gemm._path(x, "fp4", s, 64, 64, grouped=False) == "tcl"  # fp4 linears: gemm_tc_large since session 4
    assert gemm._path(x, "fp8_block", s, 64, 64, grouped=False) == "tc"
    assert gemm._path(x, "fp8_block", s, 1, 1, grouped=False) == "tc"
    assert gemm._path(x, "fp8_block", s, 65, 65, grouped=False) == "tiled"
    assert gemm._path(x, "fp4", s, 6, 1) == "decode"  # one token x 6 experts
    assert gemm._path(x, "fp4", s, 48, 1) == "tc"  # 8 tokens x 6 experts
    assert gemm._path(x, "fp8_block", s, 384, 6) == "tc"
    assert gemm._path(x, "fp4", s, 768, 12) == "decode"  # outside the measured range: the old rules
    assert gemm._path(x, "fp8_block", s, 100, 50) == "tiled"
    monkeypatch.setenv("ATB_CUDA_GEMM", "tc")
    assert gemm._path(x, "fp4", s, 4, 4) == "tc"
    assert gemm._path(x.float(), "fp4", s, 4, 4) == "tiled"
    g = torch.Generator().manual_seed(35)
    w, s = _weights("fp8_block", 3, 64, 256, g)
    xb = torch.randn(6, 256, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([2, 0, 2, 2, 1, 0]).to(DEV)
    check_close(atb_ops.grouped_matmul(xb, w, ids, s, "fp8_block"), xb, w, s, "fp8_block", ids)
    check_close(atb_ops.linear(xb, w[1], s[1], "fp8_block"), xb, w[1], s[1], "fp8_block")


# ---- DeepSeek-V4 shapes on the GPU ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_grouped_matmul_tc_real_shapes(fmt, t):
    g = torch.Generator().manual_seed(36)
    e, n, k = 64, 2048, 4096
    w, s = _weights_on_device(fmt, e, n, k, 36)
    x = (torch.randn(t * 6, k, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).view(-1)
    ids[: min(len(ids), 40)] = 5  # a hot expert: several passes
    ids = ids.to(DEV)
    check_close(tc.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 16, 32, 64, 100])
def test_linear_tc_real_shapes(fmt, m):
    g = torch.Generator().manual_seed(37)
    w, s = _weights_on_device(fmt, 1, 4096, 4096, 37)
    x = torch.randn(m, 4096, generator=g).to(DEV, torch.bfloat16)
    check_close(tc.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)
    check_close(atb_ops.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)  # whichever path the default picks



@pytest.mark.parametrize("d8,fixup", [(1, 0), (2, 0), (0, 1)])  # PTX decoders (word / pair) / Triton's
@pytest.mark.parametrize("float_scale", [False, True])
def test_linear_tc_fp8_scales_before_loop(d8, fixup, float_scale, monkeypatch):
    """fp8: each program loads the block scales of its K range once, before its loops, and picks each step's
    from registers; with the PTX decoder (d8: even / odd columns) and with Triton's e4m3 conversion. K ranges of
    11 steps (1 split: 16 slots, the last 5 masked), 4 / 3 (3 splits), and of the grouped op's 2 splits x two row
    passes; E8M0 and float32 scales."""
    monkeypatch.setenv("ATB_CUDA_TC_CFG", f"fixup={fixup},d8={d8}")
    g = torch.Generator().manual_seed(35)
    n, k = 136, 1024 + 384
    w, s = _weights("fp8_block", 1, n, k, g, float_scale=float_scale)
    for m in (1, 40):
        x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
        for split in (1, 3):
            monkeypatch.setattr(tc, "_splits", lambda *a, _s=split: _s)
            check_close(tc.linear(x, w[0], s[0], "fp8_block"), x, w[0], s[0], "fp8_block")
    monkeypatch.setattr(tc, "_splits", lambda *a: 2)
    e = 3
    w, s = _weights("fp8_block", e, n, k, g, float_scale=float_scale)
    x = torch.randn(21, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(21, e, g, hot=2).to(DEV)
    check_close(tc.grouped_matmul(x, w, ids, s, "fp8_block"), x, w, s, "fp8_block", ids)
