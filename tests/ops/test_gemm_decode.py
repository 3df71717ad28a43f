"""The decode-shaped FP4 / FP8-block GEMM of the CUDA backend (atb_ops/cuda/gemm_decode.py).

- The PTX weight decoders are run here on the CPU by a small emulator of the instructions they use, over every
  byte value, against quant's dequantisation (the GPU itself runs them only under the ``cuda`` marker).
- The kernel runs through Triton's interpreter at small shapes (the decoders replaced by plain Triton arithmetic)
  and on the GPU at DeepSeek-V4 expert shapes (``cuda``), against the reference op: every output within one
  bfloat16 rounding (plus float32 summation noise) of the exact float64 product.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import gemm_decode as gd  # noqa: E402
from atb_ops.reference.linear import dequant_weight  # noqa: E402
from quant.fp4 import dequant_fp4, quant_fp4  # noqa: E402
from quant.fp8_block import quant_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---- a PTX emulator for the decoders ---------------------------------------------------------------------------
def _bf16x2_to_f32(v):
    lo = (v & 0xFFFF).astype(np.uint32) << 16
    hi = v & 0xFFFF0000
    return lo.view(np.float32), hi.astype(np.uint32).view(np.float32)


def _f32_to_bf16_bits(f):
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in float32, as in quant's dequantisation
        f = np.asarray(f, dtype=np.float32)
    t = torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
    return t.numpy().astype(np.uint16).astype(np.uint32)


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = np.choose(np.asarray(s & 7, dtype=np.int64), src) if np.ndim(s) else src[s & 7]
        if np.any(s & 8):
            byte = np.where(s & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= (byte & 0xFF) << (8 * i)
    return out & 0xFFFFFFFF


def run_ptx(asm: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Run the straight-line PTX of an inline-asm decoder on uint32 arrays ($0.. outputs, then the inputs)."""
    regs: dict[str, np.ndarray] = {f"${n_out + i}": v.astype(np.uint32) for i, v in enumerate(inputs)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        d, src = a[0], [val(t) for t in a[1:]]
        u = np.uint64
        if op == "mov.b32":
            r = src[0]
        elif op == "prmt.b32":
            r = _prmt(src[0].astype(u), np.uint64(src[1]), int(src[2]))
        elif op == "cvt.u32.u16":
            r = src[0] & np.uint32(0xFFFF)
        elif op == "shr.u32":
            r = src[0] >> np.uint32(src[1])
        elif op == "shl.b32":
            r = (src[0].astype(u) << u(src[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "lop3.b32":
            x, y, z, lut = (np.broadcast_to(np.asarray(s, dtype=u), np.shape(src[0])) for s in src)
            r = np.zeros(np.shape(src[0]), dtype=u)
            for bit in range(32):
                idx = (((x >> bit) & 1) << 2) | (((y >> bit) & 1) << 1) | ((z >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit
        elif op == "mad.lo.u32":
            r = (src[0].astype(u) * u(src[1]) + src[2].astype(u)) & 0xFFFFFFFF
        elif op == "fma.rn.bf16x2":
            lanes = [_bf16x2_to_f32(np.broadcast_to(np.asarray(s, dtype=np.uint32), np.shape(src[0]))) for s in src]
            res = [lanes[0][j].astype(np.float64) * lanes[1][j] + lanes[2][j] for j in range(2)]
            r = _f32_to_bf16_bits(res[0]) | (_f32_to_bf16_bits(res[1]) << 16)
        else:
            raise AssertionError(f"emulator: unsupported instruction {op}")
        regs[d] = np.asarray(r, dtype=np.uint64).astype(np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]


def _bf16_bits_to_f32(bits):
    return torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32).copy())


def test_ptx_emulator_prmt_and_lop3():
    a, b = np.array([0x33221100], dtype=np.uint64), 0x77665544
    assert int(_prmt(a, b, 0x1404)[0]) == 0x11440044
    assert int(_prmt(a, b, 0x7531)[0]) == 0x77553311
    (r,) = run_ptx("lop3.b32 $0, $1, $2, 0x0000FFFF, 0xA8;", [np.array([0xF0F0F0F0]), np.array([0x0F000F00])], 1)
    assert int(r[0]) == (0xF0F0F0F0 | 0x0F000F00) & 0xFFFF


@pytest.mark.parametrize("one_mul", [False, True])
@pytest.mark.parametrize("sc", [0, 1, 100, 118, 127, 128, 129, 200, 254])
def test_fp4_ptx_decodes_every_byte(sc, one_mul):
    """All 256 bytes (both nibbles, every code and sign) under E8M0 scale byte sc, exactly as quant.fp4 does; the
    one-multiply decoder (multiplier 2^(sc - 1)) for sc <= 128."""
    if one_mul and sc > 128:
        pytest.skip("one multiply only for scale bytes <= 128")
    bytes_ = np.arange(256, dtype=np.uint32).reshape(64, 4)
    words = bytes_[:, 0] | bytes_[:, 1] << 8 | bytes_[:, 2] << 16 | bytes_[:, 3] << 24
    sbits = np.uint32((sc + 126) << 7 if one_mul else (0x40 if sc == 0 else sc << 7))
    s_pair = np.full(64, sbits | (sbits << 16), dtype=np.uint32)
    asm = gd.FP4_PTX_1MUL if one_mul else gd.FP4_PTX
    lo01, lo23, hi01, hi23 = run_ptx(asm, [words, s_pair, s_pair], 4)
    got_lo = torch.stack([_bf16_bits_to_f32(lo01 & 0xFFFF), _bf16_bits_to_f32(lo01 >> 16),
                          _bf16_bits_to_f32(lo23 & 0xFFFF), _bf16_bits_to_f32(lo23 >> 16)], 1).flatten()
    got_hi = torch.stack([_bf16_bits_to_f32(hi01 & 0xFFFF), _bf16_bits_to_f32(hi01 >> 16),
                          _bf16_bits_to_f32(hi23 & 0xFFFF), _bf16_bits_to_f32(hi23 >> 16)], 1).flatten()
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(1, 256)
    want = dequant_fp4(packed, torch.full((1, 16), sc, dtype=torch.uint8), dtype=torch.float32)[0]
    assert torch.equal(got_lo, want[0::2]) and torch.equal(got_hi, want[1::2])


def test_fp8_ptx_decodes_every_byte():
    """All e4m3 bytes but the two NaN codes (0x7F, 0xFF; decoded as +-480), exactly."""
    bytes_ = np.arange(256, dtype=np.uint32).reshape(64, 4)
    words = bytes_[:, 0] | bytes_[:, 1] << 8 | bytes_[:, 2] << 16 | bytes_[:, 3] << 24
    r01, r23 = run_ptx(gd.FP8_PTX, [words], 2)
    got = torch.stack([_bf16_bits_to_f32(r01 & 0xFFFF), _bf16_bits_to_f32(r01 >> 16),
                       _bf16_bits_to_f32(r23 & 0xFFFF), _bf16_bits_to_f32(r23 >> 16)], 1).flatten()
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ok = ~torch.isnan(want)
    assert int(ok.sum()) == 254 and torch.equal(got[ok], want[ok])


# ---- the kernel against the reference op ---------------------------------------------------------------------------
def _weights(fmt, e, n, k, g, float_scale=False):
    w = torch.randn(e, n, k, generator=g) * 0.1
    if fmt == "fp4":
        q, s = quant_fp4(w)
    else:
        q, s = quant_fp8_block(w, scale_fmt=None if float_scale else "ue8m0")
    return q.to(DEV), s.to(DEV)


def check_close(got, x, w, s, fmt, ids=None):
    """Every entry within one bfloat16 rounding of the float64 product (plus float32 summation noise); computed
    per expert, on x's device."""
    if ids is None:
        w, s, ids = w.unsqueeze(0), s.unsqueeze(0), torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    xd = x.double()
    exact = torch.zeros(got.shape, dtype=torch.float64, device=x.device)
    mag = torch.zeros_like(exact)
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero(as_tuple=True)[0]
        wd = dequant_weight(w[e], s[e], fmt).double()
        exact[rows] = xd[rows] @ wd.t()
        mag[rows] = xd[rows].abs() @ wd.abs().t()
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    err = (got.double() - exact).abs()
    assert bool((err <= ulp + 1e-5 * mag + 1e-30).all()), float((err / (ulp + 1e-5 * mag)).max())


def _ids(m, e, g, hot=None):
    ids = torch.randint(0, e, (m,), generator=g)
    if hot is not None:
        ids[: min(m, 20)] = hot  # one expert with more rows than one pass (BM = 16)
    return ids


@pytest.mark.parametrize("fused", [True, False])  # active experts found by each program / by the prologue kernel
@pytest.mark.parametrize("one_mul", [0, 1])
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_grouped_matmul_decode(fmt, m, one_mul, fused, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_DECODE_CFG", f"mul1={one_mul}")
    if not fused:
        monkeypatch.setattr(gd, "FUSED_ACTIVE", 0)
    g = torch.Generator().manual_seed(21)
    e, n, k = 5, 72, 320 if fmt == "fp4" else 384  # N, K not multiples of the tiles; experts without rows
    w, s = _weights(fmt, e, n, k, g)
    x = (torch.randn(m, k, generator=g)).to(DEV, torch.bfloat16)
    ids = _ids(m, e, g, hot=3 if m > 20 else None).to(DEV)
    got = gd.grouped_matmul(x, w, ids, s, fmt)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, fmt, ids)
    ref = atb_ops.implementations("grouped_matmul")["reference"](x, w, ids, s, fmt)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
def test_grouped_matmul_decode_32_rows_per_pass(fmt, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_DECODE_BM", "32")
    g = torch.Generator().manual_seed(26)
    e, n, k = 3, 64, 256
    w, s = _weights(fmt, e, n, k, g)
    x = torch.randn(45, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(45, e, g)
    ids[:40] = 1  # 40+ rows on expert 1: a full pass of 32 and a partial one
    ids = ids.to(DEV)
    check_close(gd.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)


@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
def test_linear_decode_with_split_k(fmt, monkeypatch):
    g = torch.Generator().manual_seed(22)
    n, k = 64, 2048
    w, s = _weights(fmt, 1, n, k, g, float_scale=fmt == "fp8_block")
    x = torch.randn(3, k, generator=g).to(DEV, torch.bfloat16)
    for split in (1, 3):
        monkeypatch.setattr(gd, "_splits", lambda *a, _s=split: _s)
        check_close(gd.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_matmul_decode_ids_outside_range(fused, monkeypatch):
    """Ids outside [0, E) are outside the op's contract; the decode kernel writes those rows as zeros and leaves
    the others exact. int32 ids work as int64 ones do."""
    if not fused:
        monkeypatch.setattr(gd, "FUSED_ACTIVE", 0)
    g = torch.Generator().manual_seed(23)
    e, n, k = 4, 64, 128
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(9, k, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([0, -1, 2, 4, 2, 1, 7, 0, 3], dtype=torch.int32).to(DEV)
    got = gd.grouped_matmul(x, w, ids, s, "fp4")
    bad = (ids < 0) | (ids >= e)
    assert bool((got[bad] == 0).all())
    good = ~bad
    check_close(got[good], x[good], w, s, "fp4", ids[good])


def test_dispatch_selects_decode_by_shape(monkeypatch):
    from atb_ops.cuda import gemm

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    s = torch.zeros(8, 2, dtype=torch.uint8)
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)
    assert gemm._use_decode(x, "fp4", s, 4, 4)
    assert not gemm._use_decode(x, "fp4", s, 4, 1000)
    assert not gemm._use_decode(x.float(), "fp4", s, 4, 4)
    assert not gemm._use_decode(x, "fp4", s.float(), 4, 4)  # fp4 needs E8M0 scales
    assert not gemm._use_decode(x, "dense", None, 4, 4)
    monkeypatch.setenv("ATB_CUDA_GEMM", "tiled")
    assert not gemm._use_decode(x, "fp4", s, 4, 4)
    monkeypatch.setenv("ATB_CUDA_GEMM", "decode")
    assert gemm._use_decode(x, "fp4", s, 4, 1000)


# ---- DeepSeek-V4 expert shapes on the GPU ---------------------------------------------------------------------------
def _weights_on_device(fmt, e, n, k, seed):
    """Random weights made and quantised on the GPU (64 experts of 2048 x 4096 take minutes on the host)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(e, n, k, device=DEV, generator=g) * 0.1
    return quant_fp4(w) if fmt == "fp4" else quant_fp8_block(w)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_grouped_matmul_decode_real_shapes(fmt, t):
    g = torch.Generator().manual_seed(24)
    e, n, k = 64, 2048, 4096
    w, s = _weights_on_device(fmt, e, n, k, 24)
    x = (torch.randn(t * 6, k, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).view(-1)
    ids[: min(len(ids), 40)] = 5  # a hot expert: several passes
    ids = ids.to(DEV)
    check_close(gd.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)
    # and through the public op (the dispatcher picks the decode kernel at these shapes)
    check_close(atb_ops.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_linear_decode_real_shapes(fmt, m):
    g = torch.Generator().manual_seed(25)
    w, s = _weights_on_device(fmt, 1, 4096, 4096, 25)
    x = torch.randn(m, 4096, generator=g).to(DEV, torch.bfloat16)
    check_close(gd.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)


def test_small_scales_is_cached_per_tensor_and_version():
    s = torch.full((4, 8), 120, dtype=torch.uint8)
    assert gd.small_scales(s)
    s[0, 0] = 129  # in place: a new version, read again
    assert not gd.small_scales(s)
    t = torch.full((2,), 128, dtype=torch.uint8)
    assert gd.small_scales(t) and gd.small_scales(torch.empty(0, dtype=torch.uint8))


def test_fp4_large_scales_use_two_multiplies():
    """Scale bytes above 128 (scales > 2) decode through the two-multiply path (the default picks it)."""
    g = torch.Generator().manual_seed(27)
    w, s = _weights("fp4", 2, 64, 128, g)
    s = s.clone()
    s[1, :5] = 140
    x = torch.randn(4, 128, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([0, 1, 1, 0]).to(DEV)
    assert not gd.small_scales(s)
    check_close(gd.grouped_matmul(x, w, ids, s, "fp4"), x, w, s, "fp4", ids)
