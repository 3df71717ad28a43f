"""FP8 storage of DeepSeek-V4's ``wo_a`` (parallel.linear.compact_fp8_weights_): FP8 in the official checkpoint and
dequantised at load for the grouped output projection; where its values are FP8 blocks (e4m3 codes times a power of
two per 128 x 128 block) the CUDA runner stores it back in FP8, half its bytes, and ``atb_ops.group_linear`` takes
either storage with the same results: the reference op dequantises it to the BF16 matrix the load gave (bitwise
the same logits), the CUDA op runs the FP8 gemv kernel (up to 8 tokens) or dequantises it to BF16 for cuBLAS."""

from __future__ import annotations

import pytest
import torch

import atb_ops
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_
from parallel.linear import Linear, compact_fp8_weights_
from quant.fp8_block import dequant_fp8_block, quant_fp8_block
from v4_helpers import SMALL_POOLS, rel_err, toy_cfg, two_sequence_logits


def _wo_a(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n.endswith("attn.wo_a")}


def _model(on_grid: bool = True, device="cpu"):
    """A bfloat16 toy V4 whose wo_a holds what loading the FP8 checkpoint gives (on_grid), or random BF16 values."""
    model = init_random_(DeepseekV4Model(toy_cfg(index_topk=128), torch.bfloat16, "exact"), 0).eval()
    if on_grid:
        with torch.no_grad():
            for m in _wo_a(model).values():
                q, s = quant_fp8_block(m.weight.float() * 8)  # (x8: some blocks' scales above 2^0)
                m.weight.copy_(dequant_fp8_block(q, s, dtype=torch.bfloat16))
    return model.to(device)


def test_compaction_keeps_every_logit_bitwise():
    model = _model()
    before = two_sequence_logits(model)
    mods = _wo_a(model)
    assert len(mods) == model.cfg.n_layers + model.cfg.n_mtp_layers and all(m.fp8_compact for m in mods.values())
    dense = {n: m.weight.clone() for n, m in mods.items()}
    freed = compact_fp8_weights_(model)
    assert freed == sum(w.numel() - w.numel() // 128**2 for w in dense.values())
    for n, m in mods.items():
        assert m.fmt == "fp8_block" and m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.uint8
        assert torch.equal(dequant_fp8_block(m.weight, m.scale, dtype=torch.bfloat16), dense[n])
    assert compact_fp8_weights_(model) == 0  # idempotent
    assert torch.equal(two_sequence_logits(model), before)


def test_values_off_the_fp8_grid_stay_dense():
    model = _model(on_grid=False)
    assert compact_fp8_weights_(model) == 0
    assert all(m.fmt == "dense" and m.weight.dtype == torch.bfloat16 for m in _wo_a(model).values())


def test_unmarked_linears_and_other_dtypes_stay():
    model = _model()
    for m in _wo_a(model).values():
        m.fp8_compact = False
    assert compact_fp8_weights_(model) == 0
    f32 = init_random_(DeepseekV4Model(toy_cfg(index_topk=128), torch.float32, "exact"), 0)
    assert compact_fp8_weights_(f32) == 0  # float32 wo_a: not a 16-bit weight


def test_cpu_runner_leaves_the_weights_as_they_are():
    model = _model()
    ModelRunner(model, SMALL_POOLS, "cpu")
    assert all(m.fmt == "dense" for m in _wo_a(model).values())


def test_group_linear_fp8_reference_is_the_dequantised_weight():
    """The reference op over FP8 equals the op over the dequantised BF16 matrix, bitwise (both backends of the CPU:
    the reference and the batch-invariant one); an unknown format is refused."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 256, generator=g).bfloat16()
    q, s = quant_fp8_block(torch.randn(3, 384, 256, generator=g))
    wd = dequant_fp8_block(q, s, dtype=torch.bfloat16)
    assert torch.equal(atb_ops.group_linear(x, q, s, "fp8_block"), atb_ops.group_linear(x, wd))
    with atb_ops.batch_invariant():
        assert torch.equal(atb_ops.group_linear(x, q, s, "fp8_block"), atb_ops.group_linear(x, wd))
    with pytest.raises(ValueError, match="group_linear: fmt"):
        atb_ops.group_linear(x, q, s, "fp4")
    for bad in (None, s[:1], s[:, :1]):  # a missing or misshaped scale grid: named, with the shape it must have
        with pytest.raises(ValueError, match=r"group_linear: fp8_block w_scale must be \(3, 3, 2\)"):
            atb_ops.group_linear(x, q, bad, "fp8_block")


def test_wo_a_fp8_switch(monkeypatch):
    from ascend_dsv4.engine.model_runner import wo_a_fp8

    monkeypatch.delenv("ASCEND_DSV4_WO_A_FP8", raising=False)
    assert not wo_a_fp8()
    monkeypatch.setenv("ASCEND_DSV4_WO_A_FP8", "1")
    assert wo_a_fp8()
    monkeypatch.setenv("ASCEND_DSV4_WO_A_FP8", "yes")
    with pytest.raises(ValueError, match="ASCEND_DSV4_WO_A_FP8"):
        wo_a_fp8()


@pytest.mark.cuda
def test_cuda_runner_compacts_on_request_and_logits_stay(monkeypatch):
    """With ASCEND_DSV4_WO_A_FP8=1 a CUDA runner stores wo_a in FP8; the bf16 logits (prefill: the dequantise +
    cuBLAS path, decode: the gemv) stay those of the same model with wo_a kept dense (the default), and those of
    the CPU reference."""
    monkeypatch.setenv("ASCEND_DSV4_WO_A_FP8", "1")
    model = _model(device="cuda")
    got = two_sequence_logits(model, "cuda", backend="cuda")
    assert all(m.fmt == "fp8_block" for m in _wo_a(model).values())
    monkeypatch.delenv("ASCEND_DSV4_WO_A_FP8")
    kept = _model(device="cuda")
    want = two_sequence_logits(kept, "cuda", backend="cuda")
    assert all(m.fmt == "dense" for m in _wo_a(kept).values())
    assert rel_err(got, want) < 2e-2 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    cpu = two_sequence_logits(_model())
    assert rel_err(got, cpu) < 3e-2
