"""Every NPU-backend op against the reference op, through the torch_npu CPU emulation, on random and edge-case
inputs (empty batch, one token, ragged candidate lists, -1 indices, non-contiguous pool rows, lengths that are
not a multiple of the compression ratio). Every torch_npu call is also replayed on the wheel's contracts."""

import pytest
import torch

import atb_ops
from atb_ops._dispatch import _registry

g = torch.Generator().manual_seed(1)
TOL = 1e-4


def rnd(*s, dtype=torch.float32):
    return torch.randn(*s, generator=g).to(dtype)


def ref(op):
    return _registry["reference"][op]


def npu(op, *args):
    with atb_ops.use_backend("npu"):
        return getattr(atb_ops, op)(*args)


def close(a, b, tol=TOL):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.numel() == 0:
        return
    den = max(float(b.float().abs().max()), 1e-6)
    assert float((a.float() - b.float()).abs().max()) / den <= tol


@pytest.fixture(autouse=True)
def _contracts(checker):
    yield
    assert not checker.violations, checker.violations


def ragged_idx(t, k, p, frac_pad=0.3):
    """[T, K] rows of a P-row pool, non-contiguous, with -1 scattered (not only at the end)."""
    idx = torch.randint(0, p, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < frac_pad] = -1
    return idx


def test_table_has_no_hot_path_fallback(emu):
    from atb_ops.npu import optable

    optable.reset()
    assert optable.hot_path_fallbacks() == []


