"""QuantLinear numerics: int path vs float path, int path vs exact integer arithmetic, int32 range, norms, KV C8.

Tolerance between the paths (all types): both compute the same real number ``y* = s (sum_k q_x q_w) (+ b)`` up to
float32 rounding. The int path rounds once or twice after an exact integer sum (error <= 3u|y|, u = 2^-24); the float
path sums K float32 products of rounded factors (error <= (K+3) u sum_k |x_dq||W|, the standard bound
gamma_K = K u / (1 - K u) plus the rounding of each factor). We assert the sum of both bounds, doubled. The static
type with a float bias adds the folding error ``deq * |round(b/deq) - b/deq| <= deq / 2``
(quant/msmodelslim/README.md §6).
"""

import numpy as np
import pytest
import torch

import msm_synth as S
from quant.errors import QuantFormatError
from quant.msmodelslim.schemes import (
    AntiOutlierNorm,
    KVCacheQuant,
    QuantLinear,
    int32_accumulator_bound,
)

def _data(n=24, k=64, m=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g)
    x_calib = torch.randn(16, k, generator=g) * 1.1
    b = torch.randn(n, generator=g) * 0.3
    return w, x, x_calib, b


def _bound(lin, x, y_int):
    return S.int_float_bound(lin, x, y_int)


CASES = {
    "W8A8": lambda w, xc, b: S.quant_w8a8_static(w, xc),
    "W8A8_bias": lambda w, xc, b: S.quant_w8a8_static(w, xc, bias=b),
    "W8A8_f32deq": lambda w, xc, b: S.quant_w8a8_static(w, xc, deq_dtype="float32", with_weight_scale=False),
    "W8A8_bf16scales": lambda w, xc, b: S.quant_w8a8_static(w, xc, scale_dtype=torch.bfloat16),
    "W8A8S": lambda w, xc, b: S.quant_w8a8_static(w, xc),
    "W8A8_MIX": lambda w, xc, b: S.quant_w8a8_static(w, xc, bias=b),
    "W8A8_DYNAMIC": lambda w, xc, b: S.quant_w8a8_dynamic(w, bias=b),
    "W8A16_sym": lambda w, xc, b: S.quant_w8a16(w, sym=True, bias=b),
    "W8A16_asym": lambda w, xc, b: S.quant_w8a16(w, sym=False),
    "W8A16_group": lambda w, xc, b: S.quant_w8a16(w, sym=False, group_size=16),
    "W4A8_DYNAMIC": lambda w, xc, b: S.quant_w4a8_per_channel(w, "q_proj"),
    "W4A8_DYNAMIC_down": lambda w, xc, b: S.quant_w4a8_per_channel(w, "down_proj", bias=b),
    "W4A8_DYNAMIC_unpacked": lambda w, xc, b: S.quant_w4a8_per_channel(w, packed=False),
    "W4A8_DYNAMIC_group": lambda w, xc, b: S.quant_w4a8_per_group(w, 16),
    "W4A8_DYNAMIC_group_packed": lambda w, xc, b: S.quant_w4a8_per_group(w, 16, packed=True),
    "W4A16_group": lambda w, xc, b: S.quant_w4a16(w, 16, bias=b),
    "FLOAT": lambda w, xc, b: {"weight": w, "bias": b},
}


