"""Model-level logits of every msModelSlim fixture (tests/fixtures/msmodelslim, real msModelSlim 26.1.0 output).

Each fixture holds ``reference.safetensors``: ``input_ids`` [2, 12], msModelSlim's own fake-quant logits
(``fakequant_logits``), the float model's logits and, for most v0 cases, msModelSlim's int8 emulation
(``int_infer_logits``). We load every fixture with our reader (``quant.msmodelslim.load``), run the model with the
checkpoint's linears / norms / KV quantisers, and compare.

* Llama cases (our package has no Llama model): a minimal HF-Llama forward written here (RMSNorm, RoPE with HF
  ``rotate_half``, GQA attention with a causal mask, SiLU MLP, lm_head; config from the fixture's config.json)
  whose linears are ``ck.linear(name, path=...)``, norms ``ck.norm(...)`` (smoothed norms included), KV quantisers
  ``ck.kv_cache(...)``. The two sequences run as one batch, as msModelSlim ran them (the v1 dynamic simulation
  takes statistics across the batch).
* DeepseekV3 cases: ``LLM(model=<fixture>, msmodelslim_path=..., msmodelslim_act_sim=...)`` -- skipped with the
  exception text when the loader cannot open the folder. The float source model is compared first (baseline).

Metrics: "tight" = max|ours - ref| / max|ref| (logits are O(3.6) here); "rel" = ||ours - ref||_2 / ||ref||_2.

Tolerances, per kind of case (measured values in brackets, this machine):

* fp32, float path with the activation simulation msModelSlim used (quant/msmodelslim/README.md §7): tight <= 1e-5.
The notes measured
  <= 1.8e-7 max-abs for a reference written from the §6 formulas; our forward computes RoPE / softmax slightly
  differently from transformers (float32 rounding only) [all fp32 Llama cases <= 2.4e-6 abs, <= 6.6e-7 tight;
  DeepseekV3 <= 1.7e-6 abs]. Which simulation: static / weight-only types have none; v0 W8A8_DYNAMIC simulates
  asymmetric per-token min/max (``msmodelslim_v0``, §7.1); v1 W8A8_DYNAMIC and v1 W4A8 per-channel simulate
  per-*input-channel* statistics across all tokens of the call (``msmodelslim_v1``, §7.2); v0 W4A8 per-group
  simulates the runtime's symmetric per-token quant (``runtime``); v0 W8A8_MIX (pdmix) fake-quant is its static
  path; C8 KV is applied by v1's fake-quant and not by v0's single prefill (§7.4).
* fp16 / bf16 models, both paths: rel <= 0.03 and closer to the fake-quant than the float model is. The stored
  deq_scale (and v0's scales) are rounded to the model dtype while msModelSlim's simulation uses the unrounded
  product (§7.3), and v0 computes in fp16 / bf16 (§7.5). A 0.2-0.5 % per-channel scale difference flips a few
  static activation roundings downstream, and on these tiny random models every flip moves the logits by
  about one quantisation step, so the gap is of the order of the quantisation effect itself [rel 1.9-2.5 %,
  float-vs-fake-quant 3.0 %].
* int path (what the NPU computes): tight <= 1e-5 where it uses the same integers as the simulation (static
  without a linear bias, W8A16, v0 W4A8 per-group) [<= 1.4e-6 abs]; rel <= 0.03 where it cannot:
  static with a linear bias (``round(bias/deq)*deq`` vs ``bias``, <= deq/2 per output, flips downstream static
  roundings) [0.3-1.6 %], dynamic types whose simulation is not the runtime's symmetric per-token quant
  [1.6-2.1 %], fp16/bf16 [as above]. For scale: msModelSlim's own int emulation differs from its own fake-quant
  by 1.3-2.9 % on the same cases.
* int path vs msModelSlim's ``int_infer_logits``: within the triangle bound rel(ours_int, fq) +
  rel(msm_int, fq) (+5 %, +1e-5): tight where msModelSlim's int emulation equals its fake-quant (W4A8 per-group,
  W8A16 per-group, W8A8S).
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import quant.msmodelslim as msm

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "msmodelslim")
MANIFEST = os.path.join(ROOT, "MANIFEST.json")
if not os.path.isfile(MANIFEST):
    pytest.skip("no msModelSlim fixtures in tests/fixtures/msmodelslim", allow_module_level=True)
CASES = json.load(open(MANIFEST))["cases"]
LLAMA = sorted(c for c, v in CASES.items() if v["model"].startswith("llama"))
DSV3 = sorted(c for c, v in CASES.items() if v["model"].startswith("dsv3"))

TIGHT = 1e-5
LOOSE = 0.03


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small tensors: one intra-op thread (OpenMP oversubscription on a busy CPU costs 20-50x here)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _tight(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _produced(case):
    v = CASES[case]
    if v["status"] != "ok":
        pytest.skip(f"{case}: not produced by msModelSlim ({v.get('expected_failure_reason') or v['status']})")
    return os.path.join(ROOT, case)


# ---------------------------------------------------------------------------------------------------------------
# Llama fixtures

# case -> float-path activation simulation, apply C8 KV in the forward, int-path tolerance kind
SPEC = {
    "w8a8_dynamic_v0": dict(act_sim="msmodelslim_v0", int_tol="loose"),  # v0: asymmetric per token
    "w8a8_dynamic_v1": dict(act_sim="msmodelslim_v1", int_tol="loose"),  # v1: per input channel over tokens
    "w4a8_dynamic_perchannel_v1": dict(act_sim="msmodelslim_v1", int_tol="loose"),
    "w4a8_dynamic_pergroup_v0": dict(act_sim="runtime"),  # v0 W4A8 simulates the symmetric per-token quant
    "w4a8_dynamic_pergroup_ascendv1_v0": dict(act_sim="runtime"),
    "w8a8_c8_sym_v1": dict(kv=True),  # v1 fake-quant applies C8 KV; v0's single prefill does not (§7.4)
    "w8a8_c8_asym_v1": dict(kv=True),
    "w8a8_static_bias_fp32_v0": dict(int_tol="loose"),  # linear bias: round(bias/deq) in quant_bias
    "w8a8_antioutlier_m2_v0": dict(int_tol="loose"),
    "w8a8_smoothquant_v1": dict(int_tol="loose"),
}


def _rope(T, d, theta):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = torch.arange(T).float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def llama_logits(ck, cfg, ids, path="float", act_sim="runtime", kv=False):
    """HF-Llama forward of the batch ``ids`` [B, T] with the checkpoint's modules; float32 logits [B, T, V]."""
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    B, T = ids.shape
    lin = lambda n: ck.linear(n, path=path, act_sim=act_sim)  # noqa: E731
    x = ck.tensor("model.embed_tokens.weight").float()[ids]
    cos, sin = _rope(T, hd, cfg.get("rope_theta", 10000.0))
    mask = torch.full((T, T), float("-inf")).triu(1)

    def heads(t, n):
        return t.view(B, T, n, hd).transpose(1, 2)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = ck.norm(p + "input_layernorm", eps=eps)(x)
        q = heads(lin(p + "self_attn.q_proj")(h), H)
        k = heads(lin(p + "self_attn.k_proj")(h), KV)
        v = heads(lin(p + "self_attn.v_proj")(h), KV)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if kv:  # C8: post-RoPE K and V as they enter the cache, per channel of [KV * hd]
            flat = lambda t: t.transpose(1, 2).reshape(B, T, KV * hd)  # noqa: E731
            k = heads(ck.kv_cache(p + "self_attn.k_proj")(flat(k)), KV)
            v = heads(ck.kv_cache(p + "self_attn.v_proj")(flat(v)), KV)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
        x = x + lin(p + "self_attn.o_proj")((a @ v).transpose(1, 2).reshape(B, T, H * hd))
        h = ck.norm(p + "post_attention_layernorm", eps=eps)(x)
        act = torch.nn.functional.silu(lin(p + "mlp.gate_proj")(h)) * lin(p + "mlp.up_proj")(h)
        x = x + lin(p + "mlp.down_proj")(act)
    return ck.linear("lm_head", path="float")(ck.norm("model.norm", eps=eps)(x)).float()


