"""BF16 storage of the float32-compute linears (parallel.linear.compact_fp32_weights_): DeepSeek-V4's head and
compressor projections are BF16 in the checkpoint and float32 parameters in the official code; where their values
are BF16 the CUDA runner stores them so (half the bytes a decode step reads): the reference op upcasts the weight
(bitwise the same results), the CUDA op computes at float32 accuracy on the BF16 tensor cores (three-part split
of the float32 input)."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_
from parallel.linear import Linear, bf16_exact, compact_fp32_weights_
from v4_helpers import SMALL_POOLS, toy_cfg, two_sequence_logits


def _fp32_linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.compute_fp32}


def _model(bf16_values: bool, device="cpu"):
    """init_random_ gives these linears BF16 values (what loading the BF16 checkpoint into the float32 parameters
    gives); bf16_values=False moves them off the BF16 grid (a float32 checkpoint's values)."""
    model = init_random_(DeepseekV4Model(toy_cfg(index_topk=128), torch.float32, "exact"), 0).eval().to(device)
    if not bf16_values:
        with torch.no_grad():
            for m in _fp32_linears(model).values():
                m.weight.mul_(1 + 2.0**-12)
    return model


_logits = two_sequence_logits


def test_bf16_exact():
    w = torch.randn(300, 64).bfloat16().float()
    assert bf16_exact(w) and bf16_exact(w[:1]) and bf16_exact(torch.zeros(0, 8))
    w[299, 63] += 2.0**-20 * w[299, 63].abs().clamp(min=1)  # one value off the BF16 grid, in the last chunk
    assert not bf16_exact(w) and not bf16_exact(w, rows=7)
    assert bf16_exact(torch.tensor([float("inf"), -0.0, 1.0]))


def test_random_weights_are_bf16_values():
    """The random model mirrors the checkpoint: its float32-compute linears hold BF16 values (head, compressors)."""
    model = init_random_(DeepseekV4Model(toy_cfg(index_topk=128), torch.float32, "exact"), 0)
    lin = _fp32_linears(model)
    assert "head" in lin and all(m.weight.dtype == torch.float32 and bf16_exact(m.weight) for m in lin.values())
    assert not bf16_exact(model.layers[0].attn.wq_a.weight)  # the others keep their float32 draws


def test_compaction_keeps_every_logit_bitwise():
    model = _model(bf16_values=True)
    before = _logits(model)
    names = _fp32_linears(model)
    assert "head" in names and any(n.endswith("compressor.wkv") for n in names)
    freed = compact_fp32_weights_(model)
    assert freed == sum(m.weight.numel() * 2 for m in names.values())
    assert all(m.weight.dtype == torch.bfloat16 and m.compute_fp32 for m in names.values())
    assert compact_fp32_weights_(model) == 0  # idempotent
    assert torch.equal(_logits(model), before)


def test_values_off_the_bf16_grid_stay_float32():
    model = _model(bf16_values=False)
    assert compact_fp32_weights_(model) == 0
    assert all(m.weight.dtype == torch.float32 for m in _fp32_linears(model).values())


def test_cpu_runner_leaves_the_weights_as_they_are():
    model = _model(bf16_values=True)
    ModelRunner(model, SMALL_POOLS, "cpu")
    assert all(m.weight.dtype == torch.float32 for m in _fp32_linears(model).values())


def test_f32_linear_path_setting(monkeypatch):
    """ATB_CUDA_F32_LINEAR picks the float32-x / BF16-weight path; gemv only up to 256 rows; a bad value is refused
    naming the variable."""
    from atb_ops.cuda.gemm import _f32_path

    for value, m, want in (("auto", 1, "bf16x3"), ("gemv", 32, "gemv"), ("gemv", 257, "bf16x3"), ("bf16x3", 1, "bf16x3")):
        monkeypatch.setenv("ATB_CUDA_F32_LINEAR", value)
        assert _f32_path(m) == want, (value, m)
    monkeypatch.setenv("ATB_CUDA_F32_LINEAR", "fast")
    with pytest.raises(ValueError, match="ATB_CUDA_F32_LINEAR"):
        _f32_path(1)


@pytest.mark.cuda
def test_cuda_runner_compacts_and_logits_stay(monkeypatch):
    """The CUDA op over a BF16 weight (three BF16 parts of the float32 input, one cuBLAS GEMM with float32 output)
    is as accurate as a float32 GEMM against a float64 oracle, at the head's row counts and prefill sizes; a CUDA
    runner compacts, and the model's logits stay those of the same model kept in float32 (1e-5 relative)."""
    import parallel.linear
    from atb_ops.cuda.gemm import linear
    from v4_helpers import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 512, device="cuda", generator=g).bfloat16()
    for path in ("auto", "gemv", "bf16x3"):  # auto is bf16x3; gemv covers M <= 256, bf16x3 beyond
        monkeypatch.setenv("ATB_CUDA_F32_LINEAR", path)
        for m in (1, 7, 64, 256, 300, 2048):
            x = torch.randn(m, 512, device="cuda", generator=g) * torch.logspace(-3, 3, 512, device="cuda")
            y = linear(x, w)
            assert y.dtype == torch.float32 and y.shape == (m, 1000)
            ref = x.double() @ w.double().t()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-6, (path, m, err)
    monkeypatch.delenv("ATB_CUDA_F32_LINEAR")
    model = _model(bf16_values=True, device="cuda")
    compacted = _logits(model, "cuda", backend="cuda")
    assert all(m.weight.dtype == torch.bfloat16 for m in _fp32_linears(model).values())
    monkeypatch.setattr(parallel.linear, "compact_fp32_weights_", lambda model: 0)
    kept = _model(bf16_values=True, device="cuda")
    assert rel_err(_logits(kept, "cuda", backend="cuda"), compacted) < 1e-5
    assert all(m.weight.dtype == torch.float32 for m in _fp32_linears(kept).values())


