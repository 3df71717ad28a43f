"""indexer_topk's histogram selection (atb_ops/cuda/indexer_select.py, atb_ops/cuda/topk_radix.py) against a stable
descending sort.

Every selection path (ATB_CUDA_INDEXER = radix / fused / rank / hist / split / place / bits) on random and
adversarial key distributions: all keys equal (one bin, the exact fallback), few distinct values, coarse bins (ATB_CUDA_INDEXER_HB small) and small sort
sizes (ATB_CUDA_INDEXER_CAP) that push |S| into each sort tier and past it, N < k, all -1, T = 0 / 1, ragged -1
tails. Without a GPU the kernels run through TRITON_INTERPRET=1 at small shapes (tests/conftest.py); the CUDA C radix
selection has no interpreter, so its own cases are ``cuda`` (on the CPU the radix path is the split path's).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import indexer as ix  # noqa: E402
from atb_ops.cuda.indexer_select import ORD_NEG_INF_INT  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ("radix", "fused", "rank", "hist", "split", "place", "bits")  # radix: the CUDA C kernel on a GPU, else split
NAN_KEY, INF_KEY = 0x7FC00000, 0x7F800000  # order keys of NaN and +inf (keys lie in [ORD_NEG_INF, NAN_KEY])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def want_from_keys(keys, cand, k):
    """The reference's rule on int32 order keys: stable descending sort, -1 for absent (ORD_NEG_INF) keys."""
    order = torch.sort(keys.long(), dim=1, descending=True, stable=True).indices[:, :k]
    out = cand.gather(1, order)
    return torch.where(keys.long().gather(1, order) == ORD_NEG_INF_INT, torch.full_like(out, -1), out)


def hist_of(keys, hb):
    """[T, 2^hb + 32] int32: counts of the finite keys per top-hb-bit bin (what the score kernel builds)."""
    t = keys.shape[0]
    h = torch.zeros(t, (1 << hb) + 32, dtype=torch.int32)
    b = (keys.long() >> (32 - hb)) + (1 << (hb - 1))
    for i in range(t):
        fin = keys[i] != ORD_NEG_INF_INT
        h[i, : 1 << hb] = torch.bincount(b[i][fin], minlength=1 << hb).to(torch.int32)
    return h


