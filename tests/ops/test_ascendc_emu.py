"""The AscendC kernels (atb_ops/ascendc/kernels) run through the host emulation against the reference ops.

Every launch also checks that the UB bytes the kernel reserved (measured by the emulation's TPipe) equal the
tiling's plan and fit the SoC; the emulation itself raises on UB overflow, misaligned DataCopy and out-of-bounds
access, so each passing case also passed those checks.
"""

from __future__ import annotations

import pytest
import torch

import atb_ops
from atb_ops.ascendc.emu import build, runner
from atb_ops.ascendc.emu.runner import EmuKernelError, run_compressor, run_mla

ref = {op: atb_ops.implementations(op)["reference"] for op in ("compressor_pool", "sparse_attention", "mla_decode")}


@pytest.fixture(scope="session", autouse=True)
def emu_lib():
    return build.load()  # compile (or load from the cache) once for the whole session


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _ub_ok(launch):
    t = launch.tiling
    assert launch.ub_peak == t.ubBytes <= t.socUb
    return launch.out


def _overlap_cand(seq_lens, r):
    rows, start = [], 0
    for n in seq_lens:
        for i in range(n // r):
            prev = [start + r * (i - 1) + j for j in range(r)] if i > 0 else [-1] * r
            rows.append(prev + [start + r * i + j for j in range(r)])
        start += n
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2 * r)