@pytest.mark.parametrize("case", LLAMA)
def test_llama_fixture_logits(case):
    folder = _produced(case)
    spec = SPEC.get(case, {})
    cfg = json.load(open(os.path.join(folder, "config.json")))
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    fq, fl, ids = ref["fakequant_logits"], ref["float_logits"], ref["input_ids"]
    low_precision = CASES[case]["model"] in ("llama_fp16", "llama_bf16")
    act_sim, kv = spec.get("act_sim", "runtime"), spec.get("kv", False)
    with msm.load(folder) as ck:
        if kv:
            assert ck.kv_cache_type == "C8" and ck.layout.kv
        y_float = llama_logits(ck, cfg, ids, "float", act_sim, kv)
        y_int = llama_logits(ck, cfg, ids, "int", "runtime", kv)
    assert bool(torch.isfinite(y_float).all()) and bool(torch.isfinite(y_int).all())
    d_float = _rel(fl, fq)  # what quantisation itself does to the logits
    if low_precision:
        for y in (y_float, y_int):
            assert _rel(y, fq) <= LOOSE and _rel(y, fq) < d_float, (case, _rel(y, fq), d_float)
    else:
        assert _tight(y_float, fq) <= TIGHT, (case, _tight(y_float, fq))
        if spec.get("int_tol") == "loose":
            assert _rel(y_int, fq) <= LOOSE, (case, _rel(y_int, fq))
        else:
            assert _tight(y_int, fq) <= TIGHT, (case, _tight(y_int, fq))
    if "int_infer_logits" in ref:
        mi = ref["int_infer_logits"]
        bound = 1.05 * (_rel(y_int, fq) + _rel(mi, fq)) + TIGHT
        assert _rel(y_int, mi) <= bound, (case, _rel(y_int, mi), bound)


