"""Conformance with checkpoints written by the real msModelSlim 26.1.0 (tests/fixtures/msmodelslim/<case>/).

Skipped when the fixture folder has no cases. For every case: load() reads description and weights, every
described linear builds in both paths and they agree within the rounding bound, the NPU parameters reproduce the
int path through the emulated ops, and the format facts of quant/msmodelslim/README.md §4/§5/§9 hold. No model-level
logits.
"""

import glob
import json
import os

import pytest
import torch

import msm_emulate as E
import msm_synth as S
import quant.msmodelslim as msm
from quant.errors import QuantFormatError
from quant.msmodelslim.npu_params import compute_scale_bias, decode_deq_scale, prepare_npu_linear
from quant.msmodelslim.packing import unpack_int4_rows
from quant.msmodelslim.schemes import QuantLinear

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "fixtures", "msmodelslim")
CASES = sorted(
    os.path.basename(d.rstrip("/")) for d in glob.glob(os.path.join(ROOT, "*", ""))
    if not os.path.basename(d.rstrip("/")).startswith("_") and glob.glob(os.path.join(d, "quant_model_description*.json"))
)
if not CASES:
    pytest.skip("no msModelSlim fixtures in tests/fixtures/msmodelslim", allow_module_level=True)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _case(case):
    p = os.path.join(ROOT, case, "case.json")
    return json.load(open(p)) if os.path.isfile(p) else {}


def _tensors(ckpt, name):
    return {s: ckpt.tensor(k) for s, k in ckpt.layout.linears[name].tensors.items()}


@pytest.mark.parametrize("case", CASES)
def test_real_case_loads_and_every_linear_builds(case):
    folder = os.path.join(ROOT, case)
    g = torch.Generator().manual_seed(0)
    with msm.load(folder) as ckpt:
        entries = ckpt.entries()
        assert entries and ckpt.entries(quantized_only=True)
        assert ckpt.bytes_per_param() > 0
        for name, qtype in entries:
            li = ckpt.linear(name, path="int")
            lf = ckpt.linear(name, path="float")
            x = torch.randn(3, li.in_features, generator=g)
            yi, yf = li(x), lf(x)
            assert yi.shape == (3, li.out_features) and bool(torch.isfinite(yi).all()), name
            assert bool(((yi - yf).abs() <= S.int_float_bound(li, x, yi)).all()), name
            if li.layout.variant == "w4a8_per_group":
                with pytest.raises(QuantFormatError, match="refused"):
                    prepare_npu_linear(li)
                continue
            p = prepare_npu_linear(li)
            if p["op"] == "npu_quant_matmul" and "deq_scale" in p:  # static: emulated NPU == int path (fp19 deq)
                xq = E.npu_quantize(x, li.input_scale, p["input_offset"], div_mode=True)
                y_npu = E.npu_quant_matmul(xq, p["weight"], p["deq_scale"], bias=p["bias"])
                ref = QuantLinear(qtype, _tensors(ckpt, name), fixpipe_fp19=li.deq_encoding != "float32")(x)
                assert torch.equal(y_npu, ref), name
        for name in ckpt.layout.norms:
            assert ckpt.norm(name)(torch.randn(2, 8, ckpt.tensor(ckpt.layout.norms[name].weight).shape[0])).shape[-1] > 0
        for name in ckpt.layout.kv:
            kv = ckpt.kv_cache(name)
            if "_c8_sym" in case:
                assert kv.symmetric
            if "_c8_asym" in case:
                assert not kv.symmetric
        if "_c8_" in case:
            assert ckpt.kv_cache_type == "C8" and len(ckpt.layout.kv) > 0


