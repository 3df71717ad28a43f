"""Reference ops add_rms_norm and kv_quant: their definitions, edge cases, and the V3 layer's use of the fused norm."""

import pytest
import torch

import atb_ops

g = torch.Generator().manual_seed(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7])
def test_add_rms_norm_is_the_unfused_math(dtype, t):
    x, r = torch.randn(t, 32, generator=g).to(dtype), torch.randn(t, 32, generator=g).to(dtype)
    w = torch.randn(32, generator=g)
    y, h = atb_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and h.dtype == dtype
    assert torch.equal(y, atb_ops.rms_norm(x + r, w, 1e-6))
    y0, _ = atb_ops.add_rms_norm(x, r, None, 1e-6)
    assert torch.equal(y0, atb_ops.rms_norm(x + r, None, 1e-6))


def test_kv_quant_definition():
    x = torch.tensor([[0.5, -0.5, 1.5, 2.5, 1000.0, -1000.0]])
    inv = torch.ones(6)
    off = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    q = atb_ops.kv_quant(x, inv, off)
    assert q.dtype == torch.int8
    assert q.tolist() == [[0, 0, 2, 2, 127, -128]]  # half to even, saturated, offset added before rounding
    assert atb_ops.kv_quant(torch.empty(0, 6), inv, None).shape == (0, 6)


def test_kv_quant_matches_msmodelslim_reciprocal_quantiser():
    from quant.msmodelslim.schemes import KVCacheQuant

    s = 0.01 + torch.rand(16, generator=g) * 0.02
    o = torch.randint(-3, 4, (16,), generator=g).float()
    x = torch.randn(5, 16, generator=g)
    kq = KVCacheQuant(s, o, reciprocal=True)
    assert torch.equal(atb_ops.kv_quant(x, 1.0 / s, o), kq.quantize(x))


def test_v3_layer_fused_norm_equals_unfused():
    from ascend_dsv4.layers.norm import RMSNorm, add_norm

    n = RMSNorm(8, 1e-6)
    n.weight.copy_(torch.randn(8, generator=g))
    x, r = torch.randn(3, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g).bfloat16()
    y, h = add_norm(n, x, r)
    assert torch.equal(h, x + r) and torch.equal(y, n(x + r))

    class Other(torch.nn.Module):  # e.g. an msModelSlim smoothed norm put in place of the RMSNorm at load
        def forward(self, v):
            return v * 2

    y2, h2 = add_norm(Other(), x, r)
    assert torch.equal(h2, x + r) and torch.equal(y2, (x + r) * 2)
