"""The sorted-rows swap-AB tensor-core FP4 / FP8-block GEMM of the CUDA backend (atb_ops/cuda/gemm_tc_large.py).

- Its FP8 decoders (int32 words of 4 e4m3 bytes -> 4 column phases; bytes with the E8M0 scale folded in) run here
  on the CPU through the PTX emulator of test_gemm_decode.py, over every byte value, against torch's e4m3 values.
- The row sort (three small kernels) and the kernel run through Triton's interpreter at small shapes (decoders
  replaced by plain Triton arithmetic) and on the GPU at DeepSeek-V4 shapes (``cuda``): every output within one
  bfloat16 rounding (plus float32 summation noise) of the exact float64 product, and close to the reference op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import gemm_tc as tc  # noqa: E402
from atb_ops.cuda import gemm_tc_large as tcl  # noqa: E402

from test_gemm_decode import _bf16_bits_to_f32, _ids, _weights, _weights_on_device, check_close, run_ptx  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # NaN at 0x7F, 0xFF


def _lanes(r):
    return _bf16_bits_to_f32(r & 0xFFFF), _bf16_bits_to_f32(r >> 16)


@pytest.mark.parametrize("sc", [None, tcl.FOLD_LO, 60, 127, tcl.FOLD_HI])
def test_fp8x4_ptx_decodes_every_byte(sc):
    """Words w0 / w1 with every byte value at every position; output i = byte i of (w0, w1) times the scale
    (sc None: the 2^120 rebias alone, the scale applied later)."""
    v = np.arange(256, dtype=np.uint32)
    b = [(v + 37 * i) % 256 for i in range(4)]  # byte i of w0
    c = [(v * 7 + 11 * i) % 256 for i in range(4)]  # byte i of w1
    w0 = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
    w1 = c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24
    bits = 0x7B80 if sc is None else (sc + 120) << 7
    outs = run_ptx(tcl.FP8X4_PTX, [w0, w1, np.full(256, bits | bits << 16, dtype=np.uint32)], 4)
    scale = 1.0 if sc is None else 2.0 ** (sc - 127)
    for i, r in enumerate(outs):
        lo, hi = _lanes(r)
        for got, byte in ((lo, b[i]), (hi, c[i])):
            want = E4M3[torch.from_numpy(byte.astype(np.int64))] * scale
            ok = ~torch.isnan(want)
            assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("sc", [tcl.FOLD_LO, 100, 127, tcl.FOLD_HI])
def test_fp8_scaled_byte_ptx_decodes_every_byte(sc):
    bytes_ = np.arange(256, dtype=np.uint32).reshape(64, 4)
    words = bytes_[:, 0] | bytes_[:, 1] << 8 | bytes_[:, 2] << 16 | bytes_[:, 3] << 24
    bits = np.full(64, ((sc + 120) << 7) * 0x10001, dtype=np.uint32)
    r01, r23 = run_ptx(tcl.FP8S_PTX, [words, bits, bits], 2)
    got = torch.stack([*_lanes(r01), *_lanes(r23)], 1).flatten()
    want = E4M3 * 2.0 ** (sc - 127)
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("sc", [tcl.FOLD_LO, 100, 127, tcl.FOLD_HI])
def test_fp8_scaled_pair_ptx_decodes_every_pair(sc):
    """words=2: every 16-bit pair of e4m3 codes, in order, times the pair's folded scale 2^(sc - 7)."""
    pairs = np.arange(65536, dtype=np.uint32)
    bits = np.full(65536, ((sc + 120) << 7) * 0x10001, dtype=np.uint32)
    (r,) = run_ptx(tcl.FP8SP_PTX, [pairs, bits], 1)
    lo, hi = _lanes(r)
    codes = torch.from_numpy(pairs.astype(np.int64))
    for got, c in ((lo, codes & 0xFF), (hi, codes >> 8)):
        want = E4M3[c] * 2.0 ** (sc - 127)
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("bt", [1, 4, 64])
def test_sort_rows(bt):
    """Every row once, experts increasing, ids outside [0, E) last (bucket E); tiles of <= bt rows within one
    bucket cover them in order; unused tiles are empty."""
    g = torch.Generator().manual_seed(41)
    e = 6
    ids = torch.randint(0, e, (50,), generator=g)
    ids[ids == 2] = 3  # an expert without rows
    ids[[4, 9, 30]] = torch.tensor([-1, 6, 100])
    order, tiles = tcl.sort_rows(ids.to(DEV), e, bt)
    order, tiles = order.cpu().long(), tiles.cpu().long()
    assert sorted(order.tolist()) == list(range(50))
    bucket = torch.where((ids >= 0) & (ids < e), ids, e)
    assert bool((bucket[order][1:] >= bucket[order][:-1]).all())
    n_tiles = -(-50 // bt) + min(e + 1, 50)
    assert tiles.shape == (3, n_tiles)
    pos = 0
    for t in range(n_tiles):
        b, r0, r1 = tiles[:, t].tolist()
        if r0 == r1:
            assert pos == 50 and b == e and r0 == 0
            continue
        assert r0 == pos and 0 < r1 - r0 <= bt and bool((bucket[order[r0:r1]] == b).all())
        pos = r1
    assert pos == 50


CFGS = ["", "words=0", "fold=0,xsplit=0", "bt=16,bw=64,warps=4", "words=0,fold=0,bt=32", "spf=0,xsplit=1"]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_grouped_matmul_tcl(fmt, m, cfg, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_TCL_CFG", cfg)
    g = torch.Generator().manual_seed(42)
    e, n, k = 5, 72, 320 if fmt == "fp4" else 384  # N, K not multiples of the tiles; experts without rows
    w, s = _weights(fmt, e, n, k, g)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(m, e, g, hot=3 if m > 20 else None).to(DEV)  # m = 37: 20+ rows on one expert (several tiles)
    got = tcl.grouped_matmul(x, w, ids, s, fmt)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, fmt, ids)
    ref = atb_ops.implementations("grouped_matmul")["reference"](x, w, ids, s, fmt)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.parametrize("words", [0, 1, 2])
def test_fp8_scales_float_or_outside_the_fold_range(words, monkeypatch):
    """float32 block scales and E8M0 bytes outside [FOLD_LO, FOLD_HI]: each step's product scaled in float32."""
    monkeypatch.setenv("ATB_CUDA_TCL_CFG", f"words={words}")
    g = torch.Generator().manual_seed(43)
    e, n, k = 3, 136, 256
    x = torch.randn(20, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(20, e, g).to(DEV)
    w, s = _weights("fp8_block", e, n, k, g, float_scale=True)
    check_close(tcl.grouped_matmul(x, w, ids, s, "fp8_block"), x, w, s, "fp8_block", ids)
    w, s = _weights("fp8_block", e, n, k, g)
    s = s.clone()
    s[1, 0, 1] = tcl.FOLD_HI + 1  # scale 2^8: not foldable
    assert not tcl.foldable(s) and tcl.foldable(s[0])
    check_close(tcl.grouped_matmul(x, w, ids, s, "fp8_block"), x, w, s, "fp8_block", ids)


@pytest.mark.parametrize("fixup", [1, 0])  # partial sums added by the last program of a tile / by a second kernel
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
def test_linear_tcl_split_k(fmt, fixup, monkeypatch):
    g = torch.Generator().manual_seed(44)
    n, k = 200, 2048
    w, s = _weights(fmt, 1, n, k, g, float_scale=fmt == "fp8_block" and fixup == 0)
    for m in (1, 3, 70):  # 70 rows: two row tiles of 64
        x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
        for split in (1, 3):
            monkeypatch.setenv("ATB_CUDA_TCL_CFG", f"fixup={fixup},split={split}")
            check_close(tcl.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)
    assert int(tc._counters(x.device).abs().sum()) == 0  # every launch leaves its arrival counters at zero


def test_grouped_tcl_split_k(monkeypatch):
    """Split-K over the tiles of a grouped call (a counter per tile), ids outside [0, E) written as zeros."""
    monkeypatch.setenv("ATB_CUDA_TCL_CFG", "split=2,bt=16")
    g = torch.Generator().manual_seed(45)
    e, n, k = 3, 64, 512
    w, s = _weights("fp8_block", e, n, k, g)
    x = torch.randn(40, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(40, e, g)
    ids[:35] = 2  # three tiles of 16 on expert 2
    ids[36] = -1
    ids = ids.to(DEV)
    got = tcl.grouped_matmul(x, w, ids, s, "fp8_block")
    assert bool((got[36] == 0).all())
    keep = ids >= 0
    check_close(got[keep], x[keep], w, s, "fp8_block", ids[keep])
    assert int(tc._counters(x.device).abs().sum()) == 0


def test_tcl_edge_cases():
    """M = 0, one row, ids outside [0, E) (zeros), int32 ids, scale bytes > 128 (two-multiply fp4 decoder)."""
    g = torch.Generator().manual_seed(46)
    e, n, k = 4, 64, 128
    w, s = _weights("fp4", e, n, k, g)
    x0 = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    assert tcl.grouped_matmul(x0, w, torch.zeros(0, dtype=torch.long, device=DEV), s, "fp4").shape == (0, n)
    assert tcl.linear(x0, w[0], s[0], "fp4").shape == (0, n)
    x = torch.randn(9, k, generator=g).to(DEV, torch.bfloat16)
    check_close(tcl.grouped_matmul(x[:1], w, torch.tensor([3], device=DEV), s, "fp4"), x[:1], w, s, "fp4",
                torch.tensor([3], device=DEV))
    ids = torch.tensor([0, -1, 2, 4, 2, 1, 7, 0, 3], dtype=torch.int32).to(DEV)
    s2 = s.clone()
    s2[2, :3] = 140
    got = tcl.grouped_matmul(x, w, ids, s2, "fp4")
    bad = (ids < 0) | (ids >= e)
    assert bool((got[bad] == 0).all())
    check_close(got[~bad], x[~bad], w, s2, "fp4", ids[~bad])


def test_dispatch_tcl(monkeypatch):
    """ATB_CUDA_GEMM=tcl routes eligible calls of any row count here; auto sends large grouped calls here."""
    from atb_ops.cuda import gemm

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    s = torch.zeros(8, 2, dtype=torch.uint8)
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)
    assert gemm._path(x, "fp4", s, gemm.TCL_GROUPED_MIN_ROWS, 48) == "tcl"
    assert gemm._path(x, "fp8_block", s, 4096, 64) == "tcl"
    assert gemm._path(x, "fp4", s, 0, 0) == "tiled"
    assert gemm._path(x.float(), "fp4", s, 4096, 64) == "tiled"
    monkeypatch.setenv("ATB_CUDA_GEMM", "tc")
    assert gemm._path(x, "fp4", s, 3072, 48) == "tiled"  # beyond the tc kernel's row limit
    monkeypatch.setenv("ATB_CUDA_GEMM", "tcl")
    assert gemm._path(x, "fp4", s, 6, 1) == "tcl"
    assert gemm._path(x, "fp4", s, 1, 1, grouped=False) == "tcl"
    assert gemm._path(x, "fp8_block", s.float(), 6, 1) == "tcl"
    assert gemm._path(x, "fp4", s.float(), 6, 1) == "tiled"  # fp4 needs E8M0 scales
    g = torch.Generator().manual_seed(47)
    w, s = _weights("fp4", 3, 64, 256, g)
    xb = torch.randn(6, 256, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([2, 0, 2, 2, 1, 0]).to(DEV)
    check_close(atb_ops.grouped_matmul(xb, w, ids, s, "fp4"), xb, w, s, "fp4", ids)
    check_close(atb_ops.linear(xb, w[1], s[1], "fp4"), xb, w[1], s[1], "fp4")


# ---- DeepSeek-V4 shapes on the GPU ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", ["", "words=0,fold=0", "spf=0,xsplit=1", "words=2", "words=2,fold=0"])
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("t", [8, 512])
def test_grouped_matmul_tcl_real_shapes(fmt, t, cfg, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_TCL_CFG", cfg)
    g = torch.Generator().manual_seed(48)
    e, n, k = 64, 2048, 4096
    w, s = _weights_on_device(fmt, e, n, k, 48)
    x = (torch.randn(t * 6, k, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).view(-1)
    ids[: min(len(ids), 200)] = 5  # a hot expert: several row tiles
    ids = ids.to(DEV)
    check_close(tcl.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)
    check_close(atb_ops.grouped_matmul(x, w, ids, s, fmt), x, w, s, fmt, ids)  # whichever path the default picks


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp4", "fp8_block"])
@pytest.mark.parametrize("m", [1, 64, 100, 512])
def test_linear_tcl_real_shapes(fmt, m):
    g = torch.Generator().manual_seed(49)
    w, s = _weights_on_device(fmt, 1, 4096, 4096, 49)
    x = torch.randn(m, 4096, generator=g).to(DEV, torch.bfloat16)
    check_close(tcl.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)
    check_close(atb_ops.linear(x, w[0], s[0], fmt), x, w[0], s[0], fmt)