@pytest.mark.parametrize("case", CASES)
def test_real_case_format_facts(case):
    """quant/msmodelslim/README.md §9.1: dtypes, deq_scale value and encoding, quant_bias formula, W4A8
    packing/scale_bias."""
    info = _case(case)
    model_dtype = DTYPES.get(info.get("source_model_dtype", "float32"), torch.float32)
    with msm.load(os.path.join(ROOT, case)) as ckpt:
        for name, qtype in ckpt.entries(quantized_only=True):
            t = _tensors(ckpt, name)
            assert t["weight"].dtype == torch.int8
            if "deq_scale" in t:
                assert t["quant_bias"].dtype == torch.int32
                deq = decode_deq_scale(t["deq_scale"], name)
                assert bool((deq > 0).all())
                if model_dtype == torch.bfloat16:
                    assert t["deq_scale"].dtype == torch.float32  # bf16 models: float32 deq (quant/msmodelslim/README.md §4/§5)
                else:
                    assert t["deq_scale"].dtype == torch.int64 and bool(((t["deq_scale"] >> 32) == 0).all())
                if "weight_scale" in t:  # v0: deq == input_scale * weight_scale, computed in the stored dtype
                    prod = (t["input_scale"] * t["weight_scale"].reshape(-1)).to(torch.float32)
                    assert torch.equal(deq, prod), name
                b = t["bias"].float() if "bias" in t else torch.zeros_like(deq)
                qb = torch.round(b / deq - t["weight"].float().sum(1) * t["input_offset"].float()).to(torch.int32)
                assert torch.equal(qb, t["quant_bias"]), name  # bias folded exactly (quant/msmodelslim/README.md §6)
                if info.get("api") == "v0":
                    assert t["input_scale"].dtype == model_dtype  # v0 writes scales in the model dtype
            if qtype == "W4A8_DYNAMIC" and "scale_bias" in t:
                n = t["weight_scale"].shape[0]
                assert t["weight"].shape[0] * 2 == n  # packed rows = n/2
                q4 = unpack_int4_rows(t["weight"])
                sb = compute_scale_bias(q4, t["weight_scale"], t["scale_bias"].shape[1])
                chunks = 16 if name.endswith(("o_proj", "down_proj")) else 1
                assert t["scale_bias"].shape == (n, chunks)
                if "weight_scale_second" in t:
                    # per group: close to 8*sum(q4*s2*s1) but not bit-exact (computed from the int8 stage)
                    g = t["weight_scale_second"].shape[1]
                    s12 = (t["weight_scale_second"] * t["weight_scale"]).repeat_interleave(q4.shape[1] // g, 1)
                    approx = 8 * (q4.float() * s12).reshape(n, chunks, -1).sum(-1)
                    assert float((approx - t["scale_bias"]).abs().max()) <= 1e-2 * float(t["scale_bias"].abs().max())
                else:
                    assert torch.equal(sb, t["scale_bias"]), name  # exact (quant/msmodelslim/README.md §4)
            if "weight_offset_second" in t:
                assert t["weight_offset_second"].dtype == torch.int64
        for key, t in ckpt.types.items():
            if ".module." in key:
                assert t == ckpt.model_quant_type  # the v0 anti-outlier quirk (quant/msmodelslim/README.md §3)


def test_packed_and_unpacked_v0_w4a8_agree():
    """Notes §9.5: unpack(v0 ascendV1 packed) == v0 safe_tensor unpacked (same model and config)."""
    a, b = "w4a8_dynamic_pergroup_ascendv1_v0", "w4a8_dynamic_pergroup_v0"
    if a not in CASES or b not in CASES:
        pytest.skip("paired W4A8 fixtures not present")
    with msm.load(os.path.join(ROOT, a)) as pa, msm.load(os.path.join(ROOT, b)) as pb:
        assert [n for n, _ in pa.entries(True)] == [n for n, _ in pb.entries(True)]
        for name, _ in pa.entries(True):
            ta, tb = _tensors(pa, name), _tensors(pb, name)
            assert torch.equal(unpack_int4_rows(ta["weight"]), tb["weight"]), name
            for s in tb:
                if s != "weight":
                    assert torch.equal(ta[s], tb[s]), f"{name}.{s}"
            x = torch.randn(2, pa.linear(name).in_features)
            assert torch.equal(pa.linear(name)(x), pb.linear(name)(x))
