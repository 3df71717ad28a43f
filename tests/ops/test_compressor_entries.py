"""atb_ops.compressor_entries: the compressor's entry path (pool -> RMSNorm -> RoPE -> store into the entry pool).

The CUDA backend runs it as one Triton kernel (``compressor_pool.entries_epilogue``); it must equal the reference ops
composed in sequence, with the same roundings to the model dtype between them. Without a GPU the kernel runs on CPU
tensors through Triton's interpreter (tests/conftest.py), at small shapes; on a GPU machine on the device.
"""

from __future__ import annotations

import types

import pytest
import torch

import atb_ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16
SENTINEL = 7.0


def reference_entries(kv, sc, cand, overlap, w, eps, pos, inv_freq, dtype, out, rows):
    """The specification: the reference ops in sequence."""
    ref = {op: atb_ops.implementations(op)["reference"] for op in ("compressor_pool", "rms_norm", "apply_rope")}
    e = ref["compressor_pool"](kv, sc, cand, overlap).to(dtype)
    e = ref["apply_rope"](ref["rms_norm"](e, w, eps), pos, inv_freq)
    out.index_copy_(0, rows, e.to(out.dtype))


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make_inputs(seed, overlap, c, r, rope_dim, state_dtype, m=6, s=40, s_out=15):
    """Random state rows and entries; entry 0 has its first K/2 candidates absent (with overlap: the previous
    block, as entry 0 of a sequence; with K = 16 a whole first chunk of 8 before the present ones), entry 2 one
    absent candidate in the middle, entry 4 none present (a decode padding row)."""
    g = torch.Generator().manual_seed(seed)
    width, k = (2 * c, 2 * r) if overlap else (c, r)
    kv = torch.randn(s, width, generator=g).to(DEV, state_dtype)
    sc = (torch.randn(s, width, generator=g) * 2.0).to(DEV, state_dtype)
    cand = torch.randint(0, s, (m, k), generator=g)
    cand[0, :k // 2] = -1
    cand[2, 1] = -1
    cand[4] = -1
    w = (torch.randn(c, generator=g) * 0.1 + 1.0).to(DEV)
    pos = torch.randint(0, 5000, (m,), generator=g).to(DEV)
    inv = atb_ops.rope_inv_freq(rope_dim, 160000.0, 16.0, 4096).to(DEV)
    rows = torch.randperm(s_out, generator=g)[:m].to(DEV)
    return kv, sc, cand.to(DEV), w, pos, inv, rows


SHAPES = [  # (overlap, c, r, R): ratio-4 overlap (K = 8), ratio 8 / 16 without (K = 16: two chunks), odd c
    (True, 16, 4, 8), (True, 128, 4, 16), (False, 32, 8, 8), (False, 32, 16, 8), (False, 33, 16, 8)]
DTYPES = [(F32, F32, F32), (F32, BF16, BF16), (BF16, BF16, F32)]  # (state rows, dtype, out pool)


# the interpreter warns on the padding entry's intended 0 / 0
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("splits", ["", "2", "3"])  # "" = the launch's own choice; 2, 3: candidates split
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "f32-state-bf16", "bf16-state-f32-pool"])
@pytest.mark.parametrize("overlap, c, r, rope_dim", SHAPES)
def test_cuda_kernel_matches_reference_ops(overlap, c, r, rope_dim, dtypes, splits, monkeypatch):
    """Every shape and dtype, with the candidates of an entry pooled by one program or split over 2 / 3 programs
    (partials merged by the last): entry 0's first split has no present candidate, entry 4 none at all."""
    pytest.importorskip("triton")
    monkeypatch.setenv("ATB_CUDA_ENTRIES_SPLITS", splits)
    fused = atb_ops.implementations("compressor_pool")["cuda"].entries_epilogue
    state_dtype, dtype, out_dtype = dtypes
    kv, sc, cand, w, pos, inv, rows = make_inputs(c + r, overlap, c, r, rope_dim, state_dtype)
    got = torch.full((15, c), SENTINEL, dtype=out_dtype, device=DEV)
    want = got.clone()
    assert fused(kv, sc, cand, overlap, w, 1e-6, pos, inv, dtype, got, rows) is None
    reference_entries(kv, sc, cand, overlap, w, 1e-6, pos, inv, dtype, want, rows)
    written = torch.zeros(15, dtype=torch.bool)
    written[rows.cpu()] = True
    assert (got.cpu()[~written] == SENTINEL).all()  # rows not named in out_rows keep their value
    pad = int(rows[4])  # all candidates absent: undefined (NaN in the reference) but still written
    assert not (got.cpu()[pad] == SENTINEL).all()
    live = rows[[0, 1, 2, 3, 5]]
    # float32: ~1e-5 (online vs one-shot softmax); 16-bit: the rounding of the bf16 steps (the CPU interpreter
    # truncates float32 -> bf16 where torch rounds to nearest even)
    assert rel(got[live], want[live]) < (1e-5 if dtype == F32 and out_dtype == F32 else 1e-2)
    if DEV == "cuda" and dtype == BF16:
        # on the GPU the casts round to nearest even as torch does: only rare flips of a rounding remain (a skipped
        # rounding step flips 6% or more of the values, or by several ulps)
        a, b = got[live].double(), want[live].double()
        ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b)[1] - 8)
        assert (a != b).double().mean() < 0.05 and ((a - b).abs() <= 2 * ulp).all()
    if splits:
        from atb_ops.cuda import gemm_tc

        assert int(gemm_tc._counters(kv.device).abs().sum()) == 0  # the last split of each entry reset its counter