def _qtype(case):
    for t in ("W8A8_DYNAMIC", "W8A8_MIX", "W8A8S", "W8A8", "W8A16", "W4A8_DYNAMIC", "W4A16", "FLOAT"):
        if case.startswith(t):
            return t
    raise AssertionError(case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_int_path_matches_float_path(case):
    w, x, xc, b = _data()
    t = CASES[case](w, xc, b)
    qtype = _qtype(case)
    li = QuantLinear(qtype, t, name=f"m.{case}", path="int")
    lf = QuantLinear(qtype, t, name=f"m.{case}", path="float")
    yi, yf = li(x), lf(x)
    assert yi.shape == yf.shape == (5, 24) and yi.dtype == torch.float32
    if qtype in ("W8A16", "W4A16", "FLOAT"):
        assert torch.equal(yi, yf)  # weight-only: (w + (-zp)) * s == (w - zp) * s exactly
        return
    bound = _bound(li, x, yi)
    assert bool(((yi - yf).abs() <= bound).all()), float(((yi - yf).abs() - bound).max())
    # and both approximate the unquantised layer (sanity: quantisation error only)
    ref = x @ w.T + (t["bias"] if "bias" in t else 0)
    assert float((yf - ref).abs().max()) < 0.15 * float(ref.abs().max())


def test_float_path_weight_matches_reference_dequant():
    w, x, xc, b = _data()
    for case in ("W8A8", "W8A16_group", "W4A8_DYNAMIC_group", "W8A8_DYNAMIC", "W4A16_group"):
        t = CASES[case](w, xc, b)
        lin = QuantLinear(_qtype(case), t)
        assert torch.allclose(lin.dequant_weight(), S.dequant_reference(t, _qtype(case)), rtol=1e-6, atol=1e-7), case


def test_w4a8_packed_equals_unpacked():
    w, *_ = _data()
    packed = QuantLinear("W4A8_DYNAMIC", S.quant_w4a8_per_channel(w, packed=True))
    unpacked = QuantLinear("W4A8_DYNAMIC", S.quant_w4a8_per_channel(w, packed=False))
    assert packed.layout.packed and not unpacked.layout.packed
    assert torch.equal(packed.w_q, unpacked.w_q)
    a = QuantLinear("W4A8_DYNAMIC", S.quant_w4a8_per_group(w, 16, packed=True))
    b = QuantLinear("W4A8_DYNAMIC", S.quant_w4a8_per_group(w, 16, packed=False))
    assert torch.equal(a.w_q, b.w_q) and a.layout.variant == "w4a8_per_group"


def _py_dot(q_rows, w_rows):
    return [[sum(int(a) * int(b) for a, b in zip(qr, wr)) for wr in w_rows] for qr in q_rows]


def test_static_int_path_equals_exact_integer_computation():
    w, x, xc, b = _data(n=8, k=32, m=3)
    t = S.quant_w8a8_static(w, xc, bias=b)
    lin = QuantLinear("W8A8", t)
    # activation quantisation by hand (float32 numpy, half-to-even)
    s, o = np.float32(t["input_scale"].item()), np.float32(t["input_offset"].item())
    q = np.clip(np.rint(x.numpy() / s + o), -128, 127).astype(np.int64)
    acc = _py_dot(q.tolist(), t["weight"].tolist())  # exact Python integers
    qb = t["quant_bias"].tolist()
    acc_total = [[a + qb[j] for j, a in enumerate(row)] for row in acc]
    assert lin.int_accumulator(x).tolist() == acc_total
    deq = (t["deq_scale"].numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    y_ref = np.asarray(acc_total, dtype=np.float32) * deq  # float32(acc) * deq, one rounding
    assert np.array_equal(lin(x).numpy(), y_ref)


def test_dynamic_int_path_equals_exact_integer_computation():
    w, x, xc, b = _data(n=8, k=32, m=3)
    for qtype, t in (("W8A8_DYNAMIC", S.quant_w8a8_dynamic(w)), ("W4A8_DYNAMIC", S.quant_w4a8_per_channel(w))):
        lin = QuantLinear(qtype, t)
        xn = x.numpy()
        s_t = (np.abs(xn).max(-1) / np.float32(127)).astype(np.float32)
        q = np.clip(np.rint(xn / s_t[:, None]), -128, 127).astype(np.int64)
        wq = lin.w_q.tolist()  # (unpacked for W4A8; the packing is tested separately)
        acc = np.asarray(_py_dot(q.tolist(), wq), dtype=np.int64)
        assert lin.int_accumulator(x)[..., 0].tolist() == acc.tolist()
        ws = t["weight_scale"].numpy()[:, 0]
        y_ref = (acc.astype(np.float32) * ws[None, :]) * s_t[:, None]  # npu_quant_matmul order
        assert np.array_equal(lin(x).numpy(), y_ref.astype(np.float32)), qtype


def test_no_int32_overflow_for_fixture_sizes():
    """Every partial sum of every int accumulator of these fixtures fits int32 (static bound + observed)."""
    w, x, xc, b = _data(n=24, k=64)
    for case in ("W8A8", "W8A8_bias", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A8_DYNAMIC_group"):
        t = CASES[case](w, xc, b)
        lin = QuantLinear(_qtype(case), t)
        qb = int(t["quant_bias"].abs().max()) if "quant_bias" in t else 0
        assert int32_accumulator_bound(lin.in_features, qb) <= 2**31 - 1
        x_big = torch.cat([x, 100 * x, -x.abs() * 50])  # saturating activations too
        assert int(lin.int_accumulator(x_big).abs().max()) <= 2**31 - 1
    # the largest real DeepSeek K (moe/dense intermediate 18432) still has a bound below 2^31
    assert int32_accumulator_bound(18432, 2**24) < 2**31


def test_int32_overflow_is_detected():
    w, x, xc, b = _data(n=4, k=16)
    t = S.quant_w8a8_static(w, xc)
    t["quant_bias"] = torch.full((4,), 2**31 - 1, dtype=torch.int32)
    lin = QuantLinear("W8A8", t, name="big")
    with pytest.raises(OverflowError, match="big"):
        lin(x.abs() * 10)


def test_fixpipe_fp19_and_mix_modes():
    w, x, xc, b = _data()
    t = S.quant_w8a8_static(w, xc, bias=b)
    a = QuantLinear("W8A8", t)(x)
    f = QuantLinear("W8A8", t, fixpipe_fp19=True)(x)
    assert not torch.equal(a, f) and torch.allclose(a, f, rtol=2**-10, atol=0)
    st = QuantLinear("W8A8_MIX", t, mix_mode="static")(x)
    dy = QuantLinear("W8A8_MIX", t, mix_mode="dynamic")(x)
    assert torch.equal(st, a)
    ref = x @ w.T + b
    assert float((dy - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_act_sims_and_dtypes():
    w, x, xc, b = _data()
    t = S.quant_w8a8_dynamic(w)
    outs = {s: QuantLinear("W8A8_DYNAMIC", t, path="float", act_sim=s)(x) for s in
            ("runtime", "msmodelslim_v0", "msmodelslim_v1")}
    assert not torch.equal(outs["runtime"], outs["msmodelslim_v0"])
    ref = x @ w.T
    for y in outs.values():
        assert float((y - ref).abs().max()) < 0.1 * float(ref.abs().max())
    lin = QuantLinear("W8A8_DYNAMIC", t)
    y16 = lin(x.to(torch.bfloat16).reshape(5, 1, 64))
    assert y16.dtype == torch.bfloat16 and y16.shape == (5, 1, 24)
    z = lin(torch.zeros(2, 64))  # zero rows: s_t = 0, q = 0, y = bias (= 0)
    assert torch.equal(z, torch.zeros(2, 24))


def test_bad_inputs_name_the_tensor():
    w, x, xc, b = _data()
    with pytest.raises(ValueError, match="in_features"):
        QuantLinear("W8A8_DYNAMIC", S.quant_w8a8_dynamic(w))(x[:, :10])
    t = S.quant_w4a8_per_channel(w, packed=False)
    t["weight"][0, 0] = 9
    with pytest.raises(QuantFormatError, match="lin.weight"):
        QuantLinear("W4A8_DYNAMIC", t, name="lin")
    t = S.quant_w8a8_static(w, xc)
    t["input_offset"] = t["input_offset"] + 0.5
    with pytest.raises(QuantFormatError, match="lin.input_offset"):
        QuantLinear("W8A8", t, name="lin")
    t = S.quant_w8a8_static(w, xc)
    t["deq_scale"][3] = t["deq_scale"][3] | (1 << 46)  # one TransQuantParam-looking word
    with pytest.raises(QuantFormatError, match="lin.deq_scale"):
        QuantLinear("W8A8", t, name="lin")
    t = S.quant_w8a8_static(w, xc)
    del t["quant_bias"]
    with pytest.raises(QuantFormatError, match="lin.quant_bias"):
        QuantLinear("W8A8", t, name="lin")


def test_anti_outlier_norm():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=g)
    wt = 1 + 0.1 * torch.randn(32, generator=g)
    bs = 0.1 * torch.randn(32, generator=g)
    y = AntiOutlierNorm(wt.half(), bs, eps=1e-6)(x)  # fp16 weight + fp32 bias, as v0 writes
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * wt.half().float() + bs
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
    ln = AntiOutlierNorm(wt, bs, eps=1e-5, kind="layer")(x)
    assert torch.allclose(ln, torch.nn.functional.layer_norm(x, (32,), wt, bs, 1e-5), atol=1e-5)


@pytest.mark.parametrize("sym", [True, False])
def test_kv_c8_round_trip(sym):
    g = torch.Generator().manual_seed(4)
    k = torch.randn(6, 16, generator=g) + (0 if sym else 0.7)
    if sym:
        scale, off = k.abs().amax(0) / 127, torch.zeros(16)
    else:
        hi, lo = k.amax(0).clamp(min=0), k.amin(0).clamp(max=0)
        scale = (hi - lo) / 255
        off = torch.round(-lo / scale) - 128
    kv = KVCacheQuant(scale, off, name="l.k_proj")
    assert kv.symmetric == sym
    q = kv.quantize(k)
    assert q.dtype == torch.int8
    assert float((kv(k) - k).abs().max()) <= float(scale.max()) / 2 * (1 + 1e-5)
    assert torch.equal(kv.dequantize(q), (q.float() - off) * scale)
    assert (KVCacheQuant(scale, off, reciprocal=True).quantize(k).int() - q.int()).abs().max() <= 1


def test_w4a16_packed_is_refused():
    w, *_ = _data()
    t = S.quant_w4a16(w, 16)
    t["weight"] = S.pack_rows_int4(t["weight"])
    with pytest.raises(QuantFormatError, match="packed W4A16"):
        QuantLinear("W4A16", t, name="lin")