@pytest.mark.parametrize("shape", [(0, 16), (1, 16), (5, 3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(shape, dtype):
    x, w = rnd(*shape, dtype=dtype), rnd(16)
    close(npu("rms_norm", x, w, 1e-6), ref("rms_norm")(x, w, 1e-6), 1e-2 if dtype == torch.bfloat16 else TOL)
    close(npu("rms_norm", x, None, 1e-6), ref("rms_norm")(x, None, 1e-6), 1e-2 if dtype == torch.bfloat16 else TOL)


@pytest.mark.parametrize("shape", [(0, 4, 32), (1, 32), (6, 4, 32), (3, 2, 8, 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope(shape, inverse):
    x = rnd(*shape)
    pos = torch.randint(0, 5000, (shape[0],), generator=g)
    inv = atb_ops.rope_inv_freq(8, 10000.0, 4.0, 64)
    close(npu("apply_rope", x, pos, inv, inverse), ref("apply_rope")(x, pos, inv, inverse))


@pytest.mark.parametrize("t", [0, 1, 7])
def test_hc_pre_post_head(t):
    n, d = 4, 16
    x, fn, base, scale = rnd(t, n, d), rnd((2 + n) * n, n * d) * 0.1, rnd((2 + n) * n), rnd(3)
    args = (x, fn, base, scale, 20, 1e-6, 1e-6)
    for a, b in zip(npu("hc_pre", *args), ref("hc_pre")(*args)):
        close(a, b)
    y, post, comb = rnd(t, d), rnd(t, n), rnd(t, n, n)
    close(npu("hc_post", y, x, post, comb), ref("hc_post")(y, x, post, comb))
    hfn, hb, hs = rnd(n, n * d) * 0.1, rnd(n), rnd(1)
    close(npu("hc_head", x, hfn, hb, hs, 1e-6, 1e-6), ref("hc_head")(x, hfn, hb, hs, 1e-6, 1e-6))


@pytest.mark.parametrize("overlap,r", [(False, 128), (True, 4)])
def test_compressor_pool(overlap, r):
    c = 8
    s = 13  # not a multiple of the ratio
    w = 2 * c if overlap else c
    kv, sc = rnd(s, w), rnd(s, w)
    k = 2 * r if overlap else r
    cand = torch.randint(0, s, (3, k), generator=g)
    cand[0, : k // 2] = -1  # entry 0 has no previous block
    cand[2, -1] = -1
    close(npu("compressor_pool", kv, sc, cand, overlap), ref("compressor_pool")(kv, sc, cand, overlap))
    close(npu("compressor_pool", kv, sc, cand[:0], overlap), ref("compressor_pool")(kv, sc, cand[:0], overlap))


@pytest.mark.parametrize("r", [4, 128])
def test_compressor_state_write(r):
    t, w, s = 5, 12, 17
    az = rnd(t, 2 * w)
    a, z, ape = az[:, :w], az[:, w:], rnd(r, w)
    pos = torch.randint(0, 1000, (t,), generator=g)
    slots = torch.randperm(s, generator=g)[:t]
    got = [rnd(s, w) for _ in range(2)]
    want = [p.clone() for p in got]
    assert npu("compressor_state_write", *got, a, z, ape, pos, slots) is None
    ref("compressor_state_write")(*want, a, z, ape, pos, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("t,n,topk", [(0, 6, 4), (1, 5, 8), (4, 9, 4), (3, 12, 12)])
def test_indexer_topk(t, n, topk):
    hi, di, p = 3, 16, 20
    q, w, kc = rnd(t, hi, di), rnd(t, hi), rnd(p, di)
    cand = ragged_idx(t, n, p)
    if t:
        cand[0] = -1  # a token with no candidate
    got, want = npu("indexer_topk", q, w, kc, cand, topk), ref("indexer_topk")(q, w, kc, cand, topk)
    assert torch.equal(got, want)


def test_indexer_topk_ties_keep_candidate_order():
    q, w = torch.ones(1, 1, 4), torch.ones(1, 1)
    kc = torch.ones(6, 4)  # every score equal
    cand = torch.tensor([[5, -1, 2, 4, -1, 0]])
    assert torch.equal(npu("indexer_topk", q, w, kc, cand, 3), ref("indexer_topk")(q, w, kc, cand, 3))


@pytest.mark.parametrize("t,k,k2", [(0, 4, 0), (1, 3, 0), (5, 7, 3), (4, 6, 5)])
def test_sparse_attention(t, k, k2):
    h, d, p = 4, 16, 30
    q, kv, sink = rnd(t, h, d), rnd(p, d), rnd(h)
    kv[7] = float("nan")  # an uninitialised pool row that no index references
    idx = ragged_idx(t, k, p)
    idx[idx == 7] = -1
    ex_kv, ex_idx = (rnd(9, d), ragged_idx(t, k2, 9)) if k2 else (None, None)
    if t > 1:
        idx[1] = -1  # only the sink
    close(npu("sparse_attention", q, kv, idx, sink, 0.25, ex_kv, ex_idx),
          ref("sparse_attention")(q, kv, idx, sink, 0.25, ex_kv, ex_idx))


@pytest.mark.parametrize("score_func,bias,groups,normalize,hashed", [
    ("sqrtsoftplus", True, (1, 1), True, False),
    ("sqrtsoftplus", False, (1, 1), True, True),
    ("sigmoid", True, (8, 4), True, False),
    ("sigmoid", True, (1, 1), False, False),
    ("softmax", False, (1, 1), False, False),
    ("softmax", False, (1, 1), True, False),
])
@pytest.mark.parametrize("t", [0, 1, 6])
def test_moe_gate(score_func, bias, groups, normalize, hashed, t):
    e, d, k = 32, 24, 4
    x, wt = rnd(t, d), rnd(e, d)
    b = rnd(e) * 0.1 if bias else None
    tid2eid = torch.randint(0, e, (40, k), generator=g) if hashed else None
    tok = torch.randint(0, 40, (t,), generator=g) if hashed else None
    args = (x, wt, b, k, 2.5, tid2eid, tok, score_func, groups[0], groups[1], normalize)
    (w1, i1), (w2, i2) = npu("moe_gate", *args), ref("moe_gate")(*args)
    assert torch.equal(i1, i2)
    close(w1, w2)


@pytest.mark.parametrize("limit", [0.0, 7.0])
def test_swiglu(limit):
    gt, up = rnd(5, 12) * 6, rnd(5, 12) * 6
    close(npu("swiglu", gt, up, limit), ref("swiglu")(gt, up, limit))


def test_linear_dense_and_fp8():
    from quant.fp8_block import quant_fp8_block

    x, w = rnd(3, 256), rnd(128, 256)
    close(npu("linear", x, w), ref("linear")(x, w))
    wq, s = quant_fp8_block(w)
    close(npu("linear", x, wq, s, "fp8_block"), ref("linear")(x, wq, s, "fp8_block"))


@pytest.mark.parametrize("m", [0, 1, 9])
def test_grouped_matmul(m):
    e, n, k = 5, 6, 8
    x, w = rnd(m, k), rnd(e, n, k)
    ids = torch.randint(0, e, (m,), generator=g)  # unsorted, some experts unused
    close(npu("grouped_matmul", x, w, ids), ref("grouped_matmul")(x, w, ids))
    if m > 2:  # id E: past every group (undefined rows in the op, NaN in the emulation), zeros in ours
        ids[::2] = e
        y = npu("grouped_matmul", x, w, ids)
        assert not y[::2].any()
        close(y, ref("grouped_matmul")(x, w, ids))


def test_hadamard():
    x = rnd(3, 32)
    close(npu("hadamard", x), ref("hadamard")(x))


@pytest.mark.parametrize("t,l", [(0, 4), (1, 1), (4, 9)])
def test_mla_decode(t, l):
    h, c, r, p = 4, 32, 8, 40
    qa, qp, lat = rnd(t, h, c), rnd(t, h, r), rnd(p, c + r)
    lat[3] = float("nan")
    idx = ragged_idx(t, l, p)
    idx[idx == 3] = -1
    if t > 2:
        idx[2] = -1
    close(npu("mla_decode", qa, qp, lat, idx, 0.2), ref("mla_decode")(qa, qp, lat, idx, 0.2))


@pytest.mark.parametrize("t,l", [(0, 3), (1, 1), (5, 7)])
def test_mla_prefill(t, l):
    h, dn, r, dv, s = 3, 16, 8, 12, 11
    qn, qp = rnd(t, h, dn), rnd(t, h, r)
    kn, kp, v = rnd(s, h, dn), rnd(s, r), rnd(s, h, dv)
    idx = ragged_idx(t, l, s)
    close(npu("mla_prefill", qn, qp, kn, kp, v, idx, 0.3), ref("mla_prefill")(qn, qp, kn, kp, v, idx, 0.3))


def _int8(*s):
    return torch.randint(-128, 128, s, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("m", [0, 1, 5])
def test_quant_linear_modes(m):
    from quant.msmodelslim.npu_params import encode_deq_scale_msmodelslim
    from quant.msmodelslim.packing import pack_int4_to_int32

    k, n = 64, 16
    x, w = rnd(m, k), _int8(k, n)
    if m > 1:
        x[1] = 0  # a zero row
    sc, b = torch.rand(n, generator=g) * 0.01, rnd(n)
    close(npu("quant_linear", x, w, "dynamic", sc, b), ref("quant_linear")(x, w, "dynamic", sc, b))
    deq = encode_deq_scale_msmodelslim(torch.rand(n, generator=g) * 1e-3)
    qb = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32)
    args = (x, w, "static", deq, qb, None, torch.tensor([0.02]), torch.tensor([3], dtype=torch.int8))
    close(npu("quant_linear", *args), ref("quant_linear")(*args))
    off = torch.randint(-4, 4, (n,), generator=g).float()
    close(npu("quant_linear", x, w, "weight_only", sc, b, off), ref("quant_linear")(x, w, "weight_only", sc, b, off))
    w4 = torch.randint(-8, 8, (k, n), generator=g, dtype=torch.int8)
    gsc, goff = torch.rand(2, n, generator=g) * 0.01, torch.randint(-2, 2, (2, n), generator=g).float()
    args = (x, pack_int4_to_int32(w4), "weight_only", gsc, None, goff, None, None, 32)
    close(npu("quant_linear", *args), ref("quant_linear")(*args))


def test_token_chunking_gives_the_same_results(monkeypatch):
    """Long batches run in token chunks bounded by GATHER_BUDGET: results must not change."""
    from atb_ops.npu import impl_attn

    monkeypatch.setattr(impl_attn, "GATHER_BUDGET", 64)
    t, h, d, p = 7, 2, 16, 25
    q, kv, sink, idx = rnd(t, h, d), rnd(p, d), rnd(h), ragged_idx(t, 6, p)
    ekv, eidx = rnd(9, d), ragged_idx(t, 3, 9)
    args = (q, kv, idx, sink, 0.3, ekv, eidx)
    close(npu("sparse_attention", *args), ref("sparse_attention")(*args))
    qi, wi, kc = rnd(t, 3, 8), rnd(t, 3), rnd(p, 8)
    cand = ragged_idx(t, 10, p)
    assert torch.equal(npu("indexer_topk", qi, wi, kc, cand, 4), ref("indexer_topk")(qi, wi, kc, cand, 4))
    qa, qp, lat = rnd(t, h, 8), rnd(t, h, 4), rnd(p, 12)
    close(npu("mla_decode", qa, qp, lat, idx, 0.2), ref("mla_decode")(qa, qp, lat, idx, 0.2))
    kn, kp, v = rnd(p, h, 8), rnd(p, 4), rnd(p, h, 6)
    close(npu("mla_prefill", qa, qp, kn, kp, v, idx, 0.2), ref("mla_prefill")(qa, qp, kn, kp, v, idx, 0.2))
    kvs, scs = rnd(p, 8), rnd(p, 8)
    cc = ragged_idx(t, 8, p)
    close(npu("compressor_pool", kvs, scs, cc, True), ref("compressor_pool")(kvs, scs, cc, True))


@pytest.fixture
def custom_ops(emu):
    from atb_ops.npu import emulation, optable

    emulation.install(custom=True)
    yield optable.table()
    from atb_ops.npu.emu import custom as _c  # noqa: F401

    while emulation._custom_libs:
        emulation._custom_libs.pop()._destroy()
    optable.reset()


def test_custom_ops_are_preferred_when_loaded(custom_ops):
    tbl = custom_ops
    assert tbl["hc_pre"].kind == "custom" and tbl["hc_post"].kind == "custom" and tbl["moe_gate"].kind == "custom"
    t, n, d = 3, 4, 4096
    x = rnd(t, n, d, dtype=torch.bfloat16)
    fn, base, scale = rnd((2 + n) * n, n * d) * 0.02, rnd((2 + n) * n), rnd(3)
    args = (x, fn, base, scale, 20, 1e-6, 1e-6)
    for a, b in zip(npu("hc_pre", *args), ref("hc_pre")(*args)):
        close(a, b, 1e-2)
    y, post, comb = rnd(t, d, dtype=torch.bfloat16), rnd(t, n), rnd(t, n, n)
    close(npu("hc_post", y, x, post, comb), ref("hc_post")(y, x, post, comb), 1e-2)
    e, k = 16, 4
    xg, wg, bg = rnd(5, 32), rnd(e, 32), rnd(e) * 0.1
    tid2eid, tok = torch.randint(0, e, (40, k), generator=g), torch.randint(0, 40, (5,), generator=g)
    for args in ((xg, wg, bg, k, 1.5), (xg, wg, None, k, 1.5, tid2eid, tok)):
        (w1, i1), (w2, i2) = npu("moe_gate", *args), ref("moe_gate")(*args)
        assert torch.equal(i1, i2)
        close(w1, w2)
    assert tbl["hc_pre"].calls == 1 and tbl["moe_gate"].calls == 2


@pytest.mark.parametrize("op,block", [("fp8_act_round", 128), ("fp4_act_round", 32), ("fp8_act_round", 64)])
def test_act_round_without_fp8_dtypes(op, block):
    x = rnd(4, 256) * torch.logspace(-6, 3, 256)  # every binade, subnormals of the formats included
    x[0, :block] = 0  # an all-zero block
    x[1, :8] = torch.tensor([448.0, -432.0, 0.75, 2.5, 3.5, 5.0, 1e-9, -1e-9])  # ties and tiny values
    x[2] = x[2].to(torch.bfloat16).float()
    assert torch.equal(npu(op, x, block), ref(op)(x, block))
    xb = x.to(torch.bfloat16)
    assert torch.equal(npu(op, xb, block), ref(op)(xb, block))


@pytest.mark.parametrize("m", [0, 1, 11])
def test_quant_grouped_matmul(m):
    e, k, n = 5, 32, 12
    x, w = rnd(m, k), _int8(e, k, n)
    if m > 2:
        x[2] = 0
    ids = torch.randint(0, e, (m,), generator=g)
    sc = torch.rand(e, n, generator=g) * 0.01
    close(npu("quant_grouped_matmul", x, w, ids, sc), ref("quant_grouped_matmul")(x, w, ids, sc))
    xb = x.to(torch.bfloat16)
    close(npu("quant_grouped_matmul", xb, w, ids, sc), ref("quant_grouped_matmul")(xb, w, ids, sc), 1e-2)
    if m > 2:  # id E: zero rows (rows past every group are NaN in the emulation)
        ids[1::2] = e
        y = npu("quant_grouped_matmul", x, w, ids, sc)
        assert not y[1::2].any()
        close(y, ref("quant_grouped_matmul")(x, w, ids, sc))


@pytest.mark.parametrize("scattered", [True, False])
def test_indexer_topk_reads_non_contiguous_pages_in_place(emu, scattered):
    """Candidates that are whole pages of the key pool (pages in any order) go to npu_lightning_indexer as PA_BSND
    with a block table; anything else is gathered. Both equal the reference."""
    ps, pages, di = 16, 12, 8
    kc = rnd(pages * ps, di)
    lens = [37, 5, 16, 0]
    rows = []
    for i, ln in enumerate(lens):
        table = torch.randperm(pages, generator=g)[: -(-ln // ps)] if scattered else torch.arange(i, i + 3)
        r = (table.repeat_interleave(ps) * ps + torch.arange(len(table) * ps) % ps)[:ln]
        if not scattered:
            r = r + 1  # page-misaligned rows: must be gathered
        rows.append(torch.cat([r, torch.full((40 - ln,), -1)]))
    cand = torch.stack(rows)
    q, w = rnd(4, 3, di), rnd(4, 3)
    seen = []
    real = emu.npu_lightning_indexer

    def spy(*a, **kw):
        seen.append(kw.get("layout_key"))
        return real(*a, **kw)

    emu.npu_lightning_indexer = spy
    try:
        got = npu("indexer_topk", q, w, kc, cand, 8)
    finally:
        emu.npu_lightning_indexer = real
    assert torch.equal(got, ref("indexer_topk")(q, w, kc, cand, 8))
    assert seen == (["PA_BSND"] if scattered else ["BSND"])


def test_dequantize_weight():
    from quant.fp4 import quant_fp4
    from quant.fp8_block import quant_fp8_block

    w = rnd(256, 256)
    wq, s = quant_fp8_block(w)
    assert torch.equal(npu("dequantize_weight", wq, s, "fp8_block"), ref("dequantize_weight")(wq, s, "fp8_block"))
    wq4, s4 = quant_fp4(w)
    assert torch.equal(npu("dequantize_weight", wq4, s4, "fp4"), ref("dequantize_weight")(wq4, s4, "fp4"))
