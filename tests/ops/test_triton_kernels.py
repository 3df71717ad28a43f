"""The CUDA backend's Triton kernels against the reference ops, on random and edge-case inputs.

Without a GPU the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), at small shapes; on a GPU machine the same tests run on the device. Float32 inputs must
match to ~1e-5 relative, bfloat16 inputs to the rounding of bf16 outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from quant.fp4 import quant_fp4  # noqa: E402
from quant.fp8_block import quant_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def impls(op):
    got = atb_ops.implementations(op)
    assert "cuda" in got, f"no cuda kernel registered for {op}"
    return got["cuda"], got["reference"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def tol(dtype):
    return 2e-5 if dtype == torch.float32 else 1e-2


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,with_w", [((5, 96), True), ((2, 3, 64), False), ((1, 4096), True), ((0, 32), True)])
def test_rms_norm(dtype, shape, with_w):
    cu, ref = impls("rms_norm")
    g = gen(0)
    x = rnd(*shape, g=g, dtype=dtype, scale=3.0)
    w = rnd(shape[-1], g=g) if with_w else None
    a, b = cu(x, w, 1e-6), ref(x, w, 1e-6)
    assert a.shape == b.shape and a.dtype == b.dtype
    if x.numel():
        assert rel(a, b) < tol(dtype)
    # a column slice of a wider row (a stacked GEMM's output): read in place, written contiguous
    wide = rnd(*shape[:-1], shape[-1] + 24, g=g, dtype=dtype, scale=3.0)
    a, b = cu(wide[..., 24:], w, 1e-6), ref(wide[..., 24:], w, 1e-6)
    assert a.shape == b.shape and a.is_contiguous()
    if x.numel():
        assert rel(a, b) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope(dtype, inverse):
    cu, ref = impls("apply_rope")
    g = gen(1)
    inv = atb_ops.rope_inv_freq(16, 10000.0, 4.0, 64)
    # (2, 64, 40): few tokens x many rows, split into row blocks of 8 (2 programs per SM of the interpreter's 8)
    for shape in [(6, 3, 40), (7, 16), (1, 5, 16), (2, 64, 40)]:
        x = rnd(*shape, g=g, dtype=dtype)
        pos = torch.randint(0, 5000, (shape[0],), generator=g).to(DEV)
        a, b = cu(x, pos, inv, inverse), ref(x, pos, inv, inverse)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a[..., :-16], x[..., :-16])  # pass-through channels untouched
        # a token alone (other row blocks: 4 rows vs 8 at 2 tokens x 64) rotates bitwise as in the batch
        assert torch.equal(cu(x[:1], pos[:1], inv, inverse), a[:1])
        assert rel(a, b) < (1e-5 if dtype == torch.float32 else 1e-2)
    # inverse undoes forward
    x = rnd(4, 2, 32, g=g)
    pos = torch.arange(4, device=DEV) * 97
    torch.testing.assert_close(cu(cu(x, pos, inv), pos, inv, True), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu(limit):
    cu, ref = impls("swiglu")
    g = gen(2)
    gt, up = rnd(3, 300, g=g, scale=8.0, dtype=torch.bfloat16), rnd(3, 300, g=g, scale=8.0, dtype=torch.bfloat16)
    a, b = cu(gt, up, limit), ref(gt, up, limit)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the two column halves of one stacked GEMM output (row-strided views), a 3-d input and a transposed one
    h = rnd(5, 2 * 1100, g=g, scale=8.0, dtype=torch.bfloat16)
    torch.testing.assert_close(cu(h[:, :1100], h[:, 1100:], limit), ref(h[:, :1100], h[:, 1100:], limit),
                               rtol=1e-5, atol=1e-5)
    x3 = rnd(2, 3, 40, g=g, scale=8.0)
    torch.testing.assert_close(cu(x3, x3.flip(0), limit), ref(x3, x3.flip(0), limit), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cu(gt.t(), up.t(), limit), ref(gt.t(), up.t(), limit), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="swiglu"):
        cu(gt, up[:, :10], limit)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_swiglu_row_scale(out_dtype):
    """atb_ops.swiglu with the MoE routing weight per row and the output dtype: the CUDA kernel takes both (one
    launch); the reference path multiplies and rounds after it (bitwise the experts' former torch ops)."""
    g = gen(3)
    gt, up = rnd(6, 300, g=g, scale=8.0, dtype=torch.bfloat16), rnd(6, 300, g=g, scale=8.0, dtype=torch.bfloat16)
    w = rnd(6, g=g).abs()
    with atb_ops.use_backend("reference"):
        ref = atb_ops.swiglu(gt, up, 10.0, row_scale=w, out_dtype=out_dtype)
        assert torch.equal(ref, (atb_ops.swiglu(gt, up, 10.0) * w.unsqueeze(-1)).to(out_dtype or torch.float32))
        with pytest.raises(ValueError, match="row_scale"):  # the op checks it on every backend
            atb_ops.swiglu(gt, up, 10.0, row_scale=w[:5])
    with atb_ops.use_backend("cuda"):
        got = atb_ops.swiglu(gt, up, 10.0, row_scale=w, out_dtype=out_dtype)
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2 if out_dtype else 1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="row_scale"):
            atb_ops.swiglu(gt, up, 10.0, row_scale=w[:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [128, 64])
def test_fp8_act_round(dtype, block):
    cu, ref = impls("fp8_act_round")
    g = gen(3)
    x = rnd(5, 2 * block, g=g, dtype=dtype, scale=20.0)
    x[0, :block] = 0.0  # all-zero block: amax clamped to 1e-4
    x[1, 3] = 1e6
    assert torch.equal(cu(x, block), ref(x, block))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_act_round(dtype):
    cu, ref = impls("fp4_act_round")
    g = gen(4)
    x = rnd(6, 128, g=g, dtype=dtype, scale=5.0)
    # exact midpoints of the e2m1 grid (ties go to the even code) with a block max of 6 (scale 1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 6.0], dtype=torch.float32)
    x[0, : mids.numel()] = mids.to(DEV, dtype)
    x[0, mids.numel():32] = 0.1
    x[1, :32] = 0.0
    assert torch.equal(cu(x, 32), ref(x, 32))


def _hc_inputs(g, t, n=4, d=64, dtype=torch.float32):
    x = rnd(t, n, d, g=g, dtype=dtype)
    fn = rnd((2 + n) * n, n * d, g=g, scale=0.05)
    base = rnd((2 + n) * n, g=g, scale=0.5)
    scale = rnd(3, g=g).abs() + 0.5
    return x, fn, base, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, d", [(0, 64), (1, 64), (19, 64), (1, 640), (19, 640)])
def test_hc_pre_post_head(dtype, t, d):
    # d = 640: K = 4 x 640 split over 10 (t = 1) or 8 (t = 19) programs, the split sums in one masked load
    g = gen(5)
    x, fn, base, scale = _hc_inputs(g, t, d=d, dtype=dtype)
    cu, ref = impls("hc_pre")
    (u1, p1, c1), (u2, p2, c2) = cu(x, fn, base, scale, 20, 1e-6, 1e-6), ref(x, fn, base, scale, 20, 1e-6, 1e-6)
    assert u1.shape == u2.shape and u1.dtype == u2.dtype and c1.shape == c2.shape
    if t:
        assert rel(u1, u2) < tol(dtype) and rel(p1, p2) < 1e-5 and rel(c1, c2) < 1e-5
    cu, ref = impls("hc_post")
    y = rnd(t, d, g=g, dtype=dtype)
    a, b = cu(y, x, p2, c2), ref(y, x, p2, c2)
    assert a.shape == b.shape and a.dtype == b.dtype
    if t:
        assert rel(a, b) < tol(dtype)
    cu, ref = impls("hc_head")
    fn_h, base_h, scale_h = fn[:4], base[:4], scale[:1]
    a, b = cu(x, fn_h, base_h, scale_h, 1e-6, 1e-6), ref(x, fn_h, base_h, scale_h, 1e-6, 1e-6)
    assert a.shape == b.shape
    if t:
        assert rel(a, b) < tol(dtype)


@pytest.mark.parametrize("overlap", [False, True])
def test_compressor_pool(overlap):
    cu, ref = impls("compressor_pool")
    g = gen(6)
    r, c, s = 4, 48, 40
    width = 2 * c if overlap else c
    kv, sc = rnd(s, width, g=g), rnd(s, width, g=g, scale=2.0)
    k = 2 * r if overlap else r
    cand = torch.randint(0, s, (7, k), generator=g)
    if overlap:
        cand[0, :r] = -1  # entry 0: no previous block
    cand[3, 1] = -1
    cand = cand.to(DEV)
    a, b = cu(kv, sc, cand, overlap), ref(kv, sc, cand, overlap)
    assert a.shape == b.shape and a.dtype == torch.float32
    assert rel(a, b) < 1e-5
    assert cu(kv, sc, cand[:0], overlap).shape == (0, c)


@pytest.mark.parametrize("t, width, ratio", [(0, 40, 4), (1, 40, 4), (19, 96, 4), (5, 1100, 128)])
def test_compressor_state_write(t, width, ratio):
    """The CUDA state write equals the reference bitwise: rows copied / ape added at each token's slot (distinct,
    unordered), a and z the strided halves of one stacked GEMM output, every other pool row untouched; W = 1100
    spans two column blocks of the kernel, positions run past many multiples of the ratio."""
    cu, ref = impls("compressor_state_write")
    g = gen(7)
    s = 3 * t + 5
    az = rnd(t, 2 * width, g=g)
    a, z = az[:, :width], az[:, width:]
    ape = rnd(ratio, width, g=g)
    pos = torch.randint(0, 10_000, (t,), generator=g).to(DEV)
    slots = torch.randperm(s, generator=g)[:t].to(DEV)
    pools = [rnd(s, width, g=g) for _ in range(2)]
    got, want = [p.clone() for p in pools], [p.clone() for p in pools]
    assert cu(*got, a, z, ape, pos, slots) is None
    ref(*want, a, z, ape, pos, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    others = torch.ones(s, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(got[0].cpu()[others], pools[0].cpu()[others])
    if t:
        phase = (pos % ratio).cpu()
        assert torch.equal(want[1].cpu()[slots.cpu()], (z + ape[phase.to(DEV)]).cpu())
        assert torch.equal(want[0].cpu()[slots.cpu()], a.cpu())


def test_compressor_state_write_checks_shapes():
    kv, sc = torch.zeros(8, 16), torch.zeros(8, 16)
    a = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="compressor_state_write: a"):
        atb_ops.compressor_state_write(kv, sc, a, torch.zeros(3, 15), torch.zeros(4, 16), torch.zeros(3).long(),
                                       torch.arange(3))
    with pytest.raises(ValueError, match=r"ape \(4, 8\)"):
        atb_ops.compressor_state_write(kv, sc, a, a, torch.zeros(4, 8), torch.zeros(3).long(), torch.arange(3))


def _indexer_inputs(g, t, n, p=50, hi=4, di=32, dtype=torch.float32, integer=False):
    if integer:  # small integers: exact float32 scores with many exact ties
        q = torch.randint(-2, 3, (t, hi, di), generator=g).to(DEV, dtype)
        keys = torch.randint(-2, 3, (p, di), generator=g).to(DEV, dtype)
        w = torch.randint(-2, 3, (t, hi), generator=g).float().to(DEV)
    else:
        q, keys, w = rnd(t, hi, di, g=g, dtype=dtype), rnd(p, di, g=g, dtype=dtype), rnd(t, hi, g=g)
    cand = torch.randint(0, p, (t, n), generator=g)
    cand[torch.rand(t, n, generator=g) < 0.2] = -1
    return q, w, keys, cand.to(DEV)


@pytest.mark.parametrize("swap", ["1", "0"])  # the score product as keys @ q^T (default) or q @ keys^T
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("t,n,topk", [(5, 70, 16), (3, 9, 16), (1, 1, 4), (0, 5, 3)])
def test_indexer_topk(integer, t, n, topk, swap, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_INDEXER_SWAP", swap)
    cu, ref = impls("indexer_topk")
    q, w, keys, cand = _indexer_inputs(gen(7), t, n, integer=integer)
    if t > 1:
        cand[1] = -1  # a token with no candidate
    a, b = cu(q, w, keys, cand, topk), ref(q, w, keys, cand, topk)
    assert a.shape == b.shape and a.dtype == torch.int64
    assert torch.equal(a.cpu(), b.cpu())



def test_indexer_swap_switch_names_its_values(monkeypatch):
    from atb_ops.cuda import indexer as ix

    monkeypatch.setenv("ATB_CUDA_INDEXER_SWAP", "yes")
    with pytest.raises(ValueError, match="ATB_CUDA_INDEXER_SWAP='yes'"):
        ix.score_swap()


def _prefix_cand(t, n, p, g, lens=None):
    """Decode-shaped candidates: token i sees a contiguous run of rows, -1 padding last."""
    cand = torch.full((t, n), -1, dtype=torch.int64)
    for i in range(t):
        ln = int(lens[i]) if lens is not None else int(torch.randint(0, n + 1, (1,), generator=g))
        start = int(torch.randint(0, max(1, p - ln + 1), (1,), generator=g))
        cand[i, :ln] = torch.arange(start, start + ln)
    return cand.to(DEV)


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("t,n,topk,p", [(1, 33, 8, 40), (7, 45, 16, 60), (2, 20, 32, 25), (9, 17, 17, 30)])
def test_indexer_topk_prefix_candidates(integer, t, n, topk, p):
    # N not a multiple of the tile, N < topk (width N), N == topk, T = 1 and several tokens, -1 padding last
    cu, ref = impls("indexer_topk")
    g = gen(31)
    q, w, keys, _ = _indexer_inputs(g, t, 1, p=p, hi=3, di=16, integer=integer)
    lens = torch.randint(0, n + 1, (t,), generator=g)
    lens[0] = n  # a full row
    if t > 2:
        lens[1] = 0  # nothing visible yet
        lens[2] = 1
    cand = _prefix_cand(t, n, p, g, lens)
    a, b = cu(q, w, keys, cand, topk), ref(q, w, keys, cand, topk)
    assert a.shape == b.shape == (t, min(topk, n))
    assert torch.equal(a.cpu(), b.cpu())


def test_indexer_topk_all_ties_and_mixed_dtypes():
    cu, ref = impls("indexer_topk")
    g = gen(32)
    t, n, p = 3, 40, 50
    q = torch.zeros(t, 2, 16, device=DEV)  # every score 0: the selection is the first topk candidates
    keys = rnd(p, 16, g=g)
    w = rnd(t, 2, g=g)
    cand = torch.randint(0, p, (t, n), generator=g)
    cand[1, 25:] = -1
    cand = cand.to(DEV)
    a, b = cu(q, w, keys, cand, 30), ref(q, w, keys, cand, 30)
    assert torch.equal(a.cpu(), b.cpu())
    assert torch.equal(a[0].cpu(), cand[0, :30].cpu())
    # float32 queries against bf16 keys: float32 products (as the reference)
    q32, _, kb, _ = _indexer_inputs(g, t, 1, p=p, hi=2, di=16, integer=True)
    kb = kb.to(torch.bfloat16)
    q32 = q32 + 0.125
    a, b = cu(q32, w, kb, cand, 7), ref(q32, w, kb, cand, 7)
    assert torch.equal(a.cpu(), b.cpu())


def test_indexer_topk_negative_weights_and_minus_zero():
    # negative weights give negative scores; exact zeros from ReLU (and -0.0 from negative weights) are one tie
    cu, ref = impls("indexer_topk")
    g = gen(33)
    q, w, keys, cand = _indexer_inputs(g, 4, 24, p=30, hi=2, di=8, integer=True)
    w = -w.abs()
    a, b = cu(q, w, keys, cand, 12), ref(q, w, keys, cand, 12)
    assert torch.equal(a.cpu(), b.cpu())



def test_indexer_topk_long_rows_through_torch_topk(monkeypatch):
    # rows longer than the one-program selection (256 under the interpreter, 16384 on a GPU): the bits path's
    # torch.topk route (auto picks another path at this N)
    monkeypatch.setenv("ATB_CUDA_INDEXER", "bits")
    cu, ref = impls("indexer_topk")
    g = gen(38)
    for integer in (True, False):
        q, w, keys, cand = _indexer_inputs(g, 3, 300, p=400, hi=2, di=16, integer=integer)
        cand[1] = -1
        cand[2, 250:] = -1
        a, b = cu(q, w, keys, cand, 280), ref(q, w, keys, cand, 280)
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("cfg", ["128,4,3,1,1", "64,4,2,1,0", "32,4,1,2,1"])
def test_indexer_topk_score_variants(monkeypatch, cfg):
    # score-kernel variants (ATB_CUDA_INDEXER="BN,WARPS,STAGES,CTAS_PER_SM,PRE"; the interpreter keeps BN=16):
    # several blocks per program, with and without the register prefetch loop, a ragged last program
    monkeypatch.setenv("ATB_CUDA_INDEXER", cfg)
    cu, ref = impls("indexer_topk")
    g = gen(37)
    q, w, keys, _ = _indexer_inputs(g, 2, 1, p=200, hi=3, di=16, integer=True)
    cand = _prefix_cand(2, 150, 200, g, torch.tensor([150, 97]))
    a, b = cu(q, w, keys, cand, 40), ref(q, w, keys, cand, 40)
    assert torch.equal(a.cpu(), b.cpu())

@pytest.mark.parametrize("t,n,k", [(3, 40, 9), (2, 300, 37), (1, 600, 64), (4, 257, 256)])
def test_indexer_select_matches_stable_sort(t, n, k):
    # the selection kernel alone on int32 order keys with many duplicates (n > 256: the multi-chunk path of the
    # interpreter's 256-key chunks), against a stable descending sort
    from atb_ops.cuda.indexer import ORD_NEG_INF_INT as ORD_NEG_INF, select_topk

    g = gen(34 + n)
    keys = torch.randint(-6, 6, (t, n), generator=g, dtype=torch.int32) * 1000003
    keys[torch.rand(t, n, generator=g) < 0.15] = ORD_NEG_INF
    keys[0, :3] = 2**31 - 1
    keys[-1, -5:] = -2**31 + 1  # smallest order keys above the padding value
    cand = torch.randperm(10 * n, generator=g)[: t * n].view(t, n)
    order = torch.sort(keys.long(), dim=1, descending=True, stable=True).indices[:, :k]
    want = cand.gather(1, order)
    want = torch.where(keys.long().gather(1, order) == ORD_NEG_INF, torch.full_like(want, -1), want)
    got = select_topk(keys.to(DEV), cand.to(DEV), k)
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("t,n,topk", [(1, 2048, 512), (32, 2048, 512), (32, 16384, 512), (3, 40000, 512),
                                      (5, 300, 512), (64, 8192, 512)])
def test_indexer_topk_real_shapes(t, n, topk):
    # 64 heads x 128 dims, bf16; integer-valued inputs make every score exact (ties included), so the
    # selection must equal the reference's bit for bit
    cu, ref = impls("indexer_topk")
    g = gen(35)
    p = t * n
    q = torch.randint(-2, 3, (t, 64, 128), generator=g).to(DEV, torch.bfloat16)
    keys = torch.randint(-2, 3, (p, 128), generator=g).to(DEV, torch.bfloat16)
    w = torch.randint(-3, 4, (t, 64), generator=g).float().to(DEV)
    cand = _prefix_cand(t, n, p, g)
    cand[0, : n // 2] = torch.randperm(p, generator=g)[: n // 2].to(DEV)  # a gathered, scattered row
    a, b = cu(q, w, keys, cand, topk), ref(q, w, keys, cand, topk)
    assert torch.equal(a, b)
    # random bf16 inputs: the scores differ from the reference's only by summation order
    q, keys, w = rnd(t, 64, 128, g=g, dtype=torch.bfloat16), rnd(p, 128, g=g, dtype=torch.bfloat16), rnd(t, 64, g=g)
    a, b = cu(q, w, keys, cand, topk), ref(q, w, keys, cand, topk)
    assert (a == b).float().mean() > 0.99
    for i in range(t):
        assert set(a[i].tolist()) == set(b[i].tolist()) or len(set(a[i].tolist()) ^ set(b[i].tolist())) <= 4


@pytest.mark.cuda
def test_indexer_topk_graph_capture():
    cu, ref = impls("indexer_topk")
    g = gen(36)
    q, w, keys, cand = _indexer_inputs(g, 8, 3000, p=5000, hi=64, di=128, dtype=torch.bfloat16, integer=True)
    want = ref(q, w, keys, cand, 512)
    cu(q, w, keys, cand, 512)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cu(q, w, keys, cand, 512)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)

def _attn_inputs(g, t, h, d, p, k, dtype, neg=0.3):
    q, kv = rnd(t, h, d, g=g, dtype=dtype), rnd(p, d, g=g, dtype=dtype)
    idx = torch.randint(0, p, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < neg] = -1
    return q, kv, idx.to(DEV), rnd(h, g=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,d,k,k2", [(4, 3, 64, 37, 0), (2, 20, 32, 70, 9), (1, 4, 64, 5, 100), (3, 2, 16, 0, 0)])
def test_sparse_attention(dtype, t, h, d, k, k2):
    cu, ref = impls("sparse_attention")
    g = gen(8)
    q, kv, idx, sink = _attn_inputs(g, t, h, d, 30, k, dtype)
    kv[0] = float("nan")  # what a -1 slot would read if it were clamped: must not leak
    idx[idx == 0] = 1
    extra_kv = extra_idx = None
    if k2:
        extra_kv = rnd(25, d, g=g, dtype=dtype)
        extra_idx = torch.randint(0, 25, (t, k2), generator=g)
        extra_idx[:, ::3] = -1
        extra_idx = extra_idx.to(DEV)
    if t > 1 and k:
        idx[1] = -1  # main set empty for one token
    a = cu(q, kv, idx, sink, d**-0.5, extra_kv, extra_idx)
    b = ref(q, kv, idx, sink, d**-0.5, extra_kv, extra_idx)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert rel(a, b) < (2e-5 if dtype == torch.float32 else 2e-2)


# the two sparse-attention kernels (attention.py "old", attention_v2.py "new") and forced v2 tiles
# "BH,BN,ND,WARPS,STAGES,TRIM": both column groups (ND = 2), one group, key-list splits (CPU: 8 "SMs"),
# trimming of all-absent leading / trailing chunks (TRIM = 1; applies where the key list is not split);
# "new64": the v2 kernel with 64-bit row addresses (ATB_CUDA_ATTN_OFF32=0; the default takes int32 offsets)
ATTN_IMPLS = [("old", None), ("new", None), ("new", "16,16,2,4,3,1"), ("new", "32,16,1,4,5,0"), ("new", "16,32,2,4,3,1"),
              ("new", "16,16,1,4,2,1"), ("new64", None), ("new64", "16,16,2,4,3,1")]


def _attn_env(monkeypatch, impl, cfg):
    monkeypatch.setenv("ATB_CUDA_ATTN_OFF32", "0" if impl == "new64" else "auto")
    impl = "new" if impl == "new64" else impl
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", impl)
    if cfg:
        monkeypatch.setenv("ATB_CUDA_ATTN2", cfg)
    else:
        monkeypatch.delenv("ATB_CUDA_ATTN2", raising=False)


def test_attention_tile_override_refuses_column_groups_beyond_two(monkeypatch):
    """The v2 kernel's score covers its own and one other column group: ND = 4 would drop half the dot product
    (measured on the H100: relative error 0.6, scripts/bench_results/decode_h100_session8.txt) and is refused."""
    from atb_ops.cuda.attention_v2 import tile

    monkeypatch.setenv("ATB_CUDA_ATTN2", "64,16,4,4,3,-1,2")
    with pytest.raises(ValueError, match="ATB_CUDA_ATTN2.*ND .* must be 1 or 2"):
        tile(64, 512, 0, 2, 32, 640, 132)
    monkeypatch.setenv("ATB_CUDA_ATTN2", "64,16,2,4,3,-1,2")
    assert tile(64, 512, 0, 2, 32, 640, 132) == (64, 16, 2, 4, 3, -1, 2)


def test_attention_offset_knob_is_checked(monkeypatch):
    cu, _ = impls("sparse_attention")
    g = gen(3)
    q, kv, idx, sink = _attn_inputs(g, 2, 4, 32, 30, 8, torch.bfloat16)
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", "new")
    monkeypatch.setenv("ATB_CUDA_ATTN_OFF32", "yes")
    with pytest.raises(ValueError, match="ATB_CUDA_ATTN_OFF32='yes': expected auto, 0 or 1"):
        cu(q, kv, idx, sink, 0.1)


@pytest.mark.parametrize("var,bad", [("ATB_CUDA_ATTN_IMPL", "wgma"), ("ATB_CUDA_GEMM", "fp4"),
                                     ("ATB_CUDA_FP4", "splt"), ("ATB_CUDA_FP4_MOE", "f32")])
def test_path_switches_refuse_unknown_values(monkeypatch, var, bad):
    """A typo in a kernel-path switch is a ValueError naming the variable and its values, not another kernel."""
    from atb_ops.cuda import _util, attention, gemm

    monkeypatch.setenv(var, bad)
    read = {"ATB_CUDA_ATTN_IMPL": attention._impl, "ATB_CUDA_GEMM": gemm._mode, "ATB_CUDA_FP4": gemm._fp4_split,
            "ATB_CUDA_FP4_MOE": lambda: _util.env_choice(var, "mma", gemm.FP4_MOE_IMPLS)}[var]
    with pytest.raises(ValueError, match=f"{var}='{bad}': expected one of"):
        read()
    if var == "ATB_CUDA_ATTN_IMPL":  # through the op as well
        cu, _ = impls("sparse_attention")
        q, kv, idx, sink = _attn_inputs(gen(3), 2, 4, 32, 30, 8, torch.float32)
        with pytest.raises(ValueError, match="ATB_CUDA_ATTN_IMPL"):
            cu(q, kv, idx, sink, 0.1)
    monkeypatch.setenv(var, "")  # empty = the default
    read()


def test_attention_default_tiles(monkeypatch):
    """The measured defaults (attention_v2.tile): key-list splits for a few tokens; 64 heads x 64-key chunks in 2
    stages for prefill (every head count), h = 64 decode and V3's MLA decode; h = 128 decode keeps 128 heads x
    32-key chunks; head shards below 64 keep 32-key chunks in decode."""
    from atb_ops.cuda.attention_v2 import tile

    monkeypatch.delenv("ATB_CUDA_ATTN2", raising=False)
    assert tile(64, 512, 0, 2, 8, 640, 132) == (64, 32, 2, 4, 5, -1, 1)  # split (flash-decoding)
    assert tile(64, 512, 0, 2, 128, 640, 132) == (64, 64, 1, 8, 2, -1, 1)
    assert tile(64, 512, 0, 2, 2048, 640, 132) == (64, 64, 1, 8, 2, -1, 1)
    assert tile(128, 512, 0, 2, 2048, 640, 132) == (64, 64, 1, 8, 2, -1, 1)
    assert tile(128, 512, 0, 2, 128, 640, 132) == (128, 32, 2, 8, 5, -1, 1)
    assert tile(128, 512, 64, 2, 32, 4096, 132) == (64, 64, 1, 8, 2, -1, 1)  # V3 MLA decode
    assert tile(16, 512, 0, 2, 128, 640, 132) == (16, 32, 1, 8, 5, -1, 1)
    assert tile(16, 512, 0, 2, 2048, 640, 132) == (16, 64, 1, 8, 2, -1, 1)


@pytest.mark.parametrize("impl,cfg", ATTN_IMPLS)
@pytest.mark.parametrize("t,h,d,k,k2,with_sink", [(5, 3, 80, 21, 19, True), (2, 17, 48, 40, 0, True),
                                                   (3, 2, 16, 0, 7, False), (6, 5, 64, 33, 40, False),
                                                   (2, 4, 256, 40, 30, True), (4, 16, 64, 33, 20, True)])
def test_sparse_attention_impls(monkeypatch, impl, cfg, t, h, d, k, k2, with_sink):
    """Both kernels and their tilings: odd head counts, d not a power of 2, -1 holes, a token whose keys are
    all -1 (sink only: 0 output), an empty main set, a sink of ~0 weight; 16 heads x 64 columns fill the v2
    kernel's tile exactly (its unmasked q load and output store)."""
    _attn_env(monkeypatch, impl, cfg)
    cu, ref = impls("sparse_attention")
    g = gen(81)
    dtype = torch.bfloat16
    q, kv, idx, sink = _attn_inputs(g, t, h, d, 30, k, dtype)
    kv[0] = float("nan")
    idx[idx == 0] = 1
    extra_kv = extra_idx = None
    if k2:
        extra_kv = rnd(25, d, g=g, dtype=dtype)
        extra_kv[0] = float("nan")
        extra_idx = torch.randint(1, 25, (t, k2), generator=g)
        extra_idx[:, ::3] = -1
        extra_idx[-1] = -1
        extra_idx = extra_idx.to(DEV)
    if k:
        idx[-1] = -1  # the last token: no valid key at all when k2 == 0 or its extra keys are all -1
    sink_arg = sink if with_sink else torch.full((h,), -30.0, device=DEV)  # a sink of ~0 weight
    a = cu(q, kv, idx, sink_arg, d**-0.5, extra_kv, extra_idx)
    b = ref(q, kv, idx, sink_arg, d**-0.5, extra_kv, extra_idx)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert rel(a, b) < 2e-2
    assert float(a[-1].float().abs().max()) == 0.0
    assert cu(q[:0], kv, idx[:0], sink_arg, 0.5, extra_kv, None if extra_idx is None else extra_idx[:0]).shape == (0, h, d)


def test_skinny_policy_knob(monkeypatch):
    from atb_ops.cuda import _skinny

    assert _skinny._split_policy() == (4, 2, "tf32x3")
    monkeypatch.setenv("ATB_CUDA_SKINNY", "iters=2,f32=ieee")
    assert _skinny._split_policy() == (2, 2, "ieee")
    for bad in ("f32=tf32", "iters=0", "per_sm=x", "stages=3"):
        monkeypatch.setenv("ATB_CUDA_SKINNY", bad)
        with pytest.raises(ValueError, match="ATB_CUDA_SKINNY"):
            _skinny._split_policy()


@pytest.mark.parametrize("f32", ["ieee", "tf32x3"])
def test_skinny_float32_paths(monkeypatch, f32):
    """Float32 operands: FMA products (ieee) or three TF32 passes (the default): both within 1e-5 of float64."""
    from atb_ops.cuda import _skinny

    monkeypatch.setenv("ATB_CUDA_SKINNY", f"f32={f32}")
    g = gen(91)
    x, w = rnd(5, 3000, g=g), rnd(24, 3000, g=g)
    out, ss = _skinny.skinny_matmul(x, w, want_ss=True)
    want = x.double() @ w.double().t()
    assert rel(out[:, :24], want) < 1e-5 and float(out[:, 24:].abs().max()) == 0.0
    assert rel(ss, (x.double() ** 2).sum(1)) < 1e-5


@pytest.mark.parametrize("merge", ["kernel", "launch"])
@pytest.mark.parametrize("t,h,k,k2", [(3, 5, 70, 33), (1, 2, 96, 0), (4, 3, 40, 64)])
def test_sparse_attention_split_merge(monkeypatch, merge, t, h, k, k2):
    """Key-list splits (flash-decoding) merged by the split that arrives last or by the combine launch: both match
    the reference (a sink, -1 holes, two pools), and the arrival counters are zero again after every call."""
    from atb_ops.cuda import attention_v2, gemm_tc
    _attn_env(monkeypatch, "new", "16,16,2,4,3,0,4")  # 16-key chunks, up to 4 programs per "SM": several splits
    monkeypatch.setenv("ATB_CUDA_ATTN_MERGE", merge)
    cu, ref = impls("sparse_attention")
    g = gen(87)
    d, dtype = 64, torch.bfloat16
    q, kv, idx, sink = _attn_inputs(g, t, h, d, 50, k, dtype)
    extra_kv = extra_idx = None
    if k2:
        extra_kv = rnd(40, d, g=g, dtype=dtype)
        extra_idx = torch.randint(0, 40, (t, k2), generator=g)
        extra_idx[:, 1::4] = -1
        extra_idx = extra_idx.to(DEV)
    calls = []
    real = attention_v2._merge_splits_kernel
    monkeypatch.setattr(attention_v2, "_merge_splits_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), real[grid])[1]})())
    for _ in range(2):  # a second launch reuses the counters the first left behind
        a = cu(q, kv, idx, sink, d**-0.5, extra_kv, extra_idx)
        assert rel(a, ref(q, kv, idx, sink, d**-0.5, extra_kv, extra_idx)) < 2e-2
    assert bool(calls) == (merge == "launch")
    if merge == "kernel":
        assert int(gemm_tc._counters(q.device).abs().sum()) == 0
    monkeypatch.setenv("ATB_CUDA_ATTN_MERGE", "both")
    with pytest.raises(ValueError, match="ATB_CUDA_ATTN_MERGE"):
        cu(q, kv, idx, sink, d**-0.5, extra_kv, extra_idx)


@pytest.mark.parametrize("impl,cfg", ATTN_IMPLS)
def test_sparse_attention_prefill_pattern(monkeypatch, impl, cfg):
    """One sequence's prefill: sliding-window lists with -1 before position 0, the causal compressed entries
    with a -1 tail (what trimming skips), rows shared by the tokens; float32 to 2e-5."""
    _attn_env(monkeypatch, impl, cfg)
    cu, ref = impls("sparse_attention")
    g = gen(83)
    t, h, d, w, ratio = 48, 4, 32, 40, 1
    q, kv = rnd(t, h, d, g=g), rnd(t, d, g=g)
    pos = torch.arange(t)
    win = pos[:, None] - (w - 1) + torch.arange(w)[None, :]
    win = torch.where(win >= 0, win, -1).to(DEV)
    ent = rnd(t // ratio, d, g=g)
    ex = torch.arange(t // ratio)[None, :].expand(t, -1)
    ex = torch.where(ex < ((pos + 1) // ratio)[:, None], ex, -1).contiguous().to(DEV)
    sink = rnd(h, g=g)
    a, b = cu(q, kv, win, sink, d**-0.5, ent, ex), ref(q, kv, win, sink, d**-0.5, ent, ex)
    assert rel(a, b) < 2e-5


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["old", "new"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (3, 128), (40, 64), (300, 64), (130, 128)])
def test_sparse_attention_model_shapes(monkeypatch, impl, dtype, t, h):
    """The device's real tiles at V4 shapes (d = 512, window 128 + 512 compressed, with -1 holes and a token
    with no valid key): split and unsplit, trimmed (T >= 256) and not, float32 tiles that fit shared memory."""
    _attn_env(monkeypatch, impl, None)
    cu, ref = impls("sparse_attention")
    g = gen(85)
    d = 512
    q, kv, idx, sink = _attn_inputs(g, t, h, d, 700, 128, dtype, neg=0.1)
    ent = rnd(600, d, g=g, dtype=dtype)
    ex = torch.randint(0, 600, (t, 512), generator=g)
    ex[:, 400:] = -1
    ex[-1] = -1
    ex = ex.to(DEV)
    idx[-1] = -1
    a, b = cu(q, kv, idx, sink, d**-0.5, ent, ex), ref(q, kv, idx, sink, d**-0.5, ent, ex)
    assert rel(a, b) < (2e-5 if dtype == torch.float32 else 2e-2)
    assert float(a[-1].float().abs().max()) == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["old", "new"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 32, 200])
def test_mla_decode_model_shapes(monkeypatch, impl, dtype, t):
    """V3 MLA decode at its real shapes (128 heads, C = 512, R = 64) on the device's tiles."""
    _attn_env(monkeypatch, impl, None)
    cu, ref = impls("mla_decode")
    g = gen(87)
    h, c, r, p, length = 128, 512, 64, 3000, 700
    qn, qp = rnd(t, h, c, g=g, dtype=dtype, scale=0.3), rnd(t, h, r, g=g, dtype=dtype, scale=0.3)
    lat = rnd(p, c + r, g=g, dtype=dtype)
    idx = torch.randint(0, p, (t, length), generator=g)
    idx[:, 650:] = -1
    idx = idx.to(DEV)
    a, b = cu(qn, qp, lat, idx, 0.05), ref(qn, qp, lat, idx, 0.05)
    assert rel(a, b) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("impl,cfg", ATTN_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_impls(monkeypatch, impl, cfg, dtype):
    """V3 MLA decode (C + R columns, R scored only) through both kernels; C = 80 is not a power of 2."""
    _attn_env(monkeypatch, impl, cfg)
    cu, ref = impls("mla_decode")
    g = gen(91)
    t, h, c, r, p = 4, 7, 80, 16, 40
    qn, qp = rnd(t, h, c, g=g, dtype=dtype), rnd(t, h, r, g=g, dtype=dtype)
    lat = rnd(p, c + r, g=g, dtype=dtype)
    idx = torch.randint(0, p, (t, 45), generator=g)
    idx[torch.rand(t, 45, generator=g) < 0.3] = -1
    idx[1] = -1
    idx = idx.to(DEV)
    a, b = cu(qn, qp, lat, idx, 0.1), ref(qn, qp, lat, idx, 0.1)
    assert rel(a, b) < (2e-5 if dtype == torch.float32 else 2e-2)
    assert float(a[1].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode(dtype):
    cu, ref = impls("mla_decode")
    g = gen(9)
    t, h, c, r, p = 3, 5, 64, 16, 40
    qn, qp = rnd(t, h, c, g=g, dtype=dtype), rnd(t, h, r, g=g, dtype=dtype)
    lat = rnd(p, c + r, g=g, dtype=dtype)
    idx = torch.randint(0, p, (t, 50), generator=g)
    idx[torch.rand(t, 50, generator=g) < 0.3] = -1
    idx[2] = -1  # no valid key: output 0
    idx = idx.to(DEV)
    a, b = cu(qn, qp, lat, idx, 0.1), ref(qn, qp, lat, idx, 0.1)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert rel(a, b) < (2e-5 if dtype == torch.float32 else 2e-2)
    assert float(a[2].abs().max()) == 0.0


@pytest.mark.parametrize("mode", ["v4", "hash", "v3_groups", "softmax"])
def test_moe_gate(mode):
    cu, ref = impls("moe_gate")
    g = gen(10)
    t, d, e, k = 21, 96, 32, 4
    x, w = rnd(t, d, g=g), rnd(e, d, g=g, scale=0.2)
    bias = rnd(e, g=g, scale=0.1)
    kw = {}
    if mode == "v4":
        args = (x, w, bias, k, 1.5)
    elif mode == "hash":
        tid2eid = torch.randint(0, e, (50, k), generator=g).to(DEV)
        tok = torch.randint(0, 50, (t,), generator=g).to(DEV)
        args = (x, w, None, k, 1.5, tid2eid, tok)
    elif mode == "v3_groups":
        args = (x, w, bias, k, 2.5)
        kw = dict(score_func="sigmoid", n_groups=8, topk_groups=3)
    else:
        args = (x, w, None, k, 1.0)
        kw = dict(score_func="softmax", normalize=False)
    (wa, ia), (wb, ib) = cu(*args, **kw), ref(*args, **kw)
    assert torch.equal(ia.cpu(), ib.cpu())
    torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)
    assert cu(x[:0], w, bias, k, 1.5)[1].shape == (0, k)


def _weights(fmt, n, k, g, e=None):
    lead = () if e is None else (e,)
    w = torch.randn(*lead, n, k, generator=g) * 0.1
    if fmt == "dense":
        return w.to(DEV), None
    if fmt == "fp8_block":
        q, s = quant_fp8_block(w)
        return q.to(DEV), s.to(DEV)
    q, s = quant_fp4(w)
    return q.to(DEV), s.to(DEV)


@pytest.mark.parametrize("path", ["auto", "tiled"])  # bfloat16 decode shapes: gemm_decode.py under "auto"
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["fp8_block", "fp4"])
@pytest.mark.parametrize("m,n,k", [(3, 136, 160), (20, 64, 256), (0, 64, 128)])
def test_linear_quantised(dtype, fmt, m, n, k, path, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_GEMM", path)
    cu, ref = impls("linear")
    g = gen(11)
    w, s = _weights(fmt, n, k, g)
    x = rnd(m, k, g=g, dtype=dtype)
    a, b = cu(x, w, s, fmt), ref(x, w, s, fmt)
    assert a.shape == b.shape and a.dtype == b.dtype
    if m:
        assert rel(a, b) < (2e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("path", ["auto", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "fp4"])
def test_grouped_matmul(dtype, fmt, path, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_GEMM", path)
    cu, ref = impls("grouped_matmul")
    g = gen(12)
    e, n, k = 6, 72, 128
    w, s = _weights(fmt, n, k, g, e=e)
    if fmt == "dense":
        w = w.to(dtype)
    for m in (0, 1, 37):
        x = rnd(m, k, g=g, dtype=dtype)
        ids = torch.randint(0, e, (m,), generator=g)
        if m > 5:
            ids[:20] = 3  # one expert with more rows than a tile
            ids[25:] = e  # id E: no expert here (the capture-safe expert-parallel path), rows of zeros
        ids = ids.to(DEV)
        a, b = cu(x, w, ids, s, fmt), ref(x, w, ids, s, fmt)
        assert a.shape == b.shape and a.dtype == b.dtype
        if m:
            assert rel(a, b) < (2e-5 if dtype == torch.float32 else 1e-2)
        if m > 5:
            assert not a[25:].any() and a[:25].abs().amin(1).gt(0).all()


def test_every_hot_op_has_a_cuda_kernel():
    for op in ("rms_norm", "apply_rope", "hc_pre", "hc_post", "hc_head", "compressor_pool", "indexer_topk",
               "sparse_attention", "moe_gate", "swiglu", "linear", "grouped_matmul", "fp8_act_round",
               "fp4_act_round", "mla_decode"):
        impls(op)


def test_fp4_split_variant(monkeypatch):
    monkeypatch.setenv("ATB_CUDA_FP4", "split")
    monkeypatch.setenv("ATB_CUDA_GEMM", "tiled")  # the split variant is one of the tiled kernel
    cu, ref = impls("grouped_matmul")
    g = gen(13)
    w, s = _weights("fp4", 64, 160, g, e=3)
    x = rnd(9, 160, g=g, dtype=torch.bfloat16)
    ids = torch.randint(0, 3, (9,), generator=g).to(DEV)
    assert rel(cu(x, w, ids, s, "fp4"), ref(x, w, ids, s, "fp4")) < 1e-2


@pytest.mark.parametrize("m", [1, 37, 300])
def test_linear_dense_float32(m):
    """float32 skinny linears (the head, the compressor projections) run in three TF32 passes on the GPU."""
    cu, ref = impls("linear")
    g = gen(14)
    w, x = rnd(200, 96, g=g), rnd(m, 96, g=g)
    a, b = cu(x, w), ref(x, w)
    assert a.dtype == torch.float32 and rel(a, b) < 1e-5


def test_expert_tiles_cover_every_row_once():
    from atb_ops.cuda.gemm import expert_tiles

    g = gen(15)
    for m, e, bm in [(37, 6, 16), (5, 64, 16), (200, 4, 64)]:
        ids = torch.randint(0, e, (m,), generator=g).to(DEV)
        order, te, r0, r1 = expert_tiles(ids, e, bm)
        assert torch.equal(order.cpu(), torch.argsort(ids.cpu(), stable=True))
        seen = torch.cat([order[a:b] for a, b in zip(r0.tolist(), r1.tolist())]).cpu()
        assert sorted(seen.tolist()) == list(range(m))
        for ex, a, b in zip(te.tolist(), r0.tolist(), r1.tolist()):
            assert b - a <= bm and bool((ids[order[a:b]] == ex).all())


def test_linear_leading_dims():
    cu, ref = impls("linear")
    g = gen(16)
    w, x = rnd(40, 32, g=g), rnd(2, 3, 32, g=g)
    a, b = cu(x, w), ref(x, w)
    assert a.shape == (2, 3, 40) and rel(a, b) < 1e-5
    w8, s8 = _weights("fp8_block", 40, 128, g)
    x8 = rnd(2, 5, 128, g=g)
    assert rel(cu(x8, w8, s8, "fp8_block"), ref(x8, w8, s8, "fp8_block")) < 1e-5
