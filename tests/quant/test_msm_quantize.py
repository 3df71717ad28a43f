"""``ascend-dsv4 quantize`` (ascend_dsv4/quantize.py): msModelSlim-format W8A8_DYNAMIC / W8A8 / W4A8_DYNAMIC output.

* The per-linear quantisers reproduce real msModelSlim 26.1.0 output bit for bit (fixtures in
  tests/fixtures/msmodelslim: W8A8_DYNAMIC v1, W4A8_DYNAMIC per-channel v1 incl. packing and scale_bias, static
  W8A8 fp32 v1 and v0-with-bias deq_scale / quant_bias).
* For DeepSeek-V4 and V3 (the ``toy-v4`` / ``toy-v3`` presets: hash, CSA and HCA layers, dense and MoE layers,
  the MTP layer) and every ``--type``: the folder is read by
  ``quant.msmodelslim.load``; tensor names are exactly the official V4 / HF V3 checkpoint names; the recipe's
  quantised set has the expected types and everything else is FLOAT; the MTP layer is described; every quantised
  linear's ``.linear(name, "float")`` is close to ``x @ W^T`` of the float weight.

Tolerances (relative L2 error of the output over a batch, worst linear):

* W8 types < 2 %: int8 per-channel weights give a relative weight error of about absmax/(127*sqrt(12)) / sigma
  ~ 0.7 % for N(0, 1/k) rows (absmax ~ 3 sigma) plus < 0.5 % from 8-bit activations; measured <= 1.1 %.
* W4 (routed experts of ``w4a8_dynamic``) < 15 %, not 10 %: per-channel int4 *minmax* (what msModelSlim's v1
  ``int4 per_channel minmax`` does, bit-exact below) has step absmax/7 ~ 0.4 sigma for Gaussian rows of k = 128..256
  (E[absmax] ~ 2.7-2.9 sigma), i.e. a rounding error of 0.4/sqrt(12) ~ 11.5-12.5 % of sigma -- measured 12-13.5 %
  on the toy weights. Even the MSE-optimal clipping of a 16-level uniform quantiser leaves ~10.7 % on a Gaussian, so
  < 10 % is not reachable with per-channel int4 on these random weights; the W4 weights are additionally checked
  element-wise (|W_deq - W| <= scale/2) and bit-exact against msModelSlim.
* int path vs float path of the same checkpoint: W8A8_DYNAMIC / W4A8 identical math (1e-5 relative); static W8A8
  without a bias identical integers (1e-5).
* W8A8 (static) inputs are drawn uniformly inside each linear's calibrated range (a static scale is only meaningful
  there; outside it activations clip by design).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import quant.msmodelslim as msm
from ascend_dsv4.quantize import (
    activation_qparams,
    checkpoint_tensors,
    expected_tensor_names,
    quantize_model,
    quantize_weight_int4,
    w4a8_dynamic_tensors,
    w8a8_dynamic_tensors,
    w8a8_static_tensors_from_qparams,
)
from quant.msmodelslim.description import KNOWN_TYPES, Description, read_description
from quant.msmodelslim.validate import metas_from_store, validate
from quant.msmodelslim.weights import WeightStore
from quant.errors import QuantFormatError

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "msmodelslim")
TYPES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic")

MODELS = ("toy-v4", "toy-v3")
# a smaller V3 for the CLI test, which first writes a random checkpoint folder
SMALL_V3 = {"n_layers": 2, "n_dense_layers": 1, "n_routed_experts": 4, "n_expert_groups": 1, "n_limited_groups": 1}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small tensors: one intra-op thread (OpenMP oversubscription on a busy CPU costs 20-50x here)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# ---------------------------------------------------------------------------------------------------------------
# bit-exactness of the per-linear quantisers against real msModelSlim output


def _fixture(case, name):
    return load_file(os.path.join(FIX, case, name))


@pytest.mark.skipif(not os.path.isdir(os.path.join(FIX, "_source_models")), reason="no msModelSlim fixtures")
def test_quantizers_match_msmodelslim_bit_exactly():
    src = load_file(os.path.join(FIX, "_source_models", "llama_fp32", "model.safetensors"))
    n_checked = 0
    # W8A8_DYNAMIC (v1): weight, weight_scale, weight_offset
    q = _fixture("w8a8_dynamic_v1", "quant_model_weights.safetensors")
    for k in [k for k in q if k.endswith(".weight_scale")]:
        n = k[: -len(".weight_scale")]
        for suffix, t in w8a8_dynamic_tensors(src[n + ".weight"]).items():
            assert torch.equal(t, q[f"{n}.{suffix}"]), f"{n}.{suffix}"
            n_checked += 1
    # W4A8_DYNAMIC per channel (v1): packed weight, weight_scale, weight_offset, scale_bias ([n,16] for o/down)
    q = _fixture("w4a8_dynamic_perchannel_v1", "quant_model_weights.safetensors")
    for k in [k for k in q if k.endswith(".scale_bias")]:
        n = k[: -len(".scale_bias")]
        chunks = 16 if n.endswith(("o_proj", "down_proj")) else 1
        assert q[k].shape[1] == chunks
        for suffix, t in w4a8_dynamic_tensors(src[n + ".weight"], chunks).items():
            assert t.dtype == q[f"{n}.{suffix}"].dtype and torch.equal(t, q[f"{n}.{suffix}"]), f"{n}.{suffix}"
            n_checked += 1
    # static W8A8 (v1 fp32 -> int64 deq_scale): given msModelSlim's activation parameters, every tensor is equal
    q = _fixture("w8a8_static_fp32_v1", "quant_model_weights.safetensors")
    for k in [k for k in q if k.endswith(".deq_scale")]:
        n = k[: -len(".deq_scale")]
        t = w8a8_static_tensors_from_qparams(src[n + ".weight"], float(q[n + ".input_scale"]),
                                             float(q[n + ".input_offset"]), torch.float32)
        assert set(t) == {s.rsplit(".", 1)[1] for s in q if s.startswith(n + ".")}
        for suffix, v in t.items():
            assert v.dtype == q[f"{n}.{suffix}"].dtype and torch.equal(v, q[f"{n}.{suffix}"]), f"{n}.{suffix}"
            n_checked += 1
    # static W8A8 with a linear bias folded into quant_bias (v0 fp32)
    src_b = load_file(os.path.join(FIX, "_source_models", "llama_bias_fp32", "model.safetensors"))
    q = _fixture("w8a8_static_bias_fp32_v0", "quant_model_weight_w8a8.safetensors")
    for k in [k for k in q if k.endswith(".deq_scale")]:
        n = k[: -len(".deq_scale")]
        t = w8a8_static_tensors_from_qparams(src_b[n + ".weight"], float(q[n + ".input_scale"]),
                                             float(q[n + ".input_offset"]), torch.float32, src_b.get(n + ".bias"))
        for suffix in ("weight", "deq_scale", "quant_bias"):
            assert torch.equal(t[suffix], q[f"{n}.{suffix}"]), f"{n}.{suffix}"
            n_checked += 1
    assert n_checked > 100


@pytest.mark.skipif(not os.path.isdir(os.path.join(FIX, "_source_models")), reason="no msModelSlim fixtures")
@pytest.mark.parametrize("case", ["w8a8_static_fp32_v1", "w8a8_c8_sym_v1"])
def test_activation_qparams_match_msmodelslim_v1(case):
    """Layer 0's q/k/v see the un-quantised input_layernorm output of the calibration ids, so the fixture's
    input_scale / input_offset follow from its min/max alone (later linears see msModelSlim's partly quantised
    model): quant/msmodelslim/README.md §6 formula, bit-exact."""
    src = load_file(os.path.join(FIX, "_source_models", "llama_fp32", "model.safetensors"))
    ids = _fixture(case, "reference.safetensors")["calib_input_ids"]
    q = _fixture(case, "quant_model_weights.safetensors")
    x = src["model.embed_tokens.weight"][ids]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * src["model.layers.0.input_layernorm.weight"]
    s, o = activation_qparams(float(h.min()), float(h.max()), torch.float32)
    for proj in ("q_proj", "k_proj", "v_proj"):
        n = f"model.layers.0.self_attn.{proj}"
        assert (s, o) == (float(q[n + ".input_scale"]), float(q[n + ".input_offset"])), n


# ---------------------------------------------------------------------------------------------------------------
# whole-model output


@pytest.fixture(scope="module")
def llms():
    from ascend_dsv4 import LLM

    return {m: LLM(model=m, device="cpu", dtype="float32", progress=False, dequantize=True) for m in MODELS}


@pytest.fixture(scope="module")
def outputs(llms, tmp_path_factory):
    out = {}
    for m, llm in llms.items():
        for t in TYPES:
            d = str(tmp_path_factory.mktemp(f"{m}-{t}"))
            out[m, t] = (d, quantize_model(llm, t, d, calib_tokens=64, seed=0, log=None))
    return out


def _load(folder):
    return msm.load(folder)


def test_v4_output_loads_with_msm_load(outputs):
    msm.load(outputs["toy-v4", "w8a8_dynamic"][0]).close()


def test_v3_output_loads_with_msm_load(outputs):
    for t in TYPES:
        msm.load(outputs["toy-v3", t][0]).close()


V4_QUANT = ("attn.wq_b", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
            "ffn.shared_experts.w3")
V4_FLOAT = ("attn.wq_a", "attn.wkv", "attn.wo_a", "attn.compressor.wkv", "attn.compressor.wgate",
            "attn.indexer.weights_proj", "attn.indexer.compressor.wkv", "ffn.gate")
V3_QUANT = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
            "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


def _expected_type(qtype, routed):
    return {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC"}.get(qtype, "W4A8_DYNAMIC" if routed else "W8A8_DYNAMIC")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_checkpoint(model, qtype, llms, outputs):
    llm = llms[model]
    cfg = llm.cfg
    folder, summary = outputs[model, qtype]
    raw = json.load(open(os.path.join(folder, "quant_model_description.json")))
    assert raw["model_quant_type"] == qtype.upper() and raw["version"] == "1.0.0"
    conf = json.load(open(os.path.join(folder, "config.json")))
    assert "quantization_config" not in conf and conf["torch_dtype"] == "bfloat16"
    assert conf["num_hidden_layers"] == cfg.n_layers
    ck = _load(folder)
    try:
        # names: exactly the official V4 / DeepSeek HF V3 checkpoint tensors (scales aside), all described
        W = {k: t for k, t, _ in checkpoint_tensors(llm)}
        assert set(W) == expected_tensor_names(cfg)
        meta = ("weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias", "deq_scale", "scale_bias")
        base = {k for k in ck.types if k.rsplit(".", 1)[-1] not in meta}
        assert base == set(W)
        assert set(ck.weights.keys()) == set(ck.types)
        # recipe: which linears are quantised, with which type; the MTP layer described and quantised too
        if cfg.model_type == "deepseek_v4":
            blocks = [f"layers.{i}." for i in range(cfg.n_layers)] + [f"mtp.{j}." for j in range(cfg.n_mtp_layers)]
            for p in blocks:
                lid = cfg.n_layers if p.startswith("mtp") else int(p.split(".")[1])
                for s in V4_QUANT:
                    if "indexer" in s and cfg.compress_ratios[lid] != 4:
                        continue
                    assert ck.types[p + s + ".weight"] == _expected_type(qtype, False), p + s
                for e in range(cfg.n_routed_experts):
                    for w in ("w1", "w2", "w3"):
                        assert ck.types[f"{p}ffn.experts.{e}.{w}.weight"] == _expected_type(qtype, True)
                for s in V4_FLOAT:
                    if p + s + ".weight" in ck.types:
                        assert ck.types[p + s + ".weight"] == "FLOAT", p + s
            for k in ("embed.weight", "head.weight", "norm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight",
                      "hc_head_fn", "layers.0.ffn.gate.tid2eid", f"layers.{cfg.n_hash_layers}.ffn.gate.bias"):
                assert ck.types[k] == "FLOAT", k
            assert any(k.startswith("mtp.0.") and v != "FLOAT" for k, v in ck.types.items())
        else:
            L = cfg.n_layers
            for lid in range(L + cfg.n_mtp_layers):
                p = f"model.layers.{lid}."
                names = V3_QUANT if cfg.is_moe_layer(lid) else V3_QUANT[:4] + ("mlp.gate_proj", "mlp.up_proj",
                                                                              "mlp.down_proj")
                for s in names:
                    assert ck.types[p + s + ".weight"] == _expected_type(qtype, False), p + s
                assert ck.types[p + "self_attn.kv_b_proj.weight"] == "FLOAT"
                if cfg.is_moe_layer(lid):
                    assert ck.types[p + "mlp.gate.weight"] == "FLOAT"
                    for e in range(cfg.n_routed_experts):
                        for w in ("gate_proj", "up_proj", "down_proj"):
                            assert ck.types[f"{p}mlp.experts.{e}.{w}.weight"] == _expected_type(qtype, True)
            mtp = f"model.layers.{L}."  # the MTP layer: described (never left out), float head/embed copies
            for s in ("eh_proj.weight", "enorm.weight", "embed_tokens.weight", "shared_head.head.weight"):
                assert ck.types[mtp + s] == "FLOAT"
            assert ck.layout.mtp_layers == (L,) and not ck.layout.mtp_float_keys
            for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
                assert ck.types[k] == "FLOAT"
        # dtypes: float tensors bf16 except the official F32 ones; quantised linears msModelSlim's dtypes
        assert ck.weights.info("lm_head.weight" if cfg.model_type == "deepseek_v3" else "head.weight").torch_dtype \
            == torch.bfloat16
        # numerics of every quantised linear
        g = torch.Generator().manual_seed(1)
        worst = {}
        for name, t in ck.entries(quantized_only=True):
            w = W[name + ".weight"].float()
            lf, li = ck.linear(name, path="float"), ck.linear(name, path="int")
            if t == "W8A8":
                assert lf.deq_encoding == "float32"  # bf16 serving dtype: float32 deq_scale
                s, o = float(lf.input_scale), float(lf.input_offset)
                lo, hi = (-128 - o) * s, (127 - o) * s
                x = lo + (hi - lo) * torch.rand(8, w.shape[1], generator=g)
            else:
                x = torch.randn(8, w.shape[1], generator=g)
            y = x @ w.T
            yf = lf(x)
            err = float((yf - y).norm() / y.norm())
            worst[t] = max(worst.get(t, 0.0), err)
            assert err < (0.15 if t == "W4A8_DYNAMIC" else 0.02), (name, t, err)
            assert float((li(x) - yf).norm() / yf.norm()) < 1e-5, name
            if t == "W4A8_DYNAMIC":
                ws = lf.weight_scale
                assert bool(((lf.dequant_weight() - w).abs() <= ws / 2 * (1 + 1e-6) + 1e-12).all()), name
        assert set(worst) == {_expected_type(qtype, False), _expected_type(qtype, True)}
        # summary
        n_q = len(ck.entries(quantized_only=True))
        assert sum(v["linears"] for k, v in summary["per_type"].items() if k != "FLOAT") == n_q
        assert summary["bytes"] == sum(i.nbytes for i in ck.weights.infos().values())
        assert 0.5 < summary["bytes_per_param"] < 2.5
    finally:
        ck.close()


@pytest.mark.parametrize("model", [
    "toy-v3",
    "toy-v4",
])
def test_llm_runs_the_quantized_folder(model, llms, tmp_path):
    """Round trip through LLM's msModelSlim loader: names agree, both paths run, logits stay near the float model.

    float32 serving dtype so that only quantisation differs. Bounds: the int and float paths of W8A8_DYNAMIC are the
    same math up to float32 rounding, but a 1e-7 difference can flip a per-token activation rounding downstream,
    so after a whole forward rel-L2 < 0.15 [measured 7e-4 on toy-v3; on toy-v4, whose 7 hyper-connected layers
    amplify one flipped rounding more, it depends on the prompt: 0.079 / 0.074 / 0.003 / 0.012 / 0.004 / 0.057 for
    prompt seeds 5-10, and with session 7's random head 0.015 / 0.014 / 0.084 / 0.000 / 0.003 / 0.000 -- the old bound
    3e-2 held for seed 5 of that model only]; against the float model rel-L2 < 0.25 and top-1 agreement >=
    0.75 [measured 0.118 / 0.875 on toy-v3] -- this random toy model amplifies weight errors ~8x (1 % Gaussian
    noise on the quantised weights alone moves its logits by 8.5 %), so the bound only catches gross errors
    (a wrong name or layout gives rel ~ 1).
    """
    from ascend_dsv4 import LLM

    out = str(tmp_path / "q")
    base = llms[model]
    quantize_model(base, "w8a8_dynamic", out, dtype="float32", log=None)
    ids = torch.randint(0, base.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    y0 = base.logits(ids)
    yf = LLM(model=out, device="cpu", dtype="float32", progress=False, msmodelslim_path="float").logits(ids)
    yi = LLM(model=out, device="cpu", dtype="float32", progress=False, msmodelslim_path="int").logits(ids)
    assert float((yi - yf).norm() / yf.norm()) < 0.15
    assert float((yf - y0).norm() / y0.norm()) < 0.25
    assert float((yf.argmax(-1) == y0.argmax(-1)).float().mean()) >= 0.75


def test_static_fp32_writes_int64_deq_scale_and_float32_tensors(llms, tmp_path):
    out = str(tmp_path / "q")
    summary = quantize_model(llms["toy-v3"], "w8a8", out, calib_tokens=16, seed=3, dtype="float32", shard_gb=0.004,
                             log=None)
    n = len(summary["files"])  # ~15 MB in shards of <= 4 MiB: numbered files + index (v1 AscendV1Saver layout)
    assert n > 1 and summary["files"][0] == f"quant_model_weights-00001-of-{n:05d}.safetensors"
    assert os.path.isfile(os.path.join(out, "quant_model_weights.safetensors.index.json"))
    with msm.load(out) as ck:
        assert ck.weights.index_path is not None and len(ck.weights.files) == n
        assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "float32"
        name = "model.layers.1.self_attn.o_proj"
        assert ck.weights.info(name + ".deq_scale").torch_dtype == torch.int64
        assert ck.linear(name).deq_encoding == "msmodelslim_int64"
        assert ck.weights.info("model.embed_tokens.weight").torch_dtype == torch.float32


def test_w4_quantizer_range_and_zero_rows():
    w = torch.randn(6, 64)
    w[3] = 0
    q, s = quantize_weight_int4(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and bool((s > 0).all())
    assert bool((q[3] == 0).all())
    with pytest.raises(Exception, match="even"):
        w4a8_dynamic_tensors(torch.randn(5, 64))


def test_cli_quantize_from_folder(tmp_path, capsys):
    """CLI end to end on a random V3 checkpoint folder (BF16, 2 layers): summary, files, copied extras, errors."""
    from ascend_dsv4.models import preset
    from ascend_dsv4.entrypoints.cli import main
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint as write_checkpoint_v3

    cfg = preset("toy-v3").replace(dtype="bf16", **SMALL_V3)
    src = tmp_path / "src"
    write_checkpoint_v3(cfg, str(src), seed=1, progress=False)
    (src / "generation_config.json").write_text('{"bos_token_id": 0}')
    out = tmp_path / "out"
    rc = main(["quantize", "--model", str(src), "--type", "w4a8_dynamic", "--out", str(out), "--seed", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "W4A8_DYNAMIC" in text and "W8A8_DYNAMIC" in text and "bytes/param" in text
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "quant_model_description.json",
                                       "quant_model_weights.safetensors"]
    with msm.load(str(out)) as ck:
        assert ck.model_quant_type == "W4A8_DYNAMIC" and ck.layout.mtp_layers == (cfg.n_layers,)
    rc = main(["quantize", "--model", str(src), "--type", "w8a8", "--out", str(out)])
    assert rc == 2 and "not empty" in capsys.readouterr().err