def test_every_fixture_case_is_covered():
    on_disk = {d for d in os.listdir(ROOT) if not d.startswith("_") and os.path.isdir(os.path.join(ROOT, d))}
    ok = {c for c, v in CASES.items() if v["status"] == "ok"}
    assert ok == on_disk and ok <= set(LLAMA) | set(DSV3)
    assert set(SPEC) <= ok


# ---------------------------------------------------------------------------------------------------------------
# DeepseekV3 fixtures through LLM

# case -> float-path simulation. dsv3_w8a8_static_v0: v0 writes the MLP linears of this MoE model W8A8_DYNAMIC
# (attention W8A8), so its fake-quant has the v0 asymmetric per-token simulation too.
DSV3_SIM = {"dsv3_w8a8_static_v0": "msmodelslim_v0", "dsv3_w8a8_dynamic_v0": "msmodelslim_v0",
            "dsv3_mix_w8a8_w4a8_v1": "msmodelslim_v1"}


def _llm(folder, **kw):
    from ascend_dsv4 import LLM

    return LLM(model=folder, device="cpu", dtype="float32", progress=False, **kw)


def _per_sequence(llm, ids):
    return torch.stack([llm.logits(row.tolist()) for row in ids])


def _batched(llm, ids):
    """Both sequences in one ragged step (the v1 simulation takes statistics over every token of a call)."""
    r = llm.runner
    seqs = [r.new_sequence() for _ in range(ids.shape[0])]
    try:
        out = r.step(seqs, [row.tolist() for row in ids], logits="all")
    finally:
        for s in seqs:
            r.release(s)
    return out.float().reshape(ids.shape[0], ids.shape[1], -1)


def test_dsv3_float_source_matches_transformers():
    """Baseline for the quantised comparisons: our V3 model on the float source model vs transformers' logits."""
    src = os.path.join(ROOT, "_source_models", "dsv3_fp32")
    ref = load_file(os.path.join(ROOT, DSV3[0], "reference.safetensors"))
    y = _per_sequence(_llm(src), ref["input_ids"])
    assert _tight(y, ref["float_logits"]) <= TIGHT, _tight(y, ref["float_logits"])  # [4.9e-7]


@pytest.mark.parametrize("path", ["float", "int"])
@pytest.mark.parametrize("case", DSV3)
def test_dsv3_fixture_logits_via_llm(case, path):
    folder = _produced(case)
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    fq, ids = ref["fakequant_logits"], ref["input_ids"]
    sim = DSV3_SIM[case] if path == "float" else None
    try:
        llm = _llm(folder, msmodelslim_path=path, msmodelslim_act_sim=sim)
    except Exception as e:  # the loader may not support this folder (yet)
        pytest.skip(f"LLM cannot load {case}: {type(e).__name__}: {e}")
    y = _per_sequence(llm, ids)
    if path == "float" and case.endswith("_v0"):
        # v0 simulations are per token / per tensor: per-sequence runs see what msModelSlim saw [<= 7.2e-7 abs]
        assert _tight(y, fq) <= TIGHT, (case, _tight(y, fq))
    elif path == "float":
        # v1 mix: the per-input-channel simulation of the dynamic / W4A8 linears takes its statistics over all
        # tokens of a call, so run the batch as one step. Still not exact: LLM's QuantExperts applies the routing
        # weight *before* w2 while msModelSlim (transformers' DeepseekV3 MoE) and vllm-ascend apply it after the
        # expert, and per-channel statistics are not invariant to that per-row scaling [rel 5.4e-3 batched,
        # 1.6e-2 per sequence]; see test_dsv3_mix_exact_with_routing_weight_after_w2.
        assert _rel(_batched(llm, ids), fq) <= 0.01, (case, _rel(_batched(llm, ids), fq))
        assert _rel(y, fq) <= LOOSE, (case, _rel(y, fq))
    else:
        # int path = runtime symmetric per-token quant for the dynamic linears vs the simulation [1.9-2.1 %]
        assert _rel(y, fq) <= LOOSE, (case, _rel(y, fq))


def test_dsv3_mix_exact_with_routing_weight_after_w2():
    case = "dsv3_mix_w8a8_w4a8_v1"
    folder = _produced(case)
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    try:
        llm = _llm(folder, msmodelslim_path="float", msmodelslim_act_sim=DSV3_SIM[case])
    except Exception as e:
        pytest.skip(f"LLM cannot load {case}: {type(e).__name__}: {e}")
    y = _batched(llm, ref["input_ids"])
    assert _tight(y, ref["fakequant_logits"]) <= TIGHT, _tight(y, ref["fakequant_logits"])
