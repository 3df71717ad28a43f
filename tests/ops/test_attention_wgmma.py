"""atb_ops/cuda/attention_wgmma.py: the wgmma sparse-attention decode kernel against the reference op.

The GPU cases need compute capability 9.0 (wgmma is sm_90a only); elsewhere they skip. The CPU cases check the
pieces that do not need a GPU: the shared-memory budget, the routing rule, eligibility.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import attention_wgmma as aw  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SMEM_MAX = 232448  # bytes of shared memory a block may have on sm_90 (227 KB)


def test_tiles_fit_shared_memory():
    assert aw.smem_bytes(aw.BN, aw.ST) <= SMEM_MAX
    assert aw.BN % 16 == 0 and aw.ST >= 2


def test_source_has_one_kernel_per_index_dtype():
    names = aw.PROGRAM.names
    assert len(names) == 2 and all(n.startswith("attn_wgmma<") for n in names)
    assert aw.PROGRAM.arch_suffix == "a"  # wgmma: the sm_90a target


def test_default_takes_it_from_8_ctas():
    assert aw.preferred(8, 64) and aw.preferred(4, 128) and aw.preferred(32, 64) and aw.preferred(2048, 128)
    assert not aw.preferred(4, 64) and not aw.preferred(2, 128) and not aw.preferred(1, 64)
    assert not aw.preferred(64, 32)  # fewer than 64 heads: not this kernel's shape


def test_splits_only_where_the_merge_pays():
    """attention_v2's split rule, kept where the longest split plus the merge (MERGE_CHUNKS) is shorter than the
    whole list (132 SMs, the shapes session 28 timed)."""
    assert aw.splits(10, 132, 128) == (1, 10)  # T = 128: one CTA per token
    assert aw.splits(10, 132, 64) == (2, 5)
    assert aw.splits(10, 132, 32) == (4, 3)
    assert aw.splits(10, 132, 16) == (5, 2)
    assert aw.splits(10, 132, 8) == (10, 1) and aw.splits(10, 132, 1) == (10, 1)
    assert aw.splits(3, 132, 32) == (3, 1) and aw.splits(3, 132, 8) == (3, 1)  # HCA's 128 + 64 keys
    assert aw.splits(3, 132, 64) == (1, 3)  # 2 x 2 + the merge: longer than unsplit
    assert aw.splits(2, 132, 5) == (1, 2) and aw.splits(0, 132, 4) == (1, 1)
    for nc in range(0, 80):
        for programs in (1, 3, 16, 32, 64, 200):
            n, c = aw.splits(nc, 132, programs)
            assert n >= 1 and (n - 1) * c < max(nc, 1) <= n * c  # every split non-empty, every chunk covered
            assert n == 1 or c + aw.MERGE_CHUNKS < nc


def test_seesaw_fits_and_routes(monkeypatch):
    """attention_seesaw.py: its shared memory fits, one instance per index dtype, splits of an even chunk count, and
    attention.py's choice between the two schedules (forced by ATB_CUDA_ATTN_IMPL, by default where preferred)."""
    from atb_ops.cuda import attention as att
    from atb_ops.cuda import attention_seesaw as ss

    assert ss.smem_bytes() <= SMEM_MAX and ss.PROGRAM.arch_suffix == "a" and len(ss.PROGRAM.names) == 2
    for nc in range(0, 40):
        for programs in (1, 8, 32, 64, 256):
            n, c = ss.splits(nc, 132, programs)
            assert n >= 1 and (n - 1) * c < max(nc, 1) <= n * c and (n == 1 or c % 2 == 0)
    assert ss.preferred(8, 128) and ss.preferred(128, 256) and ss.preferred(2048, 64) and ss.preferred(512, 64)
    assert not ss.preferred(128, 64) and not ss.preferred(511, 64)
    q = torch.zeros(128, 128, 512, dtype=torch.bfloat16)
    assert att._use_seesaw(q, "seesaw") and not att._use_seesaw(q, "wgmma")
    monkeypatch.setattr(ss.PROGRAM, "available", lambda *a, **k: True)
    assert att._use_seesaw(q, "auto") and att._use_seesaw(q[:8], "auto") and not att._use_seesaw(q[:, :64], "auto")
    monkeypatch.setattr(ss.PROGRAM, "available", lambda *a, **k: False)  # not built here: the wgmma kernel
    assert not att._use_seesaw(q, "auto")


