"""The FP4 MoE decode GEMM of the CUDA backend (atb_ops/cuda/gemm_fp4_moe.py).

- Its FP4 word decoder is gemm_tc's (tested over every 16-bit word in test_gemm_tc.py).
- The kernel runs through Triton's interpreter at small shapes (decoder replaced by plain Triton arithmetic) and on
  the GPU at DeepSeek-V4 shapes (``cuda``): every output within one bfloat16 rounding (plus float32 summation
  noise) of the exact float64 product, and close to the reference op; edge cases: one row, experts with no rows,
  ids outside [0, E), ragged groups, every e2m1 code (zero and negative zero included), extreme scales.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import atb_ops  # noqa: E402
from atb_ops.cuda import gemm_fp4_moe as fm  # noqa: E402
from atb_ops.cuda import gemm_tc as tc  # noqa: E402

from test_gemm_decode import _ids, _weights, _weights_on_device, check_close  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


CFGS = ["", "nacc=4", "persist=1", "persist=1,nacc=4,regs=168,stages=4", "bw=128,regs=0", "bk=256,regs=0"]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("m", [1, 5, 37])
def test_grouped_matmul_fp4_moe(m, cfg, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_FP4_MOE_CFG", cfg)
    g = torch.Generator().manual_seed(41)
    e, n, k = 5, 72, 384  # N not a multiple of the 64-row tile; experts without rows
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(m, e, g, hot=3 if m > 20 else None).to(DEV)  # m = 37: 20+ rows on one expert (two passes of 16)
    got = fm.grouped_matmul(x, w, ids, s, "fp4")
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    check_close(got, x, w, s, "fp4", ids)
    ref = atb_ops.implementations("grouped_matmul")["reference"](x, w, ids, s, "fp4")
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.parametrize("persist", [1, 0])
@pytest.mark.parametrize("counters", [True, False])  # no counters (first call under graph capture): no split
def test_fp4_moe_split_k_and_passes(persist, counters, monkeypatch):
    """Split-K (partials added in split order; persist=1: the chunks per weight tile chosen in-kernel, 6 here) with
    several passes of rows on one expert (a counter per tile and pass), 32 rows per pass, and the active-expert
    prologue kernel (large M * E); without counters (seen on the H100: the persistent kernel then needs an int32
    placeholder pointer to compile)."""
    from atb_ops.cuda import gemm_decode as gd

    monkeypatch.setenv("ATB_CUDA_FP4_MOE_CFG", f"persist={persist}")
    monkeypatch.setattr(tc, "_splits", lambda *a: 3)
    if not counters:
        monkeypatch.setattr(tc, "_counters", lambda dev: None)
    g = torch.Generator().manual_seed(42)
    e, n, k = 3, 64, 1536
    w, s = _weights("fp4", e, n, k, g)
    x = torch.randn(40, k, generator=g).to(DEV, torch.bfloat16)
    ids = _ids(40, e, g)
    ids[:35] = 2  # three passes of 16 on expert 2
    ids = ids.to(DEV)
    check_close(fm.grouped_matmul(x, w, ids, s, "fp4"), x, w, s, "fp4", ids)
    if counters:
        assert int(tc._counters(x.device).abs().sum()) == 0  # every launch leaves its arrival counters at zero
    monkeypatch.setattr(gd, "FUSED_ACTIVE", 0)
    monkeypatch.setenv("ATB_CUDA_FP4_MOE_CFG", f"persist={persist},bt=32")
    check_close(fm.grouped_matmul(x, w, ids, s, "fp4"), x, w, s, "fp4", ids)


def test_fp4_moe_edge_cases():
    """M = 0, one row, ids outside [0, E) (zeros), int32 ids, ragged groups, every code and extreme scales."""
    g = torch.Generator().manual_seed(43)
    e, n, k = 4, 64, 256
    w, s = _weights("fp4", e, n, k, g)
    x0 = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    assert fm.grouped_matmul(x0, w, torch.zeros(0, dtype=torch.long, device=DEV), s, "fp4").shape == (0, n)
    x1 = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    check_close(fm.grouped_matmul(x1, w, torch.tensor([3], device=DEV), s, "fp4"), x1, w, s, "fp4",
                torch.tensor([3], device=DEV))
    # every byte value in the weights (all codes, +0 and -0 in both nibbles); scales 0 .. 140 per group, so the
    # two-multiply decoder runs (bytes > 128) and tiny and large scales meet in one row
    wb = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int32)
    wb[0, 0] = torch.arange(k // 2) % 256
    wq = wb.to(torch.uint8).view(torch.int8).to(DEV)
    choices = torch.tensor([0, 1, 2, 60, 100, 120, 126, 127, 128, 129, 140], dtype=torch.uint8)
    sq = choices[torch.randint(0, len(choices), (e, n, k // 32), generator=g)].to(DEV)
    x = torch.randn(9, k, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([0, -1, 2, 4, 2, 1, 7, 0, 2], dtype=torch.int32).to(DEV)  # expert 3: no rows
    got = fm.grouped_matmul(x, wq, ids, sq, "fp4")
    bad = (ids < 0) | (ids >= e)
    assert bool((got[bad] == 0).all())
    check_close(got[~bad], x[~bad], wq, sq, "fp4", ids[~bad])
    # only small scales (the one-multiply decoder), large activations against tiny weights
    sq2 = choices[torch.randint(0, 9, (e, n, k // 32), generator=g)].to(DEV)
    x2 = (torch.randn(9, k, generator=g) * 2.0**60).to(DEV, torch.bfloat16)
    ids2 = ids.clamp(0, e - 1)
    check_close(fm.grouped_matmul(x2, wq, ids2, sq2, "fp4"), x2, wq, sq2, "fp4", ids2)


def test_dispatch_fp4_moe(monkeypatch):
    """The default (ATB_CUDA_FP4_MOE unset = mma) routes fp4 grouped calls of up to 384 rows to the CUDA C kernels
    where they apply (CUDA tensors, built: fp4_moe_f16.py above 3 rows per expert, fp4_moe_mma.py otherwise) and
    here otherwise; f16 / bf16: one of them wherever it applies; new: here always; old keeps the previous rules; a
    forced ATB_CUDA_GEMM path wins."""
    from atb_ops.cuda import gemm

    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    s = torch.zeros(8, 8, dtype=torch.uint8)
    monkeypatch.delenv("ATB_CUDA_GEMM", raising=False)
    monkeypatch.delenv("ATB_CUDA_FP4_MOE", raising=False)
    with monkeypatch.context() as mp:  # where the CUDA C kernels apply
        mp.setattr(gemm, "_mma_ok", lambda *a: True)
        assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4mma"
        assert gemm._path(x, "fp4", s, 384, 6) == "fp4mma"  # the f16 kernel does not apply here
        assert gemm._path(x, "fp4", s, 385, 6) != "fp4mma"  # above FP4_MOE_MAX_ROWS
        mp.setattr(gemm, "_f16_ok", lambda *a: True)
        assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4mma"  # up to 3 rows per expert: the bfloat16 kernel
        assert gemm._path(x, "fp4", s, 48, 3) == "fp4mma"
        assert gemm._path(x, "fp4", s, 384, 6) == "fp4f16"  # more: the float16 one
        mp.setenv("ATB_CUDA_FP4_MOE", "f16")
        assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4f16"
        mp.setenv("ATB_CUDA_FP4_MOE", "bf16")
        assert gemm._path(x, "fp4", s, 384, 6) == "fp4mma"
        mp.setenv("ATB_CUDA_FP4_MOE", "new")
        assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4moe"
        mp.setenv("ATB_CUDA_GEMM", "fp4f16")
        assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4f16"
        mp.setattr(gemm, "_f16_ok", lambda *a: False)
        assert gemm._path(x, "fp4", s, 48, 1.4) == "tiled"
    assert gemm._path(x, "fp4", s, 48, 1.4) == "fp4moe"  # a CPU tensor: the CUDA C kernel does not apply
    assert gemm._path(x, "fp4", s, 384, 6) == "fp4moe"
    assert gemm._path(x, "fp8_block", s, 48, 1.4) == "tc"
    assert gemm._path(x, "fp4", s, 4, 4, grouped=False) == "tcl"  # linears: not this kernel (gemm_tc_large.py)
    monkeypatch.setenv("ATB_CUDA_FP4_MOE", "old")
    assert gemm._path(x, "fp4", s, 48, 1.4) == "tc"
    assert gemm._path(x, "fp4", s, 6, 1) == "decode"
    monkeypatch.setenv("ATB_CUDA_FP4_MOE", "new")
    monkeypatch.setenv("ATB_CUDA_GEMM", "decode")
    assert gemm._path(x, "fp4", s, 48, 1.4) == "decode"
    monkeypatch.setenv("ATB_CUDA_GEMM", "fp4moe")
    assert gemm._path(x, "fp4", s, 6, 1) == "fp4moe"
    assert gemm._path(x[:, :96], "fp4", s, 6, 1) == "tiled"  # K not a multiple of 128
    g = torch.Generator().manual_seed(44)
    w, sc = _weights("fp4", 3, 64, 256, g)
    xb = torch.randn(6, 256, generator=g).to(DEV, torch.bfloat16)
    ids = torch.tensor([2, 0, 2, 2, 1, 0]).to(DEV)
    check_close(atb_ops.grouped_matmul(xb, w, ids, sc, "fp4"), xb, w, sc, "fp4", ids)


# ---- DeepSeek-V4 shapes on the GPU ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", ["", "persist=1"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_grouped_matmul_fp4_moe_real_shapes(t, cfg, monkeypatch):
    monkeypatch.setenv("ATB_CUDA_FP4_MOE_CFG", cfg)
    g = torch.Generator().manual_seed(46)
    e, n, k = 64, 2048, 4096
    w, s = _weights_on_device("fp4", e, n, k, 46)
    x = (torch.randn(t * 6, k, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)]).view(-1)
    ids[: min(len(ids), 40)] = 5  # a hot expert: several passes
    ids = ids.to(DEV)
    check_close(fm.grouped_matmul(x, w, ids, s, "fp4"), x, w, s, "fp4", ids)
    x2 = (torch.randn(t * 6, n, generator=g) * 0.5).to(DEV, torch.bfloat16)  # w2's shape: K = 2048
    w2, s2 = w[:, :, : n // 2].contiguous(), s[:, :, : n // 32].contiguous()
    check_close(fm.grouped_matmul(x2, w2, ids, s2, "fp4"), x2, w2, s2, "fp4", ids)
