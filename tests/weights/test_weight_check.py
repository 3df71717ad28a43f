"""Issue 10 item 2: non-finite weights never load silently; configs whose values make the math non-finite, or
that lack a field sizing the model, are ConfigErrors naming the field."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.models.deepseek_v4.config import from_hf_dict, from_official_dict
from ascend_dsv4.entrypoints.cli import main
from ascend_dsv4.errors import CheckpointError, ConfigError
from ascend_dsv4.weights import weight_check
from ascend_dsv4.weights.random_checkpoint import write_checkpoint
from ascend_dsv4.weights.weight_check import count_nonfinite, nonfinite_flag


# ---- the counter -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_count_float(dtype, monkeypatch):
    monkeypatch.setattr(weight_check, "_CHUNK", 7)  # several chunks, one partial
    x = torch.randn(5, 9).to(dtype)
    assert int(count_nonfinite(x)) == 0
    x[0, 0], x[2, 8], x[4, 3] = math.nan, math.inf, -math.inf
    assert int(count_nonfinite(x)) == 3
    assert int(count_nonfinite(x.t())) == 3  # non-contiguous


def test_count_fp8_nan_codes():
    b = torch.zeros(16, dtype=torch.uint8)
    b[3], b[9] = 0x7F, 0xFF  # e4m3fn NaN codes (no infinity)
    b[4], b[5] = 0x7E, 0xFE  # +-448: finite
    assert int(count_nonfinite(b.view(torch.float8_e4m3fn))) == 2
    e = torch.zeros(16, dtype=torch.uint8)
    e[0], e[1], e[2], e[3] = 0x7C, 0xFC, 0x7D, 0x7B  # +inf, -inf, NaN, 57344 (finite)
    assert int(count_nonfinite(e.view(torch.float8_e5m2))) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_flag_float_every_position(dtype, value):
    x = torch.randn(67).to(dtype)
    assert not bool(nonfinite_flag(x))
    for i in (0, 1, 31, 32, 66):  # vector lanes, tails
        y = x.clone()
        y[i] = value
        assert bool(nonfinite_flag(y)) and bool(nonfinite_flag(y[None].t()))


def test_flag_fp8_codes():
    for code, bad in [(0x7F, True), (0xFF, True), (0x7E, False), (0xFE, False), (0x80, False), (0x00, False)]:
        b = torch.full((33,), 0x38, dtype=torch.uint8)
        b[17] = code
        assert bool(nonfinite_flag(b.view(torch.float8_e4m3fn))) == bad, hex(code)
    for code, bad in [(0x7C, True), (0xFC, True), (0x7F, True), (0xFD, True), (0x7B, False), (0xFB, False)]:
        b = torch.full((33,), 0x38, dtype=torch.uint8)
        b[5] = code
        assert bool(nonfinite_flag(b.view(torch.float8_e5m2))) == bad, hex(code)


def test_ints_and_packed_fp4_are_not_counted():
    assert int(count_nonfinite(torch.full((4,), 255, dtype=torch.uint8))) == 0
    assert int(count_nonfinite(torch.full((4,), -1, dtype=torch.int8))) == 0
    assert not bool(nonfinite_flag(torch.full((4,), 255, dtype=torch.uint8)))


# ---- the loader --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def official(tmp_path_factory):
    d = tmp_path_factory.mktemp("official")
    cfg = preset("toy-v4").replace(index_topk=128, vocab_size=512, n_routed_experts=8)
    write_checkpoint(cfg, str(d), "official", seed=5, shard_bytes=2 << 20, progress=False)
    return str(d)


def _poison(src, dst, edits: dict):
    """Copy the checkpoint, then set one element of each named tensor: edits = {name: (flat index, value)}.
    ``value`` is a float, or an int (a raw byte for 1-byte dtypes)."""
    shutil.copytree(src, dst)
    wm = json.load(open(os.path.join(dst, "model.safetensors.index.json")))["weight_map"]
    for shard in sorted({wm[n] for n in edits}):
        p = os.path.join(dst, shard)
        t = load_file(p)
        for n, (i, v) in edits.items():
            if wm[n] != shard:
                continue
            x = t[n].clone()
            if isinstance(v, int):
                x.view(torch.uint8).view(-1)[i] = v
            else:
                x.view(-1)[i] = v
            t[n] = x
        save_file(t, p)
    return str(dst), wm


CASES = {
    "bf16 norm": ("layers.0.attn_norm.weight", (3, math.nan)),
    "embedding": ("embed.weight", (100, math.inf)),
    "fp8 weight 0x7F": ("layers.0.attn.wq_a.weight", (5, 0x7F)),
    "fp8 weight 0xFF": ("layers.1.attn.wkv.weight", (0, 0xFF)),
    "fp8 weight dequantised at load (wo_a)": ("layers.0.attn.wo_a.weight", (7, 0x7F)),
    "f32 hc_*": ("layers.2.hc_attn_fn", (11, math.nan)),
    "attn_sink": ("layers.3.attn.attn_sink", (1, -math.inf)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_non_finite_weight_is_a_checkpoint_error(official, tmp_path, case):
    name, edit = CASES[case]
    d, wm = _poison(official, tmp_path / "ck", {name: edit})
    with pytest.raises(CheckpointError) as e:
        LLM(model=d, device="cpu", progress=False)
    msg = str(e.value)
    assert f"{wm[name]}: {name}" in msg and "1 non-finite value(s)" in msg, msg


def test_every_bad_tensor_reported_with_its_count_and_skip_flag_loads(official, tmp_path):
    edits = {"norm.weight": (0, math.nan), "hc_head_fn": (1, math.nan), "layers.0.attn.wq_b.weight": (2, 0xFF)}
    d, wm = _poison(official, tmp_path / "ck", edits)
    ck = load_file(os.path.join(d, wm["norm.weight"]))
    x = ck["norm.weight"].clone()
    x[5:9] = math.inf  # 4 more in the same tensor: the count is per tensor
    ck["norm.weight"] = x
    save_file(ck, os.path.join(d, wm["norm.weight"]))
    with pytest.raises(CheckpointError) as e:
        LLM(model=d, device="cpu", progress=False)
    msg = str(e.value)
    assert "3 problem(s)" in msg and "norm.weight: 5 non-finite" in msg
    assert "hc_head_fn: 1 non-finite" in msg and "layers.0.attn.wq_b.weight: 1 non-finite" in msg
    assert LLM(model=d, device="cpu", progress=False, skip_weight_check=True).model is not None  # opt-out loads
    with pytest.raises(CheckpointError, match="non-finite"):
        LLM(model=d, device="cpu", progress=False, dequantize=True)  # dequantised storage is checked too


def test_cli_names_the_tensor_and_has_skip_weight_check(official, tmp_path, capsys):
    d, wm = _poison(official, tmp_path / "ck", {"layers.0.ffn_norm.weight": (0, math.nan)})
    assert main(["generate", "--model", d, "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "layers.0.ffn_norm.weight: 1 non-finite" in err
    main(["generate", "--model", d, "--prompt", "hi", "--max-tokens", "1", "--skip-weight-check"])
    assert "non-finite value(s) (NaN or Inf) in the weight" not in capsys.readouterr().err


# ---- configs ------------------------------------------------------------------------------------------------------
def _official(**over):
    d = {k: v for k, v in preset("toy-v4").to_dict().items() if k not in ("name", "model_type")}
    d.update(over)
    return d


@pytest.mark.parametrize("field,value", [
    ("norm_eps", 0.0), ("norm_eps", -1e-6), ("hc_eps", 0.0), ("rope_factor", 0.0), ("rope_factor", -2.0),
    ("rope_theta", -10000.0), ("rope_theta", 1.0), ("compress_rope_theta", -5.0), ("compress_rope_theta", 0.0),
    ("beta_fast", -32.0), ("beta_slow", -1.0), ("beta_slow", 0.0), ("original_seq_len", -1),
])
def test_config_values_making_math_non_finite(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        from_official_dict(_official(**{field: value}))


def test_beta_fast_below_beta_slow():
    with pytest.raises(ConfigError, match="'beta_fast'.*beta_slow"):
        from_official_dict(_official(beta_fast=1.0, beta_slow=32.0))
    with pytest.raises(ConfigError, match="'beta_fast'"):
        preset("toy-v3").replace(beta_fast=0.5, beta_slow=1.0)
    with pytest.raises(ConfigError, match="'rope_theta'"):
        preset("toy-v3").replace(rope_theta=1.0)


@pytest.mark.parametrize("field", ["dim", "n_layers", "vocab_size", "n_heads", "moe_inter_dim"])
def test_missing_required_official_field_is_named(field):
    d = _official()
    d.pop(field)
    with pytest.raises(ConfigError, match=f"'{field}' missing"):
        from_official_dict(d)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_missing_required_hf_field_is_named(field):
    d = preset("toy-v4").to_hf_dict()
    d.pop(field)
    with pytest.raises(ConfigError, match=f"'{field}' missing"):
        from_hf_dict(d)


def test_bos_token_id_out_of_range_names_bos():
    with pytest.raises(ConfigError, match="'bos_token_id'"):
        from_official_dict(_official(bos_token_id=5000))
    with pytest.raises(ConfigError, match="'eos_token_id'"):
        from_official_dict(_official(eos_token_id=-1))


def test_msmodelslim_float_tensor_nan_is_a_checkpoint_error(tmp_path):
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "msmodelslim", "dsv3_w8a8_dynamic_v0")
    d = tmp_path / "msm"
    shutil.copytree(src, d)
    p = d / "quant_model_weight_w8a8_dynamic.safetensors"
    t = load_file(str(p))
    name = "model.layers.0.post_attention_layernorm.weight"
    x = t[name].clone()
    x[3] = math.inf
    t[name] = x
    save_file(t, str(p))
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(d), device="cpu", progress=False)
    assert f"quant_model_weight_w8a8_dynamic.safetensors: {name}: 1 non-finite" in str(e.value)
    LLM(model=str(d), device="cpu", progress=False, skip_weight_check=True)