def test_cuda_kernel_split_count_knob(monkeypatch):
    pytest.importorskip("triton")
    from atb_ops.cuda.compressor import entry_splits

    dev = torch.device(DEV)
    monkeypatch.delenv("ATB_CUDA_ENTRIES_SPLITS", raising=False)
    assert entry_splits(10_000, 128, 8, dev) == 1  # entries enough to fill the GPU: one program each
    assert 1 < entry_splits(8, 128, 8, dev) <= 8  # few entries: split, at least 2 chunks of 8 per program
    assert entry_splits(8, 8, 8, dev) == 1  # one chunk: nothing to split
    monkeypatch.setenv("ATB_CUDA_ENTRIES_SPLITS", "3")
    assert entry_splits(10_000, 128, 8, dev) == 3
    monkeypatch.setenv("ATB_CUDA_ENTRIES_SPLITS", "two")
    with pytest.raises(ValueError, match="ATB_CUDA_ENTRIES_SPLITS"):
        entry_splits(8, 128, 8, dev)


def test_cuda_kernel_no_entries_is_a_no_op():
    pytest.importorskip("triton")
    fused = atb_ops.implementations("compressor_pool")["cuda"].entries_epilogue
    kv, sc, cand, w, pos, inv, rows = make_inputs(1, True, 16, 4, 8, F32)
    out = torch.full((15, 16), SENTINEL, device=DEV)
    assert fused(kv, sc, cand[:0], True, w, 1e-6, pos[:0], inv, F32, out, rows[:0]) is None
    assert atb_ops.compressor_entries(kv, sc, cand[:0], True, w, 1e-6, pos[:0], inv, F32, out, rows[:0]) is None
    assert (out == SENTINEL).all()


@pytest.mark.parametrize("overlap", [True, False])
def test_public_op_composes_ops_bitwise_on_reference(overlap):
    """On CPU (the reference backend: no epilogue) the op is exactly the public ops in sequence."""
    g = torch.Generator().manual_seed(3)
    c, k = 32, 8
    width = 2 * c if overlap else c
    kv, sc = torch.randn(30, width, generator=g), torch.randn(30, width, generator=g)
    cand = torch.randint(0, 30, (5, k), generator=g)
    cand[0, :4] = -1
    w = torch.randn(c, generator=g) * 0.1 + 1.0
    pos = torch.randint(0, 5000, (5,), generator=g)
    inv = atb_ops.rope_inv_freq(16, 10000.0)
    rows = torch.tensor([9, 0, 4, 11, 2])
    for dtype in (F32, BF16):
        got = torch.full((12, c), SENTINEL, dtype=dtype)
        want = got.clone()
        with atb_ops.use_backend("reference"):
            atb_ops.compressor_entries(kv, sc, cand, overlap, w, 1e-6, pos, inv, dtype, got, rows)
        e = atb_ops.compressor_pool(kv, sc, cand, overlap).to(dtype)
        e = atb_ops.apply_rope(atb_ops.rms_norm(e, w, 1e-6), pos, inv)
        want.index_copy_(0, rows, e)
        assert torch.equal(got, want)


def test_public_op_takes_the_cuda_epilogue(monkeypatch):
    """Under the cuda backend the op runs the fused kernel (one launch), not the ops in sequence."""
    pytest.importorskip("triton")
    pool = atb_ops.implementations("compressor_pool")["cuda"]
    calls = []

    def counted(*args):
        calls.append(1)
        return fused(*args)

    fused = pool.entries_epilogue
    monkeypatch.setattr(pool, "entries_epilogue", counted)
    kv, sc, cand, w, pos, inv, rows = make_inputs(2, True, 16, 4, 8, F32)
    out = torch.full((15, 16), SENTINEL, device=DEV)
    with atb_ops.use_backend("cuda"):
        atb_ops.compressor_entries(kv, sc, cand, True, w, 1e-6, pos, inv, F32, out, rows)
    assert calls == [1]