def _keys_case(name, t, n, g):
    if name == "random":
        keys = torch.randint(ORD_NEG_INF_INT + 1, NAN_KEY, (t, n), generator=g, dtype=torch.int64).to(torch.int32)
    elif name == "dups":  # few distinct values, spread over the bins
        keys = torch.randint(-6, 6, (t, n), generator=g, dtype=torch.int32) * 300000007
    elif name == "equal":  # every key in one bin and equal: the tie order alone decides
        keys = torch.full((t, n), 123456, dtype=torch.int32)
    elif name == "narrow":  # distinct keys inside one bin
        keys = 1000 + torch.randperm(t * n, generator=g).view(t, n).to(torch.int32)
    else:
        raise ValueError(name)
    keys[torch.rand(t, n, generator=g) < 0.15] = ORD_NEG_INF_INT
    if t > 1:
        keys[1, n // 3:] = ORD_NEG_INF_INT  # ragged -1 tail
    if t > 2:
        keys[2] = ORD_NEG_INF_INT  # nothing visible
    keys[0, :2] = NAN_KEY  # the largest key the score kernel writes (NaN), then +inf
    keys[0, 5] = INF_KEY
    keys[-1, -3:] = ORD_NEG_INF_INT + 1  # -FLT_MAX: the smallest finite key
    return keys


@pytest.mark.parametrize("mode", ["rank", "hist", "split", "place"])
@pytest.mark.parametrize("case", ["random", "dups", "equal", "narrow"])
@pytest.mark.parametrize("t,n,k,hb,caps", [(4, 150, 16, 12, None), (4, 150, 16, 4, None), (3, 200, 24, 8, "32,64"),
                                           (1, 37, 37, 6, None), (2, 9, 9, 12, None), (4, 300, 5, 3, "16,16")])
def test_select_hist_matches_stable_sort(monkeypatch, mode, case, t, n, k, hb, caps):
    if caps:
        monkeypatch.setenv("ATB_CUDA_INDEXER_CAP", caps)
    g = gen(t * n + k * 7 + hb * 131 + len(case))
    keys = _keys_case(case, t, n, g)
    cand = torch.randperm(10 * n, generator=g)[: t * n].view(t, n)
    hist = hist_of(keys, hb)
    if mode == "rank":  # histogram, zeroed per-bin slot counters, |S|
        buf = torch.zeros(t, (2 << hb) + 32, dtype=torch.int32)
        buf[:, : 1 << hb] = hist[:, : 1 << hb]
        got = ix.select_rank(keys.to(DEV), buf.to(DEV), cand.to(DEV), k, hb)
    else:
        got = ix.select_hist(keys.to(DEV), hist.to(DEV), cand.to(DEV), k, hb, split={"split": True, "place": "place"}.get(mode, False))
    assert torch.equal(got.cpu(), want_from_keys(keys, cand, k))


def _radix_built():
    from atb_ops.cuda import topk_radix

    if not topk_radix.PROGRAM.available(torch.device(DEV)):
        pytest.fail(f"topk_radix did not build: {topk_radix.PROGRAM.error}")
    return topk_radix


@pytest.mark.cuda
@pytest.mark.parametrize("own", [False, True], ids=["hist", "own"])
@pytest.mark.parametrize("case", ["random", "dups", "equal", "narrow"])
@pytest.mark.parametrize("t,n,k,hb", [(4, 150, 16, 12), (4, 150, 16, 4), (3, 200, 24, 8), (1, 37, 37, 6), (2, 9, 9, 12),
                                      (4, 300, 5, 3), (3, 1500, 1024, 7), (3, 4100, 512, 12), (2, 16384, 512, 12),
                                      (2, 16383, 2048, 11), (3, 8190, 777, 12)])
def test_radix_select_matches_stable_sort(own, case, t, n, k, hb):
    # every keys-per-thread tier (1 .. 16, vector and scalar loads), sort sizes 32 .. 2048 (one or two a thread), the
    # score kernel's histogram at 3 .. 12 bits or the block's own 12-bit count, ties resolved down to the last bit
    topk_radix = _radix_built()
    g = gen(t * n + k * 7 + hb * 131 + len(case))
    keys = _keys_case(case, t, n, g)
    cand = torch.randperm(10 * n, generator=g)[: t * n].view(t, n)
    hist = None if own else hist_of(keys, hb).to(DEV)
    got = topk_radix.select(keys.to(DEV), cand.to(DEV), k, hist, hb)
    assert torch.equal(got.cpu(), want_from_keys(keys, cand, k))


@pytest.mark.cuda
def test_radix_select_boundary_ties():
    # the k-th key shared by keys on both sides of the cut, in one thread's registers and across threads; k = the
    # number of finite keys exactly; a non-contiguous keys view (copied contiguous first)
    topk_radix = _radix_built()
    n, k = 4096, 512
    keys = torch.full((3, n), 7, dtype=torch.int32)
    keys[:, ::3] = 9  # 1366 keys of 9 (> k): the cut falls among them
    keys[1, :] = ORD_NEG_INF_INT
    keys[1, 100:100 + k] = 5  # exactly k finite keys
    keys[2, 500:] = ORD_NEG_INF_INT
    keys[2, 10:20] = 11
    cand = torch.arange(3 * n).view(3, n)
    got = topk_radix.select(keys.to(DEV), cand.to(DEV), k)
    assert torch.equal(got.cpu(), want_from_keys(keys, cand, k))
    wide = torch.zeros(3, n + 4, dtype=torch.int32)
    wide[:, 4:] = keys
    got = topk_radix.select(wide.to(DEV)[:, 4:], cand.to(DEV), k)
    assert torch.equal(got.cpu(), want_from_keys(keys, cand, k))


def test_score_kernel_histogram():
    # the score kernel's histogram equals a bincount of the keys it wrote (finite keys only)
    g = gen(5)
    t, n, p = 3, 70, 90
    q, w, kc = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, generator=g), torch.randn(p, 16, generator=g)
    cand = torch.randint(0, p, (t, n), generator=g)
    cand[torch.rand(t, n, generator=g) < 0.3] = -1
    cand[2] = -1
    for hb in (12, 5):
        hist = torch.zeros(t, (1 << hb) + 32, dtype=torch.int32, device=DEV)
        keys = ix.score_keys(q.to(DEV), w.to(DEV), kc.to(DEV), cand.to(DEV), hist, hb)
        assert torch.equal(hist.cpu(), hist_of(keys.cpu(), hb))
        assert int(hist[2].sum()) == 0


