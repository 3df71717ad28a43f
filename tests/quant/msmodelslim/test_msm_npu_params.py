"""NPU parameter preparation, checked against CPU emulations of the torch_npu ops (msm_emulate, from the torch_npu docs)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import msm_emulate as E
import msm_synth as S
from quant.errors import QuantFormatError
from quant.msmodelslim.npu_params import (
    DEQ_FLOAT32,
    DEQ_MSMODELSLIM_INT64,
    DEQ_TRANS_QUANT_PARAM,
    MAX_MATMUL_DIM,
    compute_scale_bias,
    decode_deq_scale,
    decode_deq_scale_msmodelslim,
    decode_deq_scale_trans_quant_param,
    detect_deq_scale_encoding,
    encode_deq_scale,
    encode_deq_scale_msmodelslim,
    encode_deq_scale_trans_quant_param,
    fp19_truncate,
    int64_bits_to_scale,
    npu_antiquant_offset,
    npu_antiquant_params,
    prepare_npu_linear,
    quant_bias_for_rank,
    scale_to_int64_bits,
    split_output_dim,
    w4a8_weight_to_npu,
    weight_to_npu_layout,
)
from quant.msmodelslim.packing import pack_int4_rows, pack_int4_to_int32, unpack_int32_to_int4, unpack_int4_rows
from quant.msmodelslim.schemes import QuantLinear

pos_f32 = st.floats(min_value=0.0, max_value=2.0**127, exclude_min=True, allow_nan=False, allow_infinity=False, width=32)


def _data(n=24, k=64, m=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) / k**0.5, torch.randn(m, k, generator=g),
            torch.randn(16, k, generator=g), torch.randn(n, generator=g) * 0.3)


# ---------------------------------------------------------------------------------------------------------------
# deq_scale encodings


@settings(max_examples=80, deadline=None)
@given(st.lists(pos_f32, min_size=1, max_size=16))
def test_msmodelslim_int64_round_trip(vals):
    d = torch.tensor(vals, dtype=torch.float32)
    enc = encode_deq_scale_msmodelslim(d)
    assert enc.dtype == torch.int64
    assert torch.equal(enc, S.int64_deq(d))  # the numpy frombuffer(int32).astype(int64) of msModelSlim
    assert bool(((enc >> 32) == 0).all())  # positive -> high word 0, no flag
    assert torch.equal(decode_deq_scale_msmodelslim(enc), d)
    assert detect_deq_scale_encoding(enc) == DEQ_MSMODELSLIM_INT64
    assert torch.equal(decode_deq_scale(enc), d)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(pos_f32, st.integers(-300, 300)), min_size=1, max_size=16))
def test_trans_quant_param_round_trip(pairs):
    d = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    off = torch.tensor([float(p[1]) for p in pairs])
    for o in (None, off):
        enc = encode_deq_scale_trans_quant_param(d, o)
        assert torch.equal(enc, E.npu_trans_quant_param(d, o))  # the documented op formula
        assert bool(((enc >> 46) & 1).all()) and bool(((enc & 0x1FFF) == 0).all())
        scale, got_off = decode_deq_scale_trans_quant_param(enc)
        assert torch.equal(scale, fp19_truncate(d))  # the 19-bit-truncated float
        bits = d.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(scale.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, bits & 0xFFFFE000)
        want = torch.zeros_like(got_off) if o is None else o.clamp(-256, 255).to(torch.int32)
        assert torch.equal(got_off, want)
        assert detect_deq_scale_encoding(enc) == DEQ_TRANS_QUANT_PARAM
        assert torch.equal(decode_deq_scale(enc), fp19_truncate(d))


def test_trans_quant_param_documented_example():
    # quant/msmodelslim/README.md §5: msModelSlim 0x387ae5cb vs TransQuantParam 0x4000387ae000 for the same float
    d = torch.tensor([0x387AE5CB], dtype=torch.int64)
    f = decode_deq_scale(d)
    assert int(encode_deq_scale_trans_quant_param(f)[0]) == 0x4000387AE000
    assert int(encode_deq_scale(f, DEQ_MSMODELSLIM_INT64)[0]) == 0x387AE5CB
    with pytest.raises(ValueError, match="round_mode"):
        encode_deq_scale_trans_quant_param(f, round_mode=1)


def test_float32_encoding_and_detection():
    d = torch.tensor([1e-3, 2e-4])
    assert encode_deq_scale(d, DEQ_FLOAT32) is not None
    assert detect_deq_scale_encoding(d) == DEQ_FLOAT32
    assert torch.equal(decode_deq_scale(d), d)
    assert detect_deq_scale_encoding(d.bfloat16()) == DEQ_FLOAT32
    neg = encode_deq_scale_msmodelslim(torch.tensor([-0.5, 0.25]))  # sign-extended negative still detected
    assert int(neg[0]) < 0 and detect_deq_scale_encoding(neg) == DEQ_MSMODELSLIM_INT64
    assert torch.equal(decode_deq_scale(neg), torch.tensor([-0.5, 0.25]))


def test_never_mix_and_ambiguous():
    d = torch.tensor([1e-3, 2e-3, 3e-3])
    mixed = torch.cat([encode_deq_scale_msmodelslim(d[:2]), encode_deq_scale_trans_quant_param(d[2:])])
    with pytest.raises(QuantFormatError, match=r"'l\.deq_scale'.*never mix"):
        detect_deq_scale_encoding(mixed, "l.deq_scale")
    with pytest.raises(QuantFormatError, match="ambiguous"):
        detect_deq_scale_encoding(torch.zeros(4, dtype=torch.int64), "l.deq_scale")
    with pytest.raises(QuantFormatError, match="empty"):
        detect_deq_scale_encoding(torch.zeros(0, dtype=torch.int64), "l.deq_scale")
    with pytest.raises(QuantFormatError, match="neither"):
        detect_deq_scale_encoding(torch.tensor([1 << 50], dtype=torch.int64), "l.deq_scale")
    with pytest.raises(QuantFormatError, match="int32"):
        detect_deq_scale_encoding(torch.tensor([1], dtype=torch.int32), "l.deq_scale")


def test_grouped_matmul_scale_bitcast():
    s = torch.tensor([0.5, 1e-3, -2.0])
    b = scale_to_int64_bits(s)
    assert bool(((b >> 32) == 0).all()) and not bool(((b >> 46) & 1).any())  # zero-extended, no flag bit
    assert int(b[2]) == 0xC0000000  # negative: zero-extended (vllm np.uint32 view), not sign-extended
    assert torch.equal(int64_bits_to_scale(b), s)
    assert torch.equal(b[:2], encode_deq_scale_msmodelslim(s[:2]))  # same bits as msModelSlim for s > 0


# ---------------------------------------------------------------------------------------------------------------
# the offset sign


@pytest.mark.parametrize("group_size", [None, 16])
def test_antiquant_offset_sign_numeric(group_size):
    """The additive-offset NPU matmul fed with -zp reproduces the checkpoint's (w - zp) * s dequantisation."""
    w, x, _, b = _data()
    t = S.quant_w8a16(w, sym=False, group_size=group_size, bias=b)
    assert bool((t["weight_offset"] != 0).any())  # a real zero point, or the test proves nothing
    ref = x @ S.dequant_reference(t, "W8A16").T + b
    scale, offset, g = npu_antiquant_params(t["weight_scale"], t["weight_offset"])
    assert torch.equal(offset, npu_antiquant_offset(t["weight_offset"].reshape(24, -1)).reshape(offset.shape)
                       if g == 1 else -t["weight_offset"].T)
    gs = 0 if g == 1 else 64 // g
    y = E.npu_weight_quant_batchmatmul(x, weight_to_npu_layout(t["weight"]), scale, offset, b, gs)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    for wrong in (-offset, None):  # un-negated (or twice negated) zero point, or none at all
        y_bad = E.npu_weight_quant_batchmatmul(x, weight_to_npu_layout(t["weight"]), scale, wrong, b, gs)
        assert float((y_bad - ref).abs().max()) > 0.1
    # the QuantLinear int path uses the same additive form and equals the emulated op
    lin = QuantLinear("W8A16", t)
    p = prepare_npu_linear(lin)
    assert p["op"] == "npu_weight_quant_batchmatmul" and p["antiquant_group_size"] == gs
    y2 = E.npu_weight_quant_batchmatmul(x, p["weight"], p["antiquant_scale"], p["antiquant_offset"], p["bias"], gs)
    assert torch.allclose(y2, lin(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# int4 packing


def test_int4_int32_packing():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 0, 0, 0, 0, 0], [-8] * 8])
    p = pack_int4_to_int32(q)
    assert p.dtype == torch.int32 and p.shape == (3, 1)
    assert int(p[0, 0]) == 0x76543210  # element 0 in bits 0-3 (LSB first)
    assert int(p[1, 0]) == 0xF
    assert int(p[2, 0]) & 0xFFFFFFFF == 0x88888888 and int(p[2, 0]) < 0
    assert torch.equal(E.unpack_int4_lsb_first_signed(p), q)
    r = torch.randint(-8, 8, (5, 7, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int32_to_int4(pack_int4_to_int32(r)), r.to(torch.int8))
    with pytest.raises(QuantFormatError, match="int4"):
        pack_int4_to_int32(torch.full((8,), 8))


def test_msmodelslim_row_packing_and_npu_conversion():
    q = torch.zeros(4, 3, dtype=torch.int8)
    q[0, 0], q[1, 0] = 1, -2  # even row -> low nibble, odd row -> high nibble (quant/msmodelslim/README.md §4)
    packed = pack_int4_rows(q)
    assert packed.shape == (2, 3) and int(packed[0, 0]) & 0xFF == 0xE1
    r = torch.randint(-8, 8, (32, 40), generator=torch.Generator().manual_seed(2))
    packed = pack_int4_rows(r)
    assert torch.equal(packed, S.pack_rows_int4(r))  # independent element-wise formula
    assert torch.equal(unpack_int4_rows(packed), r.to(torch.int8))
    npu = w4a8_weight_to_npu(packed)  # [K, N/8]
    assert npu.shape == (40, 4) and npu.dtype == torch.int32
    assert torch.equal(npu, packed.T.contiguous().view(torch.int32))  # vllm-ascend: transpose + view(int32)
    assert torch.equal(E.unpack_int4_lsb_first_signed(npu), r.T)
    experts = torch.stack([packed, pack_int4_rows(-r.clamp(-7, 7))])  # [E, N/2, K]
    assert torch.equal(w4a8_weight_to_npu(experts)[1], w4a8_weight_to_npu(experts[1]))


# ---------------------------------------------------------------------------------------------------------------
# tensor parallelism: quant_bias on one rank


def _static_linear(n=24, k=64, bias=True):
    w, x, xc, b = _data(n, k)
    t = S.quant_w8a8_static(w, xc, bias=b if bias else None)
    return QuantLinear("W8A8", t, name="o_proj"), t, x


def test_quant_bias_added_once_for_row_parallel():
    lin, t, x = _static_linear()
    p = prepare_npu_linear(lin)
    xq = E.npu_quantize(x, lin.input_scale, lin.input_offset, div_mode=True)
    W, qb = p["weight"], t["quant_bias"]
    full_i = E.npu_quant_matmul(xq, W, p["deq_scale"], bias=qb, output_dtype=torch.int32)
    full_f = E.npu_quant_matmul(xq, W, p["deq_scale"], bias=qb)
    halves = [slice(0, 32), slice(32, 64)]  # row-parallel: K split over 2 ranks, outputs summed

    def partial(r, bias_rule, dtype):
        return E.npu_quant_matmul(xq[:, halves[r]], W[halves[r]], p["deq_scale"], bias=bias_rule(r), output_dtype=dtype)

    once = lambda r: quant_bias_for_rank(qb, r, row_parallel=True)  # noqa: E731
    every = lambda r: qb  # noqa: E731
    assert once(0) is qb and once(1) is None
    s_once = partial(0, once, torch.int32) + partial(1, once, torch.int32)
    s_every = partial(0, every, torch.int32) + partial(1, every, torch.int32)
    assert torch.equal(s_once, full_i)  # exact in the integer domain
    assert torch.equal(s_every - full_i, qb.expand_as(full_i))  # twice: off by quant_bias
    f_once = partial(0, once, torch.float32) + partial(1, once, torch.float32)
    f_every = partial(0, every, torch.float32) + partial(1, every, torch.float32)
    assert torch.allclose(f_once, full_f, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(f_every, full_f, rtol=1e-3, atol=1e-3)
    # column-parallel: every rank adds its own slice of quant_bias
    cols = [slice(0, 12), slice(12, 24)]
    parts = [E.npu_quant_matmul(xq, W[:, c], p["deq_scale"][c],
                                bias=quant_bias_for_rank(qb[c], r, row_parallel=False)) for r, c in enumerate(cols)]
    assert torch.equal(torch.cat(parts, -1), full_f)
    with pytest.raises(ValueError):
        quant_bias_for_rank(qb, -1, True)


# ---------------------------------------------------------------------------------------------------------------
# N > 65535


def test_split_output_dim_beyond_65535():
    n, k, m = 65536 + 128, 16, 4
    g = torch.Generator().manual_seed(5)
    t = {
        "weight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        "input_scale": torch.tensor([0.02]),
        "input_offset": torch.tensor([3.0]),
        "quant_bias": torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32),
        "deq_scale": S.int64_deq(torch.rand(n, generator=g) * 1e-3 + 1e-5),
    }
    lin = QuantLinear("W8A8", t, name="self_attn.wq_b", fixpipe_fp19=True)
    x = torch.randn(m, k, generator=g)
    p = prepare_npu_linear(lin)
    xq = E.npu_quantize(x, lin.input_scale, lin.input_offset, div_mode=True)
    with pytest.raises(RuntimeError, match="65535"):
        E.npu_quant_matmul(xq, p["weight"], p["deq_scale"], bias=p["bias"])
    chunks = split_output_dim(p["weight"], p["deq_scale"], p["bias"], max_n=MAX_MATMUL_DIM)
    assert len(chunks) == 2 and all(c[0].shape[1] <= MAX_MATMUL_DIM for c in chunks)
    assert sum(c[0].shape[1] for c in chunks) == n
    y = torch.cat([E.npu_quant_matmul(xq, w_, d_, bias=b_) for w_, d_, b_ in chunks], dim=-1)
    unsplit = E.npu_quant_matmul(xq, p["weight"], p["deq_scale"], bias=p["bias"], check_limits=False)
    assert torch.equal(y, unsplit)
    assert torch.equal(y, lin(x))  # and equals the reference int path (fp19 deq, like the fixpipe)
    assert len(split_output_dim(p["weight"][:, :100], p["deq_scale"][:100])) == 1
    with pytest.raises(ValueError, match="last dim"):
        split_output_dim(p["weight"], p["deq_scale"][:10])


# ---------------------------------------------------------------------------------------------------------------
# prepared parameters through the emulated ops == the reference int path


@pytest.mark.parametrize("deq", ["int64", "float32", "trans_quant_param"])
def test_w8a8_static_npu_params_match_int_path(deq):
    w, x, xc, b = _data()
    t = S.quant_w8a8_static(w, xc, bias=b, deq_dtype="float32" if deq == "float32" else "int64")
    lin = QuantLinear("W8A8", t, fixpipe_fp19=(deq != "float32"))
    p = prepare_npu_linear(lin, deq_encoding="trans_quant_param" if deq == "trans_quant_param" else None)
    assert p["input_offset"].dtype == torch.int8
    if deq == "int64":
        assert p["deq_scale"] is lin.deq_scale_raw  # passed unchanged, as vllm-ascend does
    xq = E.npu_quantize(x, lin.input_scale, p["input_offset"], div_mode=True)
    assert torch.equal(xq.long(), lin.quantize_input(x)[0])
    # the NPU multiplies by the reciprocal (npu_quantize div_mode=False): at most one code apart
    xq_r = E.npu_quantize(x, p["input_scale_reciprocal"], p["input_offset"], div_mode=False)
    assert int((xq_r.int() - xq.int()).abs().max()) <= 1
    y = E.npu_quant_matmul(xq, p["weight"], p["deq_scale"], bias=p["bias"])
    assert torch.equal(y, lin(x))


def test_w8a8_dynamic_npu_params_match_int_path():
    w, x, _, b = _data()
    lin = QuantLinear("W8A8_DYNAMIC", S.quant_w8a8_dynamic(w, bias=b))
    p = prepare_npu_linear(lin)
    xq, s = E.npu_dynamic_quant(x)
    y = E.npu_quant_matmul(xq, p["weight"], p["scale"], pertoken_scale=s, bias=p["bias"])
    assert torch.equal(y, lin(x))


@pytest.mark.parametrize("name", ["q_proj", "down_proj"])
def test_w4a8_npu_params_match_int_path(name):
    w, x, _, _ = _data(n=32, k=64)
    t = S.quant_w4a8_per_channel(w, name=name)
    lin = QuantLinear("W4A8_DYNAMIC", t)
    p = prepare_npu_linear(lin)
    assert p["weight"].dtype == torch.int32 and p["weight"].shape == (64, 4)
    assert p["scale"].dtype == torch.int64 and not bool(((p["scale"] >> 46) & 1).any())
    q4 = unpack_int4_rows(t["weight"])
    assert torch.allclose(p["scale_bias"], compute_scale_bias(q4, t["weight_scale"])[:, 0], rtol=1e-6)
    xq, s = E.npu_dynamic_quant(x)
    gl = torch.tensor([x.shape[0]])
    args = (xq, p["weight"][None], p["scale"][None], s)
    y_split = E.npu_grouped_matmul_w4a8(*args, p["scale_bias"][None], gl)
    y_plain = E.npu_grouped_matmul_w4a8(*args, p["scale_bias"][None], gl, use_scale_bias_split=False)
    ref = lin(x)
    assert torch.equal(y_plain, ref)
    assert torch.allclose(y_split, ref, rtol=1e-5, atol=1e-6)
    y_nobias = E.npu_grouped_matmul_w4a8(*args, torch.zeros_like(p["scale_bias"])[None], gl)
    assert not torch.allclose(y_nobias, ref, rtol=1e-3, atol=1e-3)  # scale_bias is what makes the split exact


def test_w4a8_per_group_refused_for_npu():
    w, *_ = _data()
    lin = QuantLinear("W4A8_DYNAMIC", S.quant_w4a8_per_group(w, 16), name="mlp.experts.0.up_proj")
    with pytest.raises(QuantFormatError, match=r"refused.*weight_scale_second|weight_scale_second.*refused"):
        prepare_npu_linear(lin)


def test_w4a16_npu_params_match_int_path():
    w, x, _, b = _data()
    lin = QuantLinear("W4A16", S.quant_w4a16(w, 16, bias=b))
    p = prepare_npu_linear(lin)
    assert p["weight"].dtype == torch.int32 and p["weight"].shape == (64, 3)  # [K, N/8]
    assert p["antiquant_scale"].shape == (4, 24) and p["antiquant_group_size"] == 16  # [G, N]
    y = E.npu_weight_quant_batchmatmul(x, p["weight"], p["antiquant_scale"], p["antiquant_offset"], p["bias"], 16)
    assert torch.allclose(y, lin(x), rtol=1e-6, atol=1e-6)
