"""Our DeepSeek-V3 model on msModelSlim's own quantised tiny DeepSeek-V3 checkpoints (real-tool fixtures):
logits against msModelSlim's fake-quant logits, float and integer paths, the float source model against the
transformers 4.51 logits recorded with the fixtures."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from ascend_dsv4 import LLM

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "msmodelslim")


def _ref(case):
    return load_file(os.path.join(FIX, case, "reference.safetensors"))


def _logits(llm, ids):
    """Both fixture sequences in ONE ragged step (msModelSlim's v1 activation statistics span the batch)."""
    r = llm.runner
    seqs = [r.new_sequence() for _ in ids]
    out = r.step(seqs, [row.tolist() for row in ids], logits="all")
    for s in seqs:
        r.release(s)
    return out.view(len(ids), ids.shape[1], -1)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_float_source_model_matches_transformers_4_51():
    ref = _ref("dsv3_w8a8_dynamic_v0")
    llm = LLM(model=os.path.join(FIX, "_source_models", "dsv3_fp32"), device="cpu", dtype="float32", progress=False)
    assert _rel(_logits(llm, ref["input_ids"]), ref["float_logits"]) < 1e-5


# v0 cases: msModelSlim's v0 simulation (asymmetric per-token activation fake-quant for dynamic linears, the
# static formula chain of quant/msmodelslim/README.md §6) is reproduced exactly in fp32 -> 1e-5 relative (measured
# ~3e-7).
# v1 mixed W8A8/W4A8: v1 takes dynamic activation statistics per input channel over the batch's tokens
# (quant/msmodelslim/README.md §7.2, fixtures README); with the same two sequences in one batch we measure ~0.7% (the
# remaining gap
# comes from how v1 groups tokens for routed experts), so 2% is the bound.
CASES = [("dsv3_w8a8_dynamic_v0", "msmodelslim_v0", 1e-5), ("dsv3_w8a8_static_v0", "msmodelslim_v0", 1e-5),
         ("dsv3_mix_w8a8_w4a8_v1", "msmodelslim_v1", 2e-2)]


@pytest.mark.parametrize("case, act_sim, tol", CASES)
def test_quantised_checkpoint_matches_msmodelslim_fake_quant(case, act_sim, tol):
    ref = _ref(case)
    llm = LLM(model=os.path.join(FIX, case), device="cpu", dtype="float32", msmodelslim_path="float",
              msmodelslim_act_sim=act_sim, allow_float_mtp=True, progress=False)
    assert llm.quant_summary["quantized_linears"] > 0
    assert _rel(_logits(llm, ref["input_ids"]), ref["fakequant_logits"]) < tol


@pytest.mark.parametrize("case", ["dsv3_w8a8_dynamic_v0", "dsv3_w8a8_static_v0"])
def test_integer_path_is_close_to_the_float_path(case):
    """The NPU integer path (int8 x int8 -> int32, + quant_bias, x deq_scale; symmetric per-token dynamic
    activations) against the runtime float simulation. They quantise activations identically up to ties and
    float32 summation order: a handful of activations land one int8 step apart, which moves the logits of this
    tiny two-layer model by ~0.4% (measured) -- so 1%, not bit equality."""
    ref = _ref(case)
    kw = dict(device="cpu", dtype="float32", allow_float_mtp=True, progress=False)
    a = _logits(LLM(model=os.path.join(FIX, case), msmodelslim_path="int", **kw), ref["input_ids"])
    b = _logits(LLM(model=os.path.join(FIX, case), msmodelslim_path="float", msmodelslim_act_sim="runtime", **kw),
                ref["input_ids"])
    assert _rel(a, b) < 1e-2


def test_checkpoint_without_mtp_layer_loads_with_a_warning(caplog):
    """A config announcing an MTP layer that the msModelSlim output does not contain at all (neither described
    nor stored): the model loads, the MTP module is zeroed, and the log says so."""
    with caplog.at_level("WARNING", logger="ascend_dsv4"):
        llm = LLM(model=os.path.join(FIX, "dsv3_w8a8_dynamic_v0"), device="cpu", dtype="float32", progress=False,
                  config_overrides=dict(n_mtp_layers=1))
    assert "describes no MTP layer" in caplog.text
    assert float(llm.model.mtp[0].eh_proj.weight.abs().sum()) == 0.0
