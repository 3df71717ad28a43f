"""Each emulated torch_npu op against a direct (loop-level) transcription of its documented formula.

Formulas: the torch_npu API documentation and the op-plugin CPU goldens. The transcriptions below are
written element by element or row by row on purpose, independently of the vectorised emulation.
"""

import math

import pytest
import torch

from atb_ops.npu.emu import attention as A
from atb_ops.npu.emu import moe as M
from atb_ops.npu.emu import norm_rope as N
from atb_ops.npu.emu import quant as Q
from atb_ops.npu.emu.common import NotEmulated

g = torch.Generator().manual_seed(0)


def rnd(*s, dtype=torch.float32):
    return torch.randn(*s, generator=g).to(dtype)


def test_rms_norm_reduces_over_gamma_dims_and_casts_once():
    x, gamma = rnd(3, 4, 8, dtype=torch.bfloat16), rnd(4, 8)
    y, rstd = N.npu_rms_norm(x, gamma, epsilon=1e-5)
    assert y.dtype == torch.bfloat16 and rstd.shape == (3, 1, 1) and rstd.dtype == torch.float32
    for i in range(3):
        xi = x[i].float()
        r = 1.0 / math.sqrt(float((xi * xi).sum()) / xi.numel() + 1e-5)
        assert abs(float(rstd[i, 0, 0]) - r) <= 1e-6 * r
        assert torch.equal(y[i], (xi * r * gamma).to(torch.bfloat16)) or \
            float((y[i].float() - xi * r * gamma).abs().max()) <= 1e-2


def test_add_rms_norm_outputs_normed_rstd_sum():
    x1, x2, gm = rnd(5, 16), rnd(5, 16), rnd(16)
    y, rstd, s = N.npu_add_rms_norm(x1, x2, gm)
    assert torch.equal(s, x1 + x2)
    assert torch.allclose(y, N.npu_rms_norm(x1 + x2, gm)[0])