def _plain_cand(seq_lens, r):
    rows, start = [], 0
    for n in seq_lens:
        rows += [[start + r * i + j for j in range(r)] for i in range(n // r)]
        start += n
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, r)


# ---- compressor ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctile", [0, 8, 24, 64])
@pytest.mark.parametrize("c", [5, 20, 64, 128])
def test_compressor_ratio4_overlap_every_channel_tiling(c, ctile):
    # ragged sequences (lengths not multiples of 4; entry 0 of each has no previous block), explicit channel tiles:
    # one tile, several tiles with a partial last one, DataCopyPad for widths that are not whole 32-byte blocks
    seq = [10, 9, 4, 1]
    S = sum(seq)
    kv, sc = torch.randn(S, 2 * c, generator=_g(c)), 3 * torch.randn(S, 2 * c, generator=_g(c + 1))
    cand = _overlap_cand(seq, 4)
    out = _ub_ok(run_compressor(kv, sc, cand, True, force_ctile=ctile))
    torch.testing.assert_close(out, ref["compressor_pool"](kv, sc, cand, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_ratio128_and_auto_tiling(dtype):
    r, c = 128, 48
    seq = [300, 128, 5]  # 2 + 1 entries; partial blocks have none
    S = sum(seq)
    kv = torch.randn(S, c, generator=_g(3)).to(dtype)
    sc = (4 * torch.randn(S, c, generator=_g(4))).to(dtype)
    cand = _plain_cand(seq, r)
    launch = run_compressor(kv, sc, cand, False)
    assert launch.tiling.nCTiles >= 1 and launch.tiling.dtype == (dtype == torch.bfloat16)
    torch.testing.assert_close(_ub_ok(launch), ref["compressor_pool"](kv, sc, cand, False), rtol=1e-5, atol=1e-6)


def test_compressor_decode_splits_channels_over_cores_and_many_entries_do_not():
    few = runner.compressor_tiling(1, 8, 64, 1024, True, torch.float32, soc="ascend910b2")
    assert few.c == 512 and few.cTile == 64 and few.nCTiles == 8 and few.blockDim == 8
    many = runner.compressor_tiling(480, 8, 4096, 1024, True, torch.float32, soc="ascend910b2")
    assert many.cTile == 512 and many.blockDim == 48
    for soc in runner.SOCS:
        for M, K, W in ((1, 8, 1024), (64, 8, 1024), (3, 128, 512), (1000, 256, 8192)):
            t = runner.compressor_tiling(M, K, 10 ** 6, W, K == 8, torch.bfloat16, soc=soc)
            assert t.ubBytes <= t.socUb


def test_compressor_absent_candidates_and_one_entry():
    c = 7
    kv, sc = torch.randn(12, 2 * c, generator=_g(5)), 50 * torch.randn(12, 2 * c, generator=_g(6))
    cand = torch.full((3, 8), -1, dtype=torch.int64)
    cand[0, 2] = 5          # one previous-block candidate: reads the A half
    cand[1, 6] = 9          # one current-block candidate: reads the B half
    cand[2, :] = torch.tensor([0, -1, 2, -1, 4, 5, -1, 7])
    out = _ub_ok(run_compressor(kv, sc, cand, True))
    torch.testing.assert_close(out[0], kv[5, :c])
    torch.testing.assert_close(out[1], kv[9, c:])
    torch.testing.assert_close(out, ref["compressor_pool"](kv, sc, cand, True), rtol=1e-5, atol=1e-6)
    one = _ub_ok(run_compressor(kv, sc, cand[2:], True))
    torch.testing.assert_close(one, out[2:])
    # an entry with no candidate at all: the kernel writes 0 (the reference's softmax over nothing is NaN; the model
    # never asks for such an entry)
    none = _ub_ok(run_compressor(kv, sc, torch.full((1, 8), -1, dtype=torch.int64), True))
    assert torch.equal(none, torch.zeros(1, c))


def test_compressor_unreferenced_garbage_and_large_logits():
    c = 16
    kv, sc = torch.randn(10, c, generator=_g(7)), torch.randn(10, c, generator=_g(8))
    cand = torch.tensor([[2, -1, 4, -1], [-1, 5, 6, 7]])
    base = _ub_ok(run_compressor(kv, sc, cand, False))
    kv[0], sc[0], kv[9], sc[9] = float("nan"), float("nan"), float("inf"), float("inf")
    torch.testing.assert_close(_ub_ok(run_compressor(kv, sc + 1000.0, cand, False)), base, rtol=1e-4, atol=1e-5)


def test_compressor_backend_dispatch_and_empty():
    kv, sc = torch.randn(8, 6), torch.randn(8, 6)
    with atb_ops.use_backend("ascendc_emu"):
        assert atb_ops.compressor_pool(kv, sc, torch.empty(0, 8, dtype=torch.int64), True).shape == (0, 3)
        cand = _overlap_cand([8], 4)
        torch.testing.assert_close(atb_ops.compressor_pool(kv, sc, cand, True), ref["compressor_pool"](kv, sc, cand, True))
        with pytest.raises(IndexError, match="out of range"):
            atb_ops.compressor_pool(kv, sc, cand + 8, True)


def test_ub_overflow_is_reported_by_the_emulation():
    kv, sc = torch.randn(8, 128), torch.randn(8, 128)
    with pytest.raises(EmuKernelError, match="unified buffer overflow"):
        run_compressor(kv, sc, _plain_cand([8], 4), False, force_ctile=128, force_ub=4096)
    q, pool = torch.randn(1, 4, 128), torch.randn(10, 128)
    with pytest.raises(EmuKernelError, match="unified buffer overflow"):
        run_mla(q, None, pool, torch.arange(10).view(1, 10), None, None, None, 1.0, force_hg=4, force_nb=8, force_ub=8192)


# ---- attention (sparse_attention / mla_decode) ---------------------------------------------------------------------

def _sa_inputs(seed, T, H, D, P, K, P2=0, K2=0, dtype=torch.float32, kv_dtype=None, pad=0.3):
    g = _g(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(P, D, generator=g).to(kv_dtype or dtype)
    idx = torch.randint(0, P, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < pad] = -1
    sink = torch.randn(H, generator=g)
    extra = extra_idx = None
    if K2:
        extra = torch.randn(P2, D, generator=g).to(kv_dtype or dtype)
        extra_idx = torch.randint(0, P2, (T, K2), generator=g)
        extra_idx[torch.rand(T, K2, generator=g) < pad] = -1
    return q, kv, idx, sink, extra, extra_idx


@pytest.mark.parametrize("hg,nb", [(0, 0), (1, 8), (2, 8), (3, 16), (4, 64), (16, 32)])
def test_sparse_attention_every_head_and_row_tiling(hg, nb):
    # 5 heads (groups that do not divide them), 150 + 70 rows (several index chunks of 64, several row blocks,
    # a partial last block), -1 padding in both sets
    q, kv, idx, sink, ex, exi = _sa_inputs(11, 3, 5, 40, 97, 150, 33, 70)
    launch = run_mla(q, None, kv, idx, ex, exi, sink, 0.2, force_hg=hg, force_nb=nb)
    torch.testing.assert_close(_ub_ok(launch), ref["sparse_attention"](q, kv, idx, sink, 0.2, ex, exi), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qd,kvd", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)])
def test_sparse_attention_dtypes(qd, kvd):
    q, kv, idx, sink, ex, exi = _sa_inputs(12, 2, 4, 24, 40, 30, 16, 9, dtype=qd, kv_dtype=kvd)
    with atb_ops.use_backend("ascendc_emu"):
        out = atb_ops.sparse_attention(q, kv, idx, sink, 0.25, ex, exi)
    exp = ref["sparse_attention"](q, kv, idx, sink, 0.25, ex, exi)
    assert out.dtype == qd
    tol = dict(rtol=1e-5, atol=1e-6) if qd == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out.float(), exp.float(), **tol)


def test_sparse_attention_edge_cases():
    q, kv, idx, sink, ex, exi = _sa_inputs(13, 4, 3, 16, 20, 6, 10, 3)
    idx[1] = -1            # token 1: no window row, only compressed entries
    idx[2], exi[2] = -1, -1  # token 2: empty selection -> 0 (only the sink's mass)
    kv[idx.clamp(min=0).max() + 1:] = float("nan")  # rows nobody selects are never read
    with atb_ops.use_backend("ascendc_emu"):
        out = atb_ops.sparse_attention(q, kv, idx, sink, 0.3, ex, exi)
        torch.testing.assert_close(out, ref["sparse_attention"](q, kv, idx, sink, 0.3, ex, exi), rtol=1e-5, atol=1e-6)
        assert torch.equal(out[2], torch.zeros(3, 16))
        # no extra set, a zero-width extra set, one token, empty batch
        torch.testing.assert_close(atb_ops.sparse_attention(q, kv, idx, sink, 0.3),
                                   ref["sparse_attention"](q, kv, idx, sink, 0.3), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(atb_ops.sparse_attention(q, kv, idx, sink, 0.3, ex, exi[:, :0]),
                                   ref["sparse_attention"](q, kv, idx, sink, 0.3), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(atb_ops.sparse_attention(q[:1], kv, idx[:1], sink, 0.3, ex, exi[:1]),
                                   ref["sparse_attention"](q[:1], kv, idx[:1], sink, 0.3, ex, exi[:1]), rtol=1e-5, atol=1e-6)
        assert atb_ops.sparse_attention(q[:0], kv, idx[:0], sink, 0.3, ex, exi[:0]).shape == (0, 3, 16)
        assert torch.equal(atb_ops.sparse_attention(q, kv, idx[:, :0], sink, 0.3), torch.zeros(4, 3, 16))


def test_sparse_attention_paged_pool_across_page_boundaries():
    # a paged window pool of 16-row pages; each token's rows are positions max(0, p-31)..p mapped through its block
    # table, so the selections cross page boundaries and pages are not contiguous
    bs, W = 16, 32
    pages = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]])
    pool = torch.randn(8 * bs, 32, generator=_g(14))
    q = torch.randn(4, 2, 32, generator=_g(15))
    seq_of, pos = torch.tensor([0, 0, 1, 1]), torch.tensor([17, 40, 31, 63])
    idx = torch.full((4, W), -1, dtype=torch.int64)
    for t in range(4):
        p = torch.arange(max(0, int(pos[t]) - W + 1), int(pos[t]) + 1)
        idx[t, : len(p)] = pages[seq_of[t], p // bs] * bs + p % bs
    sink = torch.randn(2, generator=_g(16))
    launch = run_mla(q, None, pool, idx, None, None, sink, 0.17, force_nb=8)
    torch.testing.assert_close(_ub_ok(launch), ref["sparse_attention"](q, pool, idx, sink, 0.17), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_matches_reference(dtype):
    g = _g(17)
    T, H, C, R, P, L = 3, 6, 64, 16, 90, 75
    qn, qp = torch.randn(T, H, C, generator=g).to(dtype), torch.randn(T, H, R, generator=g).to(dtype)
    lat = torch.randn(P, C + R, generator=g).to(dtype)
    idx = torch.randint(0, P, (T, L), generator=g)
    idx[torch.rand(T, L, generator=g) < 0.2] = -1
    idx[2] = -1  # a token with no valid index returns 0
    with atb_ops.use_backend("ascendc_emu"):
        out = atb_ops.mla_decode(qn, qp, lat, idx, 0.11)
        assert atb_ops.mla_decode(qn[:0], qp[:0], lat, idx[:0], 0.1).shape == (0, H, C)
        assert torch.equal(atb_ops.mla_decode(qn, qp, lat, idx[:, :0], 0.1), torch.zeros(T, H, C, dtype=dtype))
        with pytest.raises(ValueError, match="C \\+ R"):
            atb_ops.mla_decode(qn, qp, lat[:, :-1], idx, 0.1)
        with pytest.raises(IndexError, match="out of range"):
            atb_ops.mla_decode(qn, qp, lat, idx + P, 0.1)
    exp = ref["mla_decode"](qn, qp, lat, idx, 0.11)
    assert out.dtype == dtype and torch.equal(out[2].float(), torch.zeros(H, C))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out.float(), exp.float(), **tol)


def test_production_shapes_v3_and_v4_flash():
    g = _g(18)
    # DeepSeek-V3 absorbed MLA: 128 heads x (512 + 64), bf16 latent pool
    qn, qp = torch.randn(1, 128, 512, generator=g), torch.randn(1, 128, 64, generator=g)
    lat = torch.randn(200, 576, generator=g).bfloat16()
    idx = torch.arange(200).view(1, 200)
    launch = run_mla(qn, qp, lat, idx, None, None, None, 576 ** -0.5)
    assert launch.tiling.headGroup == 2 and launch.tiling.blockDim == 48  # 64 (token, head-group) items over 48 cores
    torch.testing.assert_close(_ub_ok(launch), ref["mla_decode"](qn, qp, lat, idx, 576 ** -0.5), rtol=1e-5, atol=1e-6)
    # DeepSeek-V4-Flash: 64 heads x 512, window 128 + 64 compressed entries, sink
    q, kv, idx, sink, ex, exi = _sa_inputs(19, 2, 64, 512, 160, 128, 80, 64, pad=0.1)
    launch = run_mla(q, None, kv, idx, ex, exi, sink, 512 ** -0.5)
    assert launch.tiling.headGroup == 2
    torch.testing.assert_close(_ub_ok(launch), ref["sparse_attention"](q, kv, idx, sink, 512 ** -0.5, ex, exi),
                               rtol=1e-5, atol=1e-6)


def test_mla_tiling_fits_the_ub_at_every_production_shape():
    for soc in runner.SOCS:
        for T in (1, 4, 16, 64, 256):
            for H, C, R in ((128, 512, 64), (64, 512, 0), (128, 512, 0)):
                for qd in (torch.float32, torch.bfloat16):
                    t = runner.mla_tiling(T, H, C, R, 2048, 512, 10 ** 6, 10 ** 5, R == 0, 0.04, qd, qd, soc=soc)
                    assert t.ubBytes <= t.socUb and t.blockRows >= 8
                    assert t.numItems == T * t.numGroups
                    assert t.blockDim == min(t.numItems, 40 if soc == "ascend910b4" else 48)
    big = runner.mla_tiling(256, 128, 512, 64, 2048, 0, 10 ** 6, 0, False, 0.04, torch.float32, torch.float32, soc="ascend910c")
    assert big.headGroup == 16 and big.blockRows >= 8


@pytest.mark.parametrize("which,message", [
    (0, "not a multiple of 32"), (1, "not 32-byte aligned"), (2, "buffers of the queue are in use"),
    (3, "beyond size"), (4, "GM address that is not 32-byte aligned"), (5, None), (6, "empty queue"),
    (7, "unified buffer overflow"),
])
def test_emulation_checks_fire(which, message):
    got = runner.selftest(which)
    if message is None:
        assert got is None  # DataCopyPad moves unaligned lengths from unaligned GM addresses legally
    else:
        assert got is not None and message in got


@pytest.mark.parametrize("c,rope,overlap,dtype", [(512, 64, True, torch.float32), (128, 64, True, torch.bfloat16),
                                                   (48, 16, False, torch.float32), (24, 0, False, torch.float32)])
def test_compressor_fused_rmsnorm_rope_epilogue(c, rope, overlap, dtype):
    from atb_ops.ascendc.emu.backend import compressor_pool_norm_rope

    r = 4 if overlap else 8
    seq = [13, 9] if overlap else [17, 8]
    S = sum(seq)
    kv = torch.randn(S, (2 if overlap else 1) * c, generator=_g(c)).to(dtype)
    sc = (2 * torch.randn(S, kv.shape[1], generator=_g(c + 1))).to(dtype)
    cand = _overlap_cand(seq, r) if overlap else _plain_cand(seq, r)
    w = 1 + 0.1 * torch.randn(c, generator=_g(2))
    pos = torch.arange(len(cand)) * r + 7
    inv_freq = atb_ops.rope_inv_freq(rope, 160000.0, 4.0, 1024, 32.0, 1.0) if rope else torch.empty(0)
    got = compressor_pool_norm_rope(kv, sc, cand, overlap, w, 1e-6, pos, inv_freq)
    e = ref["compressor_pool"](kv, sc, cand, overlap)
    e = atb_ops.implementations("rms_norm")["reference"](e, w, 1e-6)
    if rope:
        e = atb_ops.implementations("apply_rope")["reference"](e, pos, inv_freq)
    torch.testing.assert_close(got, e, rtol=1e-5, atol=1e-5)


def test_compressor_epilogue_rejects_a_misaligned_rope_slice():
    with pytest.raises(EmuKernelError, match="multiple of 8"):
        runner.compressor_tiling(4, 8, 64, 2 * 20, True, torch.float32, rope_dim=6, eps=1e-6)


# ---- the cube (Matmul API) variant of the attention kernel -------------------------------------------------------

@pytest.mark.parametrize("hg,nb", [(0, 0), (1, 16), (3, 16), (16, 32), (20, 128)])
def test_cube_attention_every_head_and_row_tiling(hg, nb):
    q, kv, idx, sink, ex, exi = _sa_inputs(21, 3, 20, 48, 97, 150, 33, 70)
    launch = run_mla(q, None, kv, idx, ex, exi, sink, 0.2, cube=True, force_hg=hg, force_nb=nb)
    torch.testing.assert_close(_ub_ok(launch), ref["sparse_attention"](q, kv, idx, sink, 0.2, ex, exi), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qd,kvd", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_cube_mla_decode_dtypes_and_edges(qd, kvd):
    g = _g(22)
    T, H, C, R, P, L = 4, 6, 64, 16, 90, 75
    qn, qp = torch.randn(T, H, C, generator=g).to(qd), torch.randn(T, H, R, generator=g).to(qd)
    lat = torch.randn(P, C + R, generator=g).to(kvd)
    idx = torch.randint(0, P, (T, L), generator=g)
    idx[torch.rand(T, L, generator=g) < 0.2] = -1
    idx[2] = -1   # no valid index: 0
    idx[3, 1:] = -1  # exactly one row
    launch = run_mla(qn, qp, lat, idx, None, None, None, 0.11, cube=True)
    out, exp = _ub_ok(launch), ref["mla_decode"](qn, qp, lat, idx, 0.11)
    assert out.dtype == qd and torch.equal(out[2].float(), torch.zeros(H, C))
    # bf16 cube inputs: P is rounded to bf16 before PV (the reference keeps it in float32)
    tol = dict(rtol=1e-5, atol=1e-6) if torch.float32 in (qd, kvd) and qd != kvd or qd == kvd == torch.float32 \
        else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(out.float(), exp.float(), **tol)


def test_cube_production_shapes_and_backend_selection(monkeypatch):
    from atb_ops.ascendc.emu import backend

    g = _g(23)
    qn, qp = torch.randn(1, 128, 512, generator=g), torch.randn(1, 128, 64, generator=g)
    lat = torch.randn(100, 576, generator=g).bfloat16()
    idx = torch.arange(100).view(1, 100)
    launch = run_mla(qn, qp, lat, idx, None, None, None, 576 ** -0.5, cube=True)
    assert launch.tiling.headGroup == 16
    torch.testing.assert_close(_ub_ok(launch), ref["mla_decode"](qn, qp, lat, idx, 576 ** -0.5), rtol=1e-5, atol=1e-5)
    for soc in runner.SOCS:
        for T in (1, 16, 256):
            for H, C, R in ((128, 512, 64), (64, 512, 0), (128, 512, 0)):
                for dt in (torch.float32, torch.bfloat16):
                    t = runner.mla_tiling(T, H, C, R, 2048, 512, 10 ** 6, 10 ** 5, R == 0, 0.04, dt, dt, soc=soc, cube=True)
                    assert t.ubBytes <= t.socUb and t.blockRows % 16 == 0 and t.blockRows >= 16
    with pytest.raises(EmuKernelError, match="multiples of 16"):
        runner.mla_tiling(1, 4, 40, 0, 8, 0, 10, 0, True, 1.0, torch.float32, torch.float32, cube=True)
    assert backend.use_cube(128, 0) and not backend.use_cube(40, 0)
    monkeypatch.setenv("ASCEND_DSV4_ASCENDC_MLA", "vector")
    assert not backend.use_cube(128, 0)
    monkeypatch.setenv("ASCEND_DSV4_ASCENDC_MLA", "cube")
    with pytest.raises(ValueError, match="multiples of 16"):
        backend.use_cube(40, 0)