def test_public_op_checks_shapes():
    kv, sc = torch.zeros(10, 32), torch.zeros(10, 32)
    cand = torch.zeros(3, 8, dtype=torch.long)
    w, pos, inv = torch.ones(16), torch.zeros(3, dtype=torch.long), torch.ones(4)
    out, rows = torch.zeros(6, 16), torch.arange(3)
    with pytest.raises(ValueError, match=r"out_rows \(2,\) must be \[M\] = \[3\]"):
        atb_ops.compressor_entries(kv, sc, cand, True, w, 1e-6, pos, inv, F32, out, rows[:2])
    with pytest.raises(ValueError, match=r"out \(6, 32\) must be \[S, c\] with c = 16"):
        atb_ops.compressor_entries(kv, sc, cand, True, w, 1e-6, pos, inv, F32, torch.zeros(6, 32), rows)
    with pytest.raises(ValueError, match=r"positions \(3, 1\) must be \[M\] = \[3\]"):
        atb_ops.compressor_entries(kv, sc, cand, True, w, 1e-6, pos[:, None], inv, F32, out, rows)
    with pytest.raises(ValueError, match=r"norm_weight \(32,\) must be \[c\] = \[16\]"):
        atb_ops.compressor_entries(kv, sc, cand, True, torch.ones(32), 1e-6, pos, inv, F32, out, rows)
    with pytest.raises(ValueError, match=r"inv_freq \(9,\)"):
        atb_ops.compressor_entries(kv, sc, cand, True, w, 1e-6, pos, torch.ones(9), F32, out, rows)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("ratio", [4, 128])
def test_model_compressor_fused_branch_matches_op_sequence(ratio, dtype):
    """Compressor.forward under the cuda backend (Triton interpreter on CPU tensors): the fused branch writes the
    same entries as the op sequence the model runs when its norm is not a plain RMSNorm."""
    pytest.importorskip("triton")
    from ascend_dsv4.layers.norm import RMSNorm
    from ascend_dsv4.models import preset
    from ascend_dsv4.models.deepseek_v4.attention import Compressor, layer_inv_freq

    class SubclassedNorm(RMSNorm):
        """The same math, but not exactly RMSNorm: the model then keeps the op sequence."""

    cfg = preset("toy-v4")
    g = torch.Generator().manual_seed(ratio)
    comp = Compressor(cfg, ratio, cfg.head_dim, False, dtype, reference=False)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1)
                    + (1.0 if p.dim() == 1 else 0.0))
    comp = comp.to(DEV)
    c, width = cfg.head_dim, comp.wkv.weight.shape[0]
    s, t, m = 160, 3, 2
    kv0 = torch.randn(s, width, generator=g).to(DEV)
    sc0 = torch.randn(s, width, generator=g).to(DEV)
    swa_slot = torch.tensor([s - 3, s - 2, s - 1], device=DEV)  # this step's rows, also candidates below
    k = 2 * ratio if ratio == 4 else ratio
    cand = torch.randint(0, s, (m, k), generator=g).to(DEV)
    cand[0, -3:] = swa_slot
    if ratio == 4:
        cand[1, :ratio] = -1  # entry 0 of a sequence: no previous block
    cc = types.SimpleNamespace(new_cand=cand, new_pos=torch.tensor([0, 4 * ratio], device=DEV),
                               new_slot=torch.tensor([5, 1], device=DEV))
    x = torch.randn(t, cfg.dim, generator=g).to(DEV, dtype)
    inv = layer_inv_freq(cfg, ratio).to(DEV)
    results = []
    for fused in (True, False):
        if not fused:
            other = SubclassedNorm(c, comp.norm.eps).to(DEV)
            other.weight.data.copy_(comp.norm.weight)
            comp.norm = other
        kv, sc = kv0.clone(), sc0.clone()
        entries = torch.full((8, c), SENTINEL, dtype=dtype, device=DEV)
        pools = types.SimpleNamespace(dtype=dtype, state_layer=lambda lid, which: (kv, sc),
                                      entry_layer=lambda lid, which: entries)
        ctx = types.SimpleNamespace(pools=pools, positions=torch.arange(t, device=DEV) + 4 * ratio + 1,
                                    swa_slot=swa_slot, compress={ratio: cc})
        with atb_ops.use_backend("cuda"):
            comp(x, ctx, 2, inv)
        results.append(entries)
    got, want = results
    assert (got.cpu()[[0, 2, 3, 4, 6, 7]] == SENTINEL).all()
    assert rel(got[[5, 1]], want[[5, 1]]) < (1e-5 if dtype == F32 else 1e-2)