def test_split3_is_exact_through_the_kernel():
    """The one-launch three-part split (Triton's interpreter off the GPU): x1 + x2 + x3 == x in float64, every
    part BF16, zeros and signs kept; what _bf16x3 feeds to its BF16 GEMM."""
    pytest.importorskip("triton")
    from atb_ops.cuda.gemm import split3

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 777, generator=g) * torch.logspace(-30, 30, 777)).to(dev)
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
    parts = split3(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 5, 777)
    total = parts.double().sum(0)
    assert torch.equal(total, x.double())
    # each later part is below the previous part's last bit (x1 rounds or truncates x, as the converter does)
    assert (parts[1].double().abs() <= parts[0].double().abs() * 2.0**-7).all()
    assert (parts[2].double().abs() <= parts[1].double().abs() * 2.0**-7).all()


def test_init_random_rounds_to_bf16_in_place_exactly():
    """init_random_'s in-place rounding of the float32-compute weights to the BF16 grid (integer ops on the float32
    bits) equals the two conversions it replaces, on ties (to even, both signs), subnormals and the largest
    exponents; and the toy model's values are those of the two-conversion form."""
    from ascend_dsv4.weights.random_init import _round_to_bf16_

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300_007, generator=g) * torch.exp2(torch.randint(-149, 127, (300_007,), generator=g).float())
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), -(1 + 3 * 2.0**-8), 2.0**-130 * 3, 0.0, -0.0,
                         3.3895e38, -3.3895e38])
    x = torch.cat([ties, x[torch.isfinite(x)]])
    y = x.clone()
    _round_to_bf16_(y)
    assert torch.equal(y.view(torch.int32), x.bfloat16().float().view(torch.int32))
    model = init_random_(DeepseekV4Model(toy_cfg(), torch.float32, "exact"), 1)
    for m in _fp32_linears(model).values():
        assert bf16_exact(m.weight)
