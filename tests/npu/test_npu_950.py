"""Ascend 950 resolution: hc_pre / hc_post on torch_npu's npu_mhc_pre / npu_mhc_sinkhorn / npu_mhc_post (documented
for Ascend 950PR/DT only; A2/A3 keep the composition), through the emulation, contracts replayed."""

import pytest
import torch

import atb_ops
from atb_ops._dispatch import _registry


@pytest.fixture(scope="module")
def emu950():
    from atb_ops.npu import emulation

    if emulation.real_torch_npu_available():
        pytest.skip("the real torch_npu is installed")
    mod = emulation.install(soc="Ascend950PR")
    yield mod
    emulation.uninstall()


@pytest.fixture
def checker950(emu950, oracle):
    from atb_ops.npu.contracts import ContractChecker

    ck = ContractChecker(oracle).attach(emu950)
    yield ck
    ck.detach()
    assert not ck.violations, ck.violations


def test_a2_keeps_the_composition():
    from atb_ops.npu import emulation, optable

    if emulation.real_torch_npu_available():
        pytest.skip("the real torch_npu is installed")
    emulation.install()
    try:
        assert optable.table()["hc_pre"].kind == "composed"
    finally:
        emulation.uninstall()


@pytest.mark.parametrize("t", [1, 5])
def test_mhc_ops_match_reference(emu950, checker950, t):
    from atb_ops.npu import optable

    optable.reset()
    tbl = optable.table()
    assert tbl["hc_pre"].kind == "torch_npu" and tbl["hc_post"].kind == "torch_npu"
    gen = torch.Generator().manual_seed(t)
    n, d = 4, 64
    x = torch.randn(t, n, d, generator=gen).to(torch.bfloat16)
    fn, base, scale = torch.randn((2 + n) * n, n * d, generator=gen) * 0.05, torch.randn((2 + n) * n, generator=gen), \
        torch.randn(3, generator=gen)
    with atb_ops.use_backend("npu"):
        got = atb_ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    want = _registry["reference"]["hc_pre"](x, fn, base, scale, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())
    y, post, comb = torch.randn(t, d, generator=gen).to(torch.bfloat16), torch.rand(t, n, generator=gen), \
        torch.rand(t, n, n, generator=gen)
    with atb_ops.use_backend("npu"):
        o = atb_ops.hc_post(y, x, post, comb)
    r = _registry["reference"]["hc_post"](y, x, post, comb)
    assert o.dtype == r.dtype and float((o.float() - r.float()).abs().max()) <= 2e-2 * float(r.float().abs().max())
    assert set(checker950.ops) >= {"npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post"}


def test_toy_v4_bf16_on_950(emu950, checker950):
    from ascend_dsv4 import LLM
    from atb_ops.npu import optable

    optable.reset()
    ids = [1, 5, 9, 100, 33, 7, 81, 14, 2, 3]
    ref = LLM(model="toy-v4", backend="reference", device="cpu", dtype="bfloat16", progress=False).logits(ids, 7)
    got = LLM(model="toy-v4", backend="npu", device="cpu", dtype="bfloat16", progress=False).logits(ids, 7)
    assert optable.table()["hc_pre"].calls > 0
    assert float((got - ref).norm() / ref.norm()) <= 1e-3  # bfloat16 end to end [measured: bitwise equal]
