"""add_rms_norm and kv_quant on the NPU backend against the reference op (random and edge-case inputs), and the
emulated FIA's paged form and per-channel int8 (antiquant) KV against a direct transcription of the documented
formula; every torch_npu call replayed on the wheel's contracts."""

import math

import pytest
import torch

import atb_ops
from atb_ops._dispatch import _registry

g = torch.Generator().manual_seed(7)


def rnd(*s, dtype=torch.float32):
    return torch.randn(*s, generator=g).to(dtype)


def npu(op, *args):
    with atb_ops.use_backend("npu"):
        return getattr(atb_ops, op)(*args)


@pytest.fixture(autouse=True)
def _contracts(checker):
    yield
    assert not checker.violations, checker.violations


@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_add_rms_norm(t, dtype, weighted, checker):
    x, r = rnd(t, 24, dtype=dtype), rnd(t, 24, dtype=dtype)
    w = rnd(24) if weighted else None
    y, h = npu("add_rms_norm", x, r, w, 1e-6)
    ry, rh = _registry["reference"]["add_rms_norm"](x, r, w, 1e-6)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    assert torch.equal(h, rh)  # the sum is the same rounding of x + r
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert y.numel() == 0 or float((y.float() - ry.float()).abs().max()) <= tol
    if t:
        assert checker.ops["npu_add_rms_norm"].checked > 0


def test_add_rms_norm_is_add_then_rms_norm():
    x, r, w = rnd(3, 16, dtype=torch.bfloat16), rnd(3, 16, dtype=torch.bfloat16), rnd(16)
    y, h = atb_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r) and torch.equal(y, atb_ops.rms_norm(x + r, w, 1e-5))


@pytest.mark.parametrize("shape", [(0, 8), (1, 8), (4, 3, 8)])
@pytest.mark.parametrize("asym", [False, True])
def test_kv_quant(shape, asym):
    x = rnd(*shape) * 3
    if x.numel():
        x[..., 0], x[..., 1] = 100.0, -100.0  # far past the int8 range: saturation
    inv = 1.0 / (0.01 + torch.rand(8, generator=g) * 0.05)
    off = torch.randint(-5, 6, (8,), generator=g).float() if asym else None
    q = npu("kv_quant", x, inv, off)
    want = _registry["reference"]["kv_quant"](x, inv, off)
    assert q.dtype == torch.int8 and torch.equal(q, want)
    if x.numel():
        assert int(q.min()) == -128 and int(q.max()) == 127
        direct = torch.round(x * inv + (0 if off is None else off)).clamp(-128, 127).to(torch.int8)
        assert torch.equal(q, direct)


# ---- emulated FIA: paged form + per-channel antiquant, against a transcription ---------------------------------

def _fia_transcribed(q, kc, vc, bt, bs, lens, nkv, scale, ks=None, ko=None, vs=None, vo=None):
    """softmax(scale * q k^T) v per batch / head, key j of batch b at row j % bs of block bt[b, j // bs] of the
    BnBsH cache [blocks, bs, N_kv * D]; int8 rows read back as (kv + offset) * scale per channel."""
    b, s, n, d = q.shape
    dv = vc.shape[-1] // nkv
    out = torch.zeros(b, s, n, dv)
    for bi in range(b):
        for h in range(n):
            kh = h // (n // nkv)
            for si in range(s):
                scores, vals = [], []
                for j in range(int(lens[bi])):
                    blk, row = int(bt[bi, j // bs]), j % bs
                    k = kc[blk, row].float().view(nkv, -1)[kh]
                    v = vc[blk, row].float().view(nkv, -1)[kh]
                    if ks is not None:
                        k = (k + ko.view(nkv, -1)[kh]) * ks.view(nkv, -1)[kh]
                        v = (v + vo.view(nkv, -1)[kh]) * vs.view(nkv, -1)[kh]
                    scores.append(scale * float(q[bi, si, h].float() @ k))
                    vals.append(v)
                if scores:
                    m = max(scores)
                    e = [math.exp(x - m) for x in scores]
                    out[bi, si, h] = sum(w / sum(e) * v for w, v in zip(e, vals))
    return out


@pytest.mark.parametrize("int8", [False, True])
def test_fia_paged_form(emu, checker, int8):
    bs, blocks, nkv, n, d = 16, 6, 2, 4, 8
    lens = torch.tensor([1, 20, 0])  # one key, more than one block, none
    bt = torch.tensor([[4, -1], [2, 5], [-1, -1]], dtype=torch.int32)  # non-contiguous pages, -1 unused
    q = rnd(3, 1, n, d)
    if int8:
        kc = torch.randint(-128, 128, (blocks, bs, nkv * d), generator=g, dtype=torch.int8)
        vc = torch.randint(-128, 128, (blocks, bs, nkv * d), generator=g, dtype=torch.int8)
        ks, vs = torch.rand(1, nkv * d, generator=g) * 0.02 + 0.005, torch.rand(1, nkv * d, generator=g) * 0.02 + 0.005
        ko, vo = torch.randint(-4, 5, (1, nkv * d), generator=g).float(), torch.randint(-4, 5, (1, nkv * d), generator=g).float()
        kw = dict(key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
                  value_antiquant_offset=vo, key_antiquant_mode=0, value_antiquant_mode=0)
    else:
        kc, vc = rnd(blocks, bs, nkv * d), rnd(blocks, bs, nkv * d)
        ks = ko = vs = vo = None
        kw = {}
    out, _ = emu.npu_fused_infer_attention_score(
        q, kc, vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens.tolist(), num_heads=n,
        num_key_value_heads=nkv, scale=0.3, input_layout="BSND", **kw)
    want = _fia_transcribed(q, kc, vc, bt, bs, lens, nkv, 0.3, ks, ko, vs, vo)
    assert out.shape == (3, 1, n, d)
    assert float((out - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert not checker.violations and checker.ops["npu_fused_infer_attention_score"].checked > 0


def test_fia_paged_refuses_wrong_block_size(emu):
    with pytest.raises(RuntimeError, match="block_size"):
        emu.npu_fused_infer_attention_score(
            rnd(1, 1, 2, 8), rnd(2, 16, 16), rnd(2, 16, 16), block_table=torch.zeros(1, 1, dtype=torch.int32),
            block_size=32, actual_seq_lengths_kv=[3], num_heads=2, num_key_value_heads=2, input_layout="BSND")
