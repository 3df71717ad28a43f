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


def test_default_takes_it_from_32_ctas():
    assert aw.preferred(32, 64) and aw.preferred(16, 128) and aw.preferred(128, 64) and aw.preferred(2048, 128)
    assert not aw.preferred(16, 64) and not aw.preferred(8, 128) and not aw.preferred(1, 64)
    assert not aw.preferred(64, 32)  # fewer than 64 heads: not this kernel's shape


def test_splits_keep_three_chunks():
    """attention_v2's split rule, with at least 3 chunks a split (132 SMs, the shapes session 26 timed)."""
    assert aw.splits(10, 132, 128) == (1, 10)  # T = 128: one CTA per token
    assert aw.splits(10, 132, 64) == (2, 5)
    assert aw.splits(10, 132, 32) == (4, 3)
    assert aw.splits(3, 132, 32) == (1, 3) and aw.splits(3, 132, 64) == (1, 3)  # HCA's 128 + 64 keys: unsplit
    assert aw.splits(10, 132, 1) == (3, 4)  # splits of 4, 4 and 2 chunks
    assert aw.splits(2, 132, 5) == (1, 2) and aw.splits(0, 132, 4) == (1, 1)
    for nc in range(0, 80):
        for programs in (1, 3, 16, 32, 64, 200):
            n, c = aw.splits(nc, 132, programs)
            assert n >= 1 and (n - 1) * c < max(nc, 1) <= n * c  # every split non-empty, every chunk covered
            assert n == 1 or c >= aw.MIN_SPLIT_CHUNKS


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
])
def test_matches_reference(monkeypatch, t, h, k1, k2, with_sink, idx_dtype):
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", "wgmma")
    impl = atb_ops.implementations("sparse_attention")
    cu, ref = impl["cuda"], impl["reference"]
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
def test_graph_replay_matches_eager(monkeypatch):
    monkeypatch.setenv("ATB_CUDA_ATTN_IMPL", "wgmma")
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
