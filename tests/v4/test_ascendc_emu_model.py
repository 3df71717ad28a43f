"""Whole models with backend="ascendc_emu": the compressor and the decode attention run in the AscendC kernel sources
(compiled for the host against our emulation), every other op in the reference; logits against the reference
backend. V4: toy model (float32 and bfloat16) and a random checkpoint in the official FP8/FP4 format; V3: toy MLA."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.weights.random_checkpoint import write_checkpoint
from atb_ops.ascendc.emu import backend, build
from v4_helpers import rel_err

IDS = torch.randint(0, 1024, (160,), generator=torch.Generator().manual_seed(0)).tolist()
OVER = dict(index_topk=64)


@pytest.fixture(scope="session", autouse=True)
def emu_lib():
    return build.load()


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel launches, so a test cannot pass by silently running the reference."""
    n = {"compressor": 0, "attention": 0}

    def wrap(fn, key):
        def run(*a, **k):
            n[key] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(backend, "run_compressor", wrap(backend.run_compressor, "compressor"))
    monkeypatch.setattr(backend, "run_mla", wrap(backend.run_mla, "attention"))
    return n


@pytest.mark.parametrize("variant", ["cube", "vector"])
def test_toy_v4_float32_matches_reference(calls, monkeypatch, variant):
    monkeypatch.setenv("ASCEND_DSV4_ASCENDC_MLA", variant)  # both attention kernels (the default picks cube here)
    fused = []  # the compressors' entry path on the kernel's fused RMSNorm + RoPE epilogue (atb_ops.compressor_entries)
    epilogue = backend.compressor_pool_norm_rope
    monkeypatch.setattr(backend, "compressor_pool_norm_rope", lambda *a: fused.append(1) or epilogue(*a))
    ref = LLM(model="toy-v4", device="cpu", dtype="float32", config_overrides=OVER, progress=False)
    emu = LLM(model="toy-v4", backend="ascendc_emu", dtype="float32", config_overrides=OVER, progress=False)
    assert emu.device.type == "cpu"
    a, b = ref.logits(IDS[:120], prefill_len=100), emu.logits(IDS[:120], prefill_len=100)
    assert rel_err(b, a) < 1e-4
    # 21 steps x 7 layers of attention; compressors on the 5 compressed layers (+ 3 indexer compressors)
    assert calls["attention"] == 21 * 7 and calls["compressor"] > 0 and fused


def test_toy_v4_bfloat16_every_kernel_call_matches_the_reference_op(monkeypatch):
    # End-to-end bf16 logits are chaotic (a one-ulp difference in an attention output can flip an indexer top-k
    # choice later), so in bf16 each kernel call inside the model is checked against the reference op on the same
    # inputs: equal up to the rounding of the bf16 output (float32 math inside both).
    from atb_ops import _dispatch

    seen = {}
    for op, tol in (("compressor_pool", 1e-5), ("sparse_attention", 2 ** -7)):
        kernel, spec = _dispatch._registry["ascendc_emu"][op], _dispatch._registry["reference"][op]

        def checked(*args, kernel=kernel, spec=spec, op=op, tol=tol):
            out, exp = kernel(*args), spec(*args)
            assert out.dtype == exp.dtype and out.shape == exp.shape
            torch.testing.assert_close(out.float(), exp.float(), rtol=tol, atol=tol * exp.float().abs().max().item())
            seen[op] = seen.get(op, 0) + 1
            return out

        monkeypatch.setitem(_dispatch._registry["ascendc_emu"], op, checked)
    emu = LLM(model="toy-v4", backend="ascendc_emu", dtype="bfloat16", config_overrides=OVER, progress=False)
    logits = emu.logits(IDS[:80], prefill_len=70)
    assert torch.isfinite(logits).all()
    assert seen["sparse_attention"] == 11 * 7 and seen["compressor_pool"] > 0


def test_official_fp8_fp4_checkpoint_matches_reference(tmp_path, calls):
    cfg = preset("toy-v4").replace(index_topk=64, vocab_size=512, n_routed_experts=8)
    write_checkpoint(cfg, str(tmp_path), "official", seed=3, shard_bytes=2 << 20, progress=False)
    ids = [i % 512 for i in IDS[:100]]
    ref = LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False)
    emu = LLM(model=str(tmp_path), backend="ascendc_emu", dtype="float32", progress=False)
    assert emu.model.layers[2].attn.wq_a.weight.dtype == torch.float8_e4m3fn  # kept in checkpoint format
    assert rel_err(emu.logits(ids, prefill_len=90), ref.logits(ids, prefill_len=90)) < 1e-4
    assert calls["attention"] > 0 and calls["compressor"] > 0


def test_v3_fp8_checkpoint_mla_decode_matches_reference(tmp_path, calls):
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint

    cfg = preset("toy-v3").replace(n_layers=2, n_dense_layers=1, n_routed_experts=4, n_expert_groups=1,
                                   n_limited_groups=1)
    write_checkpoint(cfg, str(tmp_path), seed=2, progress=False)  # DeepSeek's HF format, FP8 128x128 blocks
    ids = [i % 1000 + 3 for i in IDS[:60]]
    ref = LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False)
    emu = LLM(model=str(tmp_path), backend="ascendc_emu", dtype="float32", progress=False)
    assert rel_err(emu.logits(ids, prefill_len=52), ref.logits(ids, prefill_len=52)) < 1e-4
    assert calls["attention"] == 8 * ref.cfg.n_layers


@pytest.mark.parametrize("variant", ["cube", "vector"])
def test_toy_v3_mla_decode_matches_reference(calls, monkeypatch, variant):
    monkeypatch.setenv("ASCEND_DSV4_ASCENDC_MLA", variant)
    ids = [i % 1000 + 3 for i in IDS[:110]]
    ref = LLM(model="toy-v3", device="cpu", dtype="float32", progress=False)
    emu = LLM(model="toy-v3", backend="ascendc_emu", dtype="float32", progress=False)
    assert rel_err(emu.logits(ids, prefill_len=100), ref.logits(ids, prefill_len=100)) < 1e-4
    assert calls["attention"] == 10 * ref.cfg.n_layers and calls["compressor"] == 0