def _inputs(g, t, n, p, hi=3, di=16, integer=False, dtype=torch.float32):
    if integer:
        q = torch.randint(-2, 3, (t, hi, di), generator=g).to(dtype)
        kc = torch.randint(-2, 3, (p, di), generator=g).to(dtype)
        w = torch.randint(-2, 3, (t, hi), generator=g).float()
    else:
        q, kc, w = torch.randn(t, hi, di, generator=g).to(dtype), torch.randn(p, di, generator=g).to(dtype), \
            torch.randn(t, hi, generator=g)
    cand = torch.randint(0, p, (t, n), generator=g)
    cand[torch.rand(t, n, generator=g) < 0.2] = -1
    return q, w, kc, cand


def _check(q, w, kc, cand, topk):
    cu, ref = atb_ops.implementations("indexer_topk")["cuda"], atb_ops.implementations("indexer_topk")["reference"]
    q, w, kc, cand = q.to(DEV), w.to(DEV), kc.to(DEV), cand.to(DEV)
    a, b = cu(q, w, kc, cand, topk), ref(q, w, kc, cand, topk)
    assert a.shape == b.shape and a.dtype == torch.int64
    assert torch.equal(a, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hb", ["12", "4"])
def test_indexer_topk_paths_edge_cases(monkeypatch, path, hb):
    if path == "bits" and hb == "4":
        pytest.skip("the bits path keeps no histogram: the same run as hb=12")
    if path == "radix" and DEV == "cpu":
        pytest.skip("without a GPU the radix path is the split path's run")
    if path == "fused" and hb == "4" and DEV == "cpu":  # 14 s in the interpreter, CI's slowest indexer case
        pytest.skip("coarse bins of the fused launch: test_indexer_topk_fused_program_counts (hb 6 and 3) on the CPU")
    monkeypatch.setenv("ATB_CUDA_INDEXER", path)
    monkeypatch.setenv("ATB_CUDA_INDEXER_HB", hb)
    g = gen(11)
    for integer in (False, True):
        q, w, kc, cand = _inputs(g, 5, 90, 120, integer=integer)
        cand[1, 30:] = -1  # ragged tail
        cand[2] = -1  # all -1
        _check(q, w, kc, cand, 20)
    # the shape edges on the integer inputs (exact scores, ties: the stable order matters most there)
    _check(q[:1], w[:1], kc, cand[:1], 20)  # T = 1
    _check(q, w, kc, cand[:, :7], 20)  # N < k
    _check(q[:0], w[:0], kc, cand[:0], 20)  # T = 0
    # all-equal scores (q = 0): the first k valid candidates in order, through the exact fallback when |S| is big
    q, w, kc, cand = _inputs(g, 3, 150, 200)
    cand[1, 100:] = -1
    _check(torch.zeros_like(q), w, kc, cand, 40)
    # negative weights: negative scores, exact zeros and -0.0 are one tie
    q, w, kc, cand = _inputs(g, 4, 60, 80, integer=True)
    _check(q, -w.abs(), kc, cand, 25)


@pytest.mark.parametrize("path", ["fused", "rank", "hist", "split", "place"])
def test_indexer_topk_small_caps_fallback(monkeypatch, path):
    # sort sizes at their minimum: most rows take the exact fallback, the others the small tier
    monkeypatch.setenv("ATB_CUDA_INDEXER", path)
    monkeypatch.setenv("ATB_CUDA_INDEXER_CAP", "16,32")
    g = gen(12)
    for integer in (False, True):
        q, w, kc, cand = _inputs(g, 4, 120, 150, integer=integer)
        cand[3, 20:] = -1
        _check(q, w, kc, cand, 12)


@pytest.mark.parametrize("p,q,hb,cap", [(1, 1, "12", None), (3, 3, "12", None), (2, 1, "6", "16,32"), (5, 4, "3", None)])
@pytest.mark.parametrize("frank", ["0", "1"])
def test_indexer_topk_fused_program_counts(monkeypatch, p, q, hb, cap, frank):
    # the fused launch with 1..5 bucket programs and 1..4 sort programs per token (rank slices q, q + Q, ... or
    # bins q, q + Q, ...), coarse bins (one bin over SEG keys -> the exact fallback) and a small |S| cap
    monkeypatch.setenv("ATB_CUDA_INDEXER", "fused")
    monkeypatch.setenv("ATB_CUDA_INDEXER_FRANK", frank)
    monkeypatch.setenv("ATB_CUDA_INDEXER_P", str(p))
    monkeypatch.setenv("ATB_CUDA_INDEXER_Q", str(q))
    monkeypatch.setenv("ATB_CUDA_INDEXER_HB", hb)
    if cap:
        monkeypatch.setenv("ATB_CUDA_INDEXER_CAP", cap)
    g = gen(13)
    for integer in (False, True):
        q_, w, kc, cand = _inputs(g, 3, 160, 200, integer=integer)
        cand[2, 50:] = -1
        _check(q_, w, kc, cand, 24)
    _check(q_, w, kc, cand[:, :10], 24)  # N < k (integer inputs: ties)
    _check(q_[:1], w[:1], kc, cand[:1], 1)  # k = 1


def test_auto_fallback_paths():
    # where the CUDA C selection cannot run (no build, interpreted, N > 16384): auto's Triton path by N; an explicit
    # radix request: split / place (what the CPU runs of the radix cases exercise)
    assert ix._fallback("auto", ix._AUTO_BITS_MAX) == "bits"
    assert ix._fallback("auto", ix._AUTO_BITS_MAX + 1) == "split"
    assert ix._fallback("auto", ix._AUTO_SPLIT_MAX + 1) == "place"
    assert ix._fallback("radix", 1) == "split"
    assert ix._fallback("radix", ix._AUTO_SPLIT_MAX + 1) == "place"


@pytest.mark.cuda
@pytest.mark.parametrize("n,radix", [(2048, True), (16384, True), (16385, False)])
def test_auto_takes_radix_where_it_runs(monkeypatch, n, radix):
    # the default path selects with topk_radix up to 16384 candidates (session 27: the fastest at every shape timed)
    topk_radix = _radix_built()
    monkeypatch.delenv("ATB_CUDA_INDEXER", raising=False)
    calls = []
    real = topk_radix.select
    monkeypatch.setattr(topk_radix, "select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = gen(n)
    q, kc, w = torch.randn(2, 64, 128, generator=g).to(torch.bfloat16), \
        torch.randn(2 * n, 128, generator=g).to(torch.bfloat16), torch.randn(2, 64, generator=g)
    cand = torch.arange(2 * n).view(2, n)
    qd, wd, kd, cd = q.to(DEV), w.to(DEV), kc.to(DEV), cand.to(DEV)
    got = atb_ops.implementations("indexer_topk")["cuda"](qd, wd, kd, cd, 512)
    assert bool(calls) == radix
    assert torch.equal(got.cpu(), want_from_keys(ix.score_keys(qd, wd, kd, cd).cpu(), cand, 512))


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["auto", "radix", "fused", "rank", "hist", "split", "place"])
@pytest.mark.parametrize("t,n", [(1, 2048), (32, 2048), (32, 16384), (4, 65536), (32, 65536), (5, 300), (64, 8192)])
def test_indexer_topk_paths_real_shapes(monkeypatch, path, t, n):
    # 64 heads x 128 dims bf16; integer inputs: exact scores with many ties, so the selection must equal the
    # reference's bit for bit; then all-equal scores (the exact fallback) and ragged -1 tails
    monkeypatch.setenv("ATB_CUDA_INDEXER", path)
    g = gen(36)
    p = t * n
    q = torch.randint(-2, 3, (t, 64, 128), generator=g).to(torch.bfloat16)
    kc = torch.randint(-2, 3, (p, 128), generator=g).to(torch.bfloat16)
    w = torch.randint(-3, 4, (t, 64), generator=g).float()
    cand = torch.arange(p).view(t, n)
    lens = torch.randint(0, n + 1, (t,), generator=g)
    lens[0] = n
    for i in range(t):
        cand[i, int(lens[i]):] = -1
    cand[0, : n // 2] = torch.randperm(p, generator=g)[: n // 2]
    _check(q, w, kc, cand, 512)
    _check(torch.zeros_like(q), w, kc, cand, 512)
    # random bf16: scores differ from the reference's only by summation order; compare against the cuda keys
    q, kc, w = torch.randn(t, 64, 128, generator=g).to(torch.bfloat16), \
        torch.randn(p, 128, generator=g).to(torch.bfloat16), torch.randn(t, 64, generator=g)
    qd, wd, kd, cd = q.to(DEV), w.to(DEV), kc.to(DEV), cand.to(DEV)
    keys = ix.score_keys(qd, wd, kd, cd)
    got = atb_ops.implementations("indexer_topk")["cuda"](qd, wd, kd, cd, 512)
    assert torch.equal(got.cpu(), want_from_keys(keys.cpu(), cand, min(512, n)))


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["radix", "fused", "rank", "hist", "split", "place"])
def test_indexer_topk_cuda_graph_replay(monkeypatch, path):
    # decode runs under CUDA graphs: capture once, replay on new inputs copied into the static buffers (the zeroed
    # histogram and the slot counter must be rebuilt on every replay), compare each replay with the reference
    monkeypatch.setenv("ATB_CUDA_INDEXER", path)
    cu, ref = atb_ops.implementations("indexer_topk")["cuda"], atb_ops.implementations("indexer_topk")["reference"]
    g = gen(41)
    t, n, p = 8, 4096, 8 * 4096

    def inputs(zero=False):
        q = torch.randint(-2, 3, (t, 64, 128), generator=g).to(torch.bfloat16)
        q = torch.zeros_like(q) if zero else q
        kc = torch.randint(-2, 3, (p, 128), generator=g).to(torch.bfloat16)
        w = torch.randint(-3, 4, (t, 64), generator=g).float()
        cand = torch.randperm(p, generator=g)[: t * n].view(t, n)
        cand[1, 300:] = -1
        cand[2] = -1
        return q, w, kc, cand

    static = [x.to(DEV) for x in inputs()]
    cu(*static, 512)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cu(*static, 512)
    for zero in (False, True, False):
        new = inputs(zero)
        for s, x in zip(static, new):
            s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref(*new, 512))


