"""The CUDA C FP4 MoE kernels (atb_ops/cuda/fp4_moe_mma.py, bfloat16 MMAs, and the cases they share with
atb_ops/cuda/fp4_moe_f16.py, float16 MMAs: ``kind`` bf16 / f16; the f16 kernel's own cases are in
test_fp4_moe_f16.py), built by NVRTC on the GPU.

They have no CPU form (no interpreter runs CUDA C), so their cases run on the GPU (``cuda``): every output within one
bfloat16 rounding (plus float32 summation noise) of the exact float64 product (``check_close``), and close to the
reference op; edge cases: one row, experts with no rows, ids outside [0, E) (zeros), int32 and int64 ids, ragged
groups and a hot expert (several passes of 8 x NT rows), split-K with its arrival counters left at zero, every
byte value of the weights, scales 0 .. 128 (the kernel's range: one multiply by 2^(s - 1)), large activations
against tiny weights, DeepSeek-V4 shapes. On the CPU: the dispatch rules.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import fp4_moe_f16 as ff  # noqa: E402
from atb_ops.cuda import fp4_moe_mma as fm  # noqa: E402
from atb_ops.cuda import gemm_tc as tc  # noqa: E402

from test_gemm_decode import _ids, _weights, _weights_on_device, check_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


KERNELS = {"bf16": fm, "f16": ff}


def _built(kind: str = "bf16"):
    mod = KERNELS[kind]
    if not mod.available(torch.device(DEV)):
        pytest.fail(f"{mod.__name__} did not build: {mod.PROGRAM.error}")
    return mod


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("cfg", ["", "nt=1", "nt=2", "nt=4", "mt=1", "nt=4,mt=1", "nt=1,mt=2", "nt=2,mt=2",
                                 "nt=1,mt=4"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_fp4_moe_mma_random(m, cfg, kind, monkeypatch):
    fm = _built(kind)
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", cfg)
    g = torch.Generator().manual_seed(61)
    e, n, k = 5, 256, 768  # experts without rows, K = 3 steps
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(m, e, g, hot=3 if m > 20 else None).to(DEV)  # m = 37: 20 rows on one expert (several passes)
    assert fm.eligible(x, s, m)
    got = fm.grouped_matmul(x, w, ids, s)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, "fp4", ids)
    ref = atb_ops.implementations("grouped_matmul")["reference"](x, w, ids, s, "fp4")
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("tile", [(1, 1), (2, 1), (1, 2), (4, 1)])
@pytest.mark.parametrize("split", [1, 3, 8])
def test_fp4_moe_mma_split_k_and_passes(split, tile, kind, monkeypatch):
    """K split as far as allowed (partials added in split order by the last to arrive): 3 steps unsplit, 9 steps in 3
    blocks of 3, 24 steps in 12 blocks of 2; three passes of rows on one expert (a counter per tile and pass); the
    counters are zero after every launch. Tiles (nt, mt): (1, 2) runs its K loop per step parity (odd step counts
    here), the others step by step."""
    fm = _built(kind)
    nt, mt = tile
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", f"ctas={split * 1000},nt={nt},mt={mt}")  # split as far as allowed
    g = torch.Generator().manual_seed(62)
    e, n, k = 3, 128, 256 * 3 * split
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(40, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(40, e, g)
    ids[:35] = 2
    ids = ids.to(DEV)
    check_close(fm.grouped_matmul(x, w, ids, s), x, w, s, "fp4", ids)
    assert int(tc._counters(x.device).abs().sum()) == 0


def check_edge_rows(mod, scale_choices, g, zero_block=False):
    """``mod``'s kernel on M = 0, on one row, and on 9 rows over weights of every byte value with E8M0 scales drawn
    from ``scale_choices``, ids outside [0, E) (zero rows) as int32 and an expert without rows (``zero_block``: a
    128-channel block of one row zero). Returns (weights, scales, x, the ids clamped into range as int64, K)."""
    e, n, k = 4, 128, 512
    w, s = _weights("fp4", e, n, k, g)
    x0 = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    assert mod.grouped_matmul(x0, w, torch.zeros(0, dtype=torch.long, device=DEV), s).shape == (0, n)
    x1 = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    one = torch.tensor([3], device=DEV)
    check_close(mod.grouped_matmul(x1, w, one, s), x1, w, s, "fp4", one)
    wb = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int32)
    wb[0, 0] = torch.arange(k // 2) % 256
    wq = wb.to(torch.uint8).view(torch.int8).to(DEV)
    choices = torch.tensor(scale_choices, dtype=torch.uint8)
    sq = choices[torch.randint(0, len(choices), (e, n, k // 32), generator=g)].to(DEV)
    x = torch.randn(9, k, generator=g)
    if zero_block:
        x[4, 128:256] = 0
    x = x.to(DEV, torch.bfloat16)
    ids = torch.tensor([0, -1, 2, 4, 2, 1, 7, 0, 2], dtype=torch.int32).to(DEV)  # expert 3: no rows
    got = mod.grouped_matmul(x, wq, ids, sq)
    bad = (ids < 0) | (ids >= e)
    assert bool((got[bad] == 0).all())
    check_close(got[~bad], x[~bad], wq, sq, "fp4", ids[~bad])
    return wq, sq, x, ids.clamp(0, e - 1).long(), k


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", ["nt=1", "nt=2", "nt=1,mt=2"])
def test_fp4_moe_mma_edge_cases(cfg, monkeypatch):
    """M = 0, one row, ids outside [0, E) (zeros) as int32, every byte value, scales 0 .. 128, large activations;
    the activations permuted by the kernel as it stages them (nt = 1) or by a copy before it (nt = 2); the (1, 2)
    tile's K loop per step parity."""
    _built()
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", cfg)
    g = torch.Generator().manual_seed(63)
    wq, sq, x, ids2, k = check_edge_rows(fm, [0, 1, 2, 60, 100, 120, 126, 127, 128], g)
    x2 = (torch.randn(9, k, generator=g) * 2.0**60).to(DEV, torch.bfloat16)
    check_close(fm.grouped_matmul(x2, wq, ids2, sq), x2, wq, sq, "fp4", ids2)
    # a scale byte over 128: not this kernel's (the one-multiply decode would overflow)
    sq[0, 0, 0] = 129
    assert not fm.eligible(x, sq.clone(), 9)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_fp4_moe_mma_real_shapes(t, kind):
    """DeepSeek-V4-Flash's expert shapes (w13: 2048 x 4096 here, w2: 4096 x 2048), 64 experts, a hot expert."""
    fm = _built(kind)
    g = torch.Generator().manual_seed(64)
    e, n, k = 64, 2048, 4096
    w, s = _weights_on_device("fp4", e, n, k, 64)
    x = (torch.randn(t * 6, k, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).view(-1)
    ids[: min(len(ids), 40)] = 5
    ids = ids.to(DEV)
    check_close(fm.grouped_matmul(x, w, ids, s), x, w, s, "fp4", ids)
    x2 = (torch.randn(t * 6, n, generator=g) * 0.5).to(DEV, torch.bfloat16)
    w2, s2 = w[:, :, : n // 2].contiguous(), s[:, :, : n // 32].contiguous()
    check_close(fm.grouped_matmul(x2, w2, ids, s2), x2, w2, s2, "fp4", ids)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_fp4_moe_mma_graph_capture(kind):
    """Captured in a CUDA graph (the decode step's), replayed on new inputs: the eager results."""
    fm = _built(kind)
    g = torch.Generator().manual_seed(65)
    e, n, k = 8, 256, 1024
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(12, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(12, e, g).to(DEV)
    fm.grouped_matmul(x, w, ids, s)  # builds, warms the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.grouped_matmul(x, w, ids, s)
    x.copy_(torch.randn(12, k, generator=g).to(DEV, torch.bfloat16))
    ids.copy_(_ids(12, e, g).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fm.grouped_matmul(x, w, ids, s))


def test_dispatch_fp4_mma(monkeypatch):
    """ATB_CUDA_FP4_MOE=mma routes eligible fp4 MoE calls to this kernel where it builds, else to gemm_fp4_moe;
    ATB_CUDA_GEMM=fp4mma forces it (the tiled kernel where it does not apply)."""
    from atb_ops.cuda import gemm

    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    s = torch.zeros(8, 128, 8, dtype=torch.uint8)
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)
    monkeypatch.setenv("ATB_CUDA_FP4_MOE", "mma")
    monkeypatch.setattr(fm, "available", lambda dev: True)
    assert gemm._path(x, "fp4", s, 48, 1.4) == ("fp4mma" if x.is_cuda else "fp4moe")  # CPU tensors: not eligible
    monkeypatch.setattr(fm, "eligible", lambda *a: True)
    assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4mma"
    monkeypatch.setattr(fm, "available", lambda dev: False)
    assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4moe"
    monkeypatch.setenv("ATB_CUDA_GEMM", "fp4mma")
    assert gemm._path(x, "fp4", s, 48, 1.4) == "tiled"


def test_cfg_overrides_validated(monkeypatch):
    """The benchmark knob takes the built tiles only, and says what it takes otherwise."""
    monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", " mt=1, nt=4,ctas=8")
    assert fm._overrides() == {"mt": 1, "nt": 4, "ctas": 8}
    for bad in ("mt=3", "nt=0", "ctas=-1", "ctas", "bw=128", "mt=two"):
        monkeypatch.setenv("ATB_CUDA_FP4_MMA_CFG", bad)
        with pytest.raises(ValueError, match="ATB_CUDA_FP4_MMA_CFG: .* is not one of mt=1|2|4"):
            fm._overrides()