def test_arch_specific_build_only_on_its_architecture(monkeypatch):
    """An sm_90a program is neither built nor loaded on another compute capability (a Blackwell GPU has no wgmma)."""
    from atb_ops.cuda import nvrtc

    prog = nvrtc.Program(aw.PROGRAM.source, "t.cu", aw.PROGRAM.names, arch_suffix="a")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(prog, "kernels", lambda device: pytest.fail("built on an unsupported architecture"))
    assert not prog.available(torch.device("cuda", 0), min_cc=(9, 0), max_cc=(9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not prog.available(torch.device("cuda", 0), min_cc=(9, 0), max_cc=(9, 0))
    assert prog.error is None


def test_not_eligible_off_gpu_or_off_shape():
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(10, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    assert not aw.eligible(q, None, kv, idx, None, None, torch.bfloat16)  # CPU tensors
    assert not aw.eligible(q[:, :32], None, kv, idx, None, None, torch.bfloat16)  # 32 heads
    assert not aw.eligible(q.float(), None, kv, idx, None, None, torch.float32)


def test_empty_key_lists_give_zeros_without_a_launch():
    """No key at all (K1 = 0, no extra set): zeros, as the reference's empty softmax sum gives, returned before any
    launch (so this runs on CPU tensors)."""
    q = torch.randn(3, 64, 512).to(torch.bfloat16)
    kv = torch.randn(10, 512).to(torch.bfloat16)
    idx = torch.zeros(3, 0, dtype=torch.int32)
    out = aw.run(q, kv, idx, None, None, torch.zeros(64), 0.05, n_sm=132)
    assert out.shape == (3, 64, 512) and out.dtype == torch.bfloat16 and not out.float().abs().any()
    out = aw.run(q, kv, idx, kv, idx[:, :0], None, 0.05, n_sm=132)  # an empty extra set too
    assert not out.float().abs().any()
    ref = atb_ops.implementations("sparse_attention")["reference"](q.float(), kv.float(), idx.long(), torch.zeros(64),
                                                                   0.05, None, None)
    assert not ref.abs().any()


@pytest.mark.parametrize("n_split,h,with_sink", [(2, 64, True), (3, 128, False), (10, 64, True), (17, 64, True)])
def test_split_merge_matches_its_formula(n_split, h, with_sink):
    """The split merge as run() launches it (attention_v2's kernel over MERGE_COLS-column programs; on CPU through
    the interpreter) against its formula in float64: out = sum_s w_s l_s o_s / (sum_s w_s l_s + 2^(sink - M)),
    w_s = 2^(m_s - M), M = max(m_s, sink); a split without keys (m = -1e30, l = 0) adds nothing, a token whose splits
    are all empty and has no sink gives zeros."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(n_split * 10 + h)
    t = 3
    part = torch.randn(n_split, t, h, 512, generator=g).to(torch.bfloat16)
    m = torch.randn(n_split, t, h, generator=g) * 4
    l_ = torch.rand(n_split, t, h, generator=g) * 30 + 0.5
    m[0, 0], l_[0, 0] = -1.0e30, 0.0  # split 0 of token 0: no key
    if not with_sink:
        m[:, 2], l_[:, 2] = -1.0e30, 0.0  # token 2: no key in any split
    ml = torch.stack([m, l_], -1)
    sink = torch.randn(h, generator=g) if with_sink else None
    out = torch.empty(t, h, 512, dtype=torch.bfloat16)
    part, ml, out = part.to(dev), ml.to(dev), out.to(dev)
    sinkc = sink.to(dev) if with_sink else out
    nd = 512 // aw.MERGE_COLS  # run()'s launch: one program per (token, 64 heads, MERGE_COLS columns)
    aw.attention_v2._merge_splits_kernel[(t * (h // 64) * nd,)](part, ml, sinkc, out, t, h, 512, n_split, h // 64,
                                                                HAS_SINK=with_sink, BH=64, DV=aw.MERGE_COLS, ND=nd,
                                                                SP=aw.pow2(n_split), num_warps=4)
    m64, l64, o64 = m.double(), l_.double(), part.double().cpu()
    big = m64.amax(0)
    if with_sink:
        big = torch.maximum(big, sink.double()[None, :] * 1.4426950408889634)
    w = torch.exp2(m64 - big[None]) * l64
    den = w.sum(0) + (torch.exp2(sink.double()[None, :] * 1.4426950408889634 - big) if with_sink else 0.0)
    want = (w[..., None] * o64).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    got = out.double().cpu()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), float((got - want).abs().max())
    if not with_sink:
        assert not got[2].abs().any()


def _inputs(g, t, h, k1, k2, idx_dtype, dev="cuda"):
    def rnd(*s):
        return torch.randn(*s, generator=g).to(dev, torch.bfloat16)

    q, kv, ent = rnd(t, h, 512), rnd(700, 512), rnd(600, 512)
    idx = torch.randint(0, 700, (t, k1), generator=g)
    idx[torch.rand(t, k1, generator=g) < 0.1] = -1
    ex = torch.randint(0, 600, (t, k2), generator=g)
    if k2:
        ex[:, (k2 * 3) // 4:] = -1  # the unfilled tail of a top-k
    if t > 1:
        idx[-1] = -1  # a token with no valid key at all
        ex[-1] = -1
    sink = torch.randn(h, generator=g).to(dev)
    return q, kv, idx.to(dev, idx_dtype), ent, ex.to(dev, idx_dtype), sink


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER, reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("t,h,k1,k2,with_sink,idx_dtype", [
    (1, 64, 128, 512, True, torch.int32),     # one token: the key list split 10 / 20 ways
    (3, 128, 128, 512, True, torch.int64),    # two head blocks, int64 indices
    (32, 64, 128, 512, False, torch.int32),   # no sink, split
    (128, 64, 128, 512, True, torch.int32),   # one CTA per token: unsplit
    (200, 64, 100, 77, True, torch.int64),    # lists not multiples of the chunk, unsplit
    (5, 64, 128, 0, True, torch.int32),       # main set only (V4's sliding-window layers)
    (8, 64, 128, 64, True, torch.int32),      # HCA's 128 + 64 keys: 3 splits of one chunk
])
@pytest.mark.parametrize("impl", ["wgmma", "seesaw"])
def test_matches_reference(monkeypatch, t, h, k1, k2, with_sink, idx_dtype, impl):
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", impl)
    impls = atb_ops.implementations("sparse_attention")
    cu, ref = impls["cuda"], impls["reference"]
    g = torch.Generator().manual_seed(t * 1000 + h + k2)
    q, kv, idx, ent, ex, sink = _inputs(g, t, h, k1, k2, idx_dtype)
    kv[0] = float("nan")  # rows no index names must not leak (absent keys are never read)
    idx[idx == 0] = 1
    sink = sink if with_sink else None
    assert aw.eligible(q, None, kv, idx, ent if k2 else None, ex if k2 else None, torch.bfloat16)
    extra = (ent, ex) if k2 else (None, None)
    a = cu(q, kv, idx, sink, 512**-0.5, *extra)
    # (the reference op takes a sink always: none is a sink far below every score, whose term exp(sink - m) is 0 --
    # -inf itself would make the row without keys 0 / 0 there)
    ref_sink = sink if with_sink else torch.full((h,), -1e4, device="cuda")
    b = ref(q.float(), kv.float(), idx, ref_sink, 512**-0.5, ent.float() if k2 else None, ex if k2 else None)
    assert a.dtype == torch.bfloat16 and a.shape == b.shape
    assert not torch.isnan(a).any()
    err = float((a.double() - b.double()).norm() / b.double().norm())
    assert err < 1e-2, err
    if t > 1:
        assert float(a[-1].float().abs().max()) == 0.0  # no valid key: zeros (the sink alone has no value)


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER, reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("impl", ["wgmma", "seesaw"])
def test_graph_replay_matches_eager(monkeypatch, impl):
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", impl)
    cu = atb_ops.implementations("sparse_attention")["cuda"]
    g = torch.Generator().manual_seed(3)
    q, kv, idx, ent, ex, sink = _inputs(g, 8, 64, 128, 512, torch.int32)
    eager = cu(q, kv, idx, sink, 0.05, ent, ex)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cu(q, kv, idx, sink, 0.05, ent, ex)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