@pytest.mark.cuda
def test_bench_graph_timing_sees_complete_inputs(monkeypatch):
    # guard of scripts/bench_indexer.py's g_ms: triton's do_bench_cudagraph first calls fn on a new side stream
    # that does not wait for the default stream, so without g_ms's sync the op could read inputs still being
    # written (suspected, not shown, for the last session's illegal memory access at T=32 N=65536). Here cand is
    # rewritten on the default stream behind a device sleep; the first timed call must already see the new ids.
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_indexer as bi

    monkeypatch.setenv("ATB_CUDA_INDEXER", "rank")
    monkeypatch.setattr(bi, "NO_SYNC", False)
    cu = atb_ops.implementations("indexer_topk")["cuda"]
    g = torch.Generator(device="cuda").manual_seed(3)
    t, n = 4, 4096
    q = torch.randn(t, 64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(t, 64, device="cuda", generator=g)
    kc = torch.randn(t * n, 128, device="cuda", generator=g).bfloat16()
    real = torch.arange(t * n, device="cuda").view(t, n)
    want = cu(q, w, kc, real, 512)
    # the side stream that do_bench_cudagraph takes next from torch's pool of 32 gets cached blocks first, so no
    # cudaMalloc (which synchronises the device) hides the race (scripts/repro_indexer_graph_race.py)
    s_prev, s0 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s0):
        cu(q, w, kc, real, 512)
    torch.cuda.synchronize()
    for _ in range(64):
        if torch.cuda.Stream().cuda_stream == s_prev.cuda_stream:
            break
    cand = torch.full_like(real, -1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    cand.copy_(real)
    first = []
    bi.g_ms(lambda: first.append(cu(q, w, kc, cand, 512)) if not first else cu(q, w, kc, cand, 512))
    torch.cuda.synchronize()
    assert torch.equal(first[0], want)


@pytest.mark.parametrize("var,value", [("ATB_CUDA_INDEXER_R", "48"), ("ATB_CUDA_INDEXER_C", "x"),
                                       ("ATB_CUDA_INDEXER_R", "0")])
def test_place_tile_env_errors_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv("ATB_CUDA_INDEXER", "place")
    monkeypatch.setenv(var, value)
    q, w, kc, cand = _inputs(gen(14), 2, 40, 50)
    with pytest.raises(ValueError, match=var):
        atb_ops.implementations("indexer_topk")["cuda"](q.to(DEV), w.to(DEV), kc.to(DEV), cand.to(DEV), 8)