def test_rotary_mul_interleave_is_pairwise_complex_rope():
    t, h, d = 3, 2, 8
    x, ang = rnd(t, h, d), rnd(t, d // 2)
    cos = ang.cos().repeat_interleave(2, -1).view(t, 1, d)
    sin = ang.sin().repeat_interleave(2, -1).view(t, 1, d)
    y = N.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    rot = torch.polar(torch.ones_like(ang), ang).view(t, 1, -1)
    z = torch.view_as_complex(x.view(t, h, d // 2, 2).contiguous()) * rot
    assert torch.allclose(y, torch.view_as_real(z).flatten(-2), atol=1e-6)


def test_rotary_mul_half_mode():
    x, c, s = rnd(2, 3, 4), rnd(1, 1, 4), rnd(1, 1, 4)
    y = N.npu_rotary_mul(x, c, s, rotary_mode="half")
    for i in range(4):
        other = -x[..., i + 2] if i < 2 else x[..., i - 2]
        assert torch.allclose(y[..., i], x[..., i] * c[..., i] + other * s[..., i])


def test_rotary_mul_refuses_rotate_matrix():
    with pytest.raises(NotEmulated):
        N.npu_rotary_mul(rnd(1, 1, 4), rnd(1, 1, 4), rnd(1, 1, 4), rotate=torch.eye(4))


def test_swiglu_silu_on_left_half():
    x = rnd(3, 10)
    y = N.npu_swiglu(x, dim=-1)
    a, b = x[:, :5], x[:, 5:]
    assert torch.allclose(y, a / (1 + torch.exp(-a)) * b, atol=1e-6)


def test_dynamic_quant_per_token():
    x = rnd(4, 32)
    x[2] = 0
    y, s = Q.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and s.shape == (4,)
    for r in (0, 1, 3):
        sr = float(x[r].abs().max()) / 127
        assert abs(float(s[r]) - sr) <= 1e-7 * sr
        assert torch.equal(y[r], torch.round(x[r] / s[r]).to(torch.int8))
    assert float(s[2]) == 0 and int(y[2].abs().max()) == 0


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantize_div_mode_equals_quantize_per_channel():
    x = rnd(6, 5) * 3
    sc = torch.rand(5, generator=g) + 0.05
    zp = torch.randint(-3, 4, (5,), generator=g)
    q = Q.npu_quantize(x, sc, zp, torch.qint8, axis=1, div_mode=True)
    want = torch.quantize_per_channel(x, sc.double(), zp, 1, torch.qint8).int_repr()
    assert torch.equal(q, want)
    q2 = Q.npu_quantize(x, sc, zp.float(), torch.qint8, axis=1, div_mode=False)
    assert torch.equal(q2, torch.round(x * sc + zp).clamp(-128, 127).to(torch.int8))  # multiplied, not divided


def test_trans_quant_param_bits():
    s = torch.tensor([1.0, 0.1234567, 3.0e-3])
    out = Q.npu_trans_quant_param(s)
    for i, v in enumerate(s.tolist()):
        bits = torch.tensor([v]).view(torch.int32).item() & 0xFFFFFFFF
        assert int(out[i]) == (bits & 0xFFFFE000) | (1 << 46)
    o = Q.npu_trans_quant_param(s, torch.tensor([-3.0, 2.0, 300.0]))
    assert (int(o[0]) >> 37) & 0x1FF == (-3) & 0x1FF and (int(o[2]) >> 37) & 0x1FF == 255


def _pack_lsb_first(v: torch.Tensor) -> torch.Tensor:
    k, n = v.shape
    out = torch.zeros(k, n // 8, dtype=torch.int64)
    for j in range(n):
        out[:, j // 8] |= (v[:, j].to(torch.int64) & 0xF) << (4 * (j % 8))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_quant_matmul_pertoken_and_int4_packing():
    x1 = torch.randint(-128, 128, (3, 16), generator=g, dtype=torch.int8)
    x2 = torch.randint(-8, 8, (16, 8), generator=g, dtype=torch.int8)
    sc, pt = torch.rand(8, generator=g), torch.rand(3, generator=g)
    y = Q.npu_quant_matmul(x1, x2, sc, pertoken_scale=pt, output_dtype=torch.float32)
    for m in range(3):
        for n in range(8):
            acc = sum(int(x1[m, k]) * int(x2[k, n]) for k in range(16))
            assert abs(float(y[m, n]) - acc * float(sc[n]) * float(pt[m])) <= 1e-4 * (1 + abs(acc))
    y4 = Q.npu_quant_matmul(x1, _pack_lsb_first(x2), sc, pertoken_scale=pt, output_dtype=torch.float32)
    assert torch.equal(y4, y)
    raw = Q.npu_quant_matmul(x1, x2, sc, bias=torch.arange(8, dtype=torch.int32), output_dtype=torch.int32)
    assert torch.equal(raw, (x1.long() @ x2.long() + torch.arange(8)).int())
    with pytest.raises(NotEmulated):
        Q.npu_quant_matmul(x1, x2, sc)  # int8 output (requantisation)


def test_quant_matmul_int64_scale_low_word():
    x1 = torch.ones(1, 4, dtype=torch.int8)
    x2 = torch.ones(4, 2, dtype=torch.int8)
    words = Q.npu_trans_quant_param(torch.tensor([0.5, 0.25]))
    y = Q.npu_quant_matmul(x1, x2, words, output_dtype=torch.float32)
    assert torch.equal(y, torch.tensor([[2.0, 1.0]]))


def test_weight_quant_batchmatmul_adds_offset():
    x, w = rnd(2, 64), torch.randint(-128, 128, (64, 4), generator=g, dtype=torch.int8)
    sc, off = torch.rand(4, generator=g), torch.randn(4, generator=g)
    y = Q.npu_weight_quant_batchmatmul(x, w, sc, off)
    assert torch.allclose(y, x @ ((w.float() + off) * sc), atol=1e-4)  # (w + offset) * scale: offset ADDED
    gsc, goff = torch.rand(2, 4, generator=g), torch.randn(2, 4, generator=g)
    yg = Q.npu_weight_quant_batchmatmul(x, w, gsc, goff, antiquant_group_size=32)
    want = torch.zeros(2, 4)
    for kk in range(64):
        want += x[:, kk:kk + 1] * ((w[kk].float() + goff[kk // 32]) * gsc[kk // 32])
    assert torch.allclose(yg, want, atol=1e-4)


def _gating_numpy_style(x, k, bias, k_group, group_count, norm_type, rsf, eps):
    """The torch_npu doc's numpy reference, row by row."""
    ys, ids = [], []
    for row in x.float():
        s = row.softmax(-1) if norm_type == 0 else row.sigmoid()
        sb = s + bias
        e = sb.numel()
        if group_count > 1:
            grp = sb.view(group_count, e // group_count)
            gscore = [float(sum(sorted(r.tolist(), reverse=True)[:2])) for r in grp]
            keep = sorted(range(group_count), key=lambda i: (-gscore[i], i))[:k_group]
            sb = torch.stack([grp[i] if i in keep else torch.full_like(grp[i], -math.inf)
                              for i in range(group_count)]).flatten()
        order = sorted(range(e), key=lambda i: (-float(sb[i]), i))[:k]
        y = s[order]
        if norm_type == 1:
            y = y / (y.sum() + eps)
        ys.append(y * rsf)
        ids.append(order)
    return torch.stack(ys), torch.tensor(ids)


@pytest.mark.parametrize("norm_type,groups", [(1, (8, 4)), (0, (1, 1)), (1, (1, 1))])
def test_moe_gating_top_k(norm_type, groups):
    x, bias = rnd(5, 32), rnd(32) * 0.1
    gc, kg = groups
    y, idx, _ = M.npu_moe_gating_top_k(x, 6, bias=bias, k_group=kg, group_count=gc, group_select_mode=1,
                                       norm_type=norm_type, routed_scaling_factor=2.5)
    wy, wi = _gating_numpy_style(x, 6, bias, kg, gc, norm_type, 2.5, 1e-20)
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), wi)
    assert torch.allclose(y, wy, atol=1e-6)


def test_moe_gating_hash_routing():
    x = rnd(3, 16)
    tid2eid = torch.randint(0, 16, (50, 4), generator=g)
    ids = torch.tensor([3, 49, 0])
    y, idx, _ = M.npu_moe_gating_top_k(x, 4, input_ids=ids, tid2eid=tid2eid, norm_type=1)
    assert torch.equal(idx.long(), tid2eid[ids])


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_group_list(group_list_type):
    counts = [3, 0, 2, 1]
    x, w = rnd(7, 5), rnd(4, 5, 6)  # one row past the groups
    gl = torch.tensor(counts) if group_list_type == 1 else torch.tensor(counts).cumsum(0)
    y = M.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0, group_list_type=group_list_type)[0]
    row = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            assert torch.allclose(y[row], x[row] @ w[e], atol=1e-5)
            row += 1
    assert torch.isnan(y[row:]).all()  # undefined on the device: poisoned, so that no caller can rely on it


def test_fia_bsnd_mla_split_lengths_and_gqa():
    b, s, n, nkv, d, r, s2 = 2, 1, 4, 2, 8, 4, 5
    q, qr = rnd(b, s, n, d), rnd(b, s, n, r)
    k, kr, v = rnd(b, s2, nkv, d), rnd(b, s2, nkv, r), rnd(b, s2, nkv, 6)
    lens = [5, 2]
    out, lse = A.npu_fused_infer_attention_score(q, k, v, query_rope=qr, key_rope=kr, actual_seq_lengths_kv=lens,
                                                 num_heads=n, num_key_value_heads=nkv, scale=0.3, input_layout="BSND",
                                                 softmax_lse_flag=True)
    for bi in range(b):
        for h in range(n):
            kh = h // (n // nkv)
            sc = [0.3 * (float(q[bi, 0, h] @ k[bi, j, kh]) + float(qr[bi, 0, h] @ kr[bi, j, kh]))
                  for j in range(lens[bi])]
            mx = max(sc)
            p = [math.exp(z - mx) for z in sc]
            want = sum(pi * v[bi, j, kh] for j, pi in enumerate(p)) / sum(p)
            assert torch.allclose(out[bi, 0, h], want, atol=1e-5)
            assert abs(float(lse[bi, h, 0, 0]) - (math.log(sum(p)) + mx)) < 1e-5


def test_lightning_indexer_scores_topk_and_padding():
    b, s1, n, d, s2 = 2, 1, 3, 8, 6
    q, k, w = rnd(b, s1, n, d), rnd(b, s2, 1, d), rnd(b, s1, n)
    lens = torch.tensor([6, 2], dtype=torch.int32)
    idx, _ = A.npu_lightning_indexer(q, k, w, actual_seq_lengths_key=lens, sparse_count=4, sparse_mode=0)
    assert idx.shape == (b, s1, 1, 4) and idx.dtype == torch.int32
    for bi in range(b):
        sc = [sum(float(w[bi, 0, h]) * max(0.0, float(q[bi, 0, h] @ k[bi, j, 0])) for h in range(n))
              for j in range(int(lens[bi]))]
        order = sorted(range(len(sc)), key=lambda j: (-sc[j], j))[:4]
        assert idx[bi, 0, 0].tolist() == order + [-1] * (4 - len(order))


def test_lightning_indexer_sparse_mode_3_is_causal():
    q, k, w = rnd(1, 3, 2, 4), rnd(1, 3, 1, 4), torch.ones(1, 3, 2)
    idx, _ = A.npu_lightning_indexer(q, k, w, sparse_count=3, sparse_mode=3)
    for i in range(3):
        sel = [j for j in idx[0, i, 0].tolist() if j >= 0]
        assert sorted(sel) == list(range(i + 1))


def test_emulation_is_independent_of_the_reference_backend():
    """The emulation must not use the reference ops it is compared with (nor must the NPU backend import them)."""
    import glob
    import os

    import atb_ops.npu as pkg

    root = os.path.dirname(pkg.__file__)
    for path in glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "emu", "*.py")):
        src = open(path).read()
        for bad in ("atb_ops.reference", "from ..reference", "from ...reference", "import reference"):
            assert bad not in src, (path, bad)
