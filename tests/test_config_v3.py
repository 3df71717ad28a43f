"""DeepseekV3Config: presets, HF (published / transformers-written) and official parsers, YaRN scaling, rules."""

from __future__ import annotations

import json
import math

import pytest

from ascend_dsv4.models import ALL_PRESETS, from_dict, load_config, preset
from ascend_dsv4.models.deepseek_v3.config import (
    PRESETS as V3_PRESETS, DeepseekV3Config, from_hf_dict as from_hf_dict_v3,
    from_official_dict as from_official_dict_v3, yarn_get_mscale,
)
from ascend_dsv4.models.deepseek_v4.config import PRESETS, DeepseekV4Config as ModelConfig
from ascend_dsv4.errors import ConfigError

TOY = preset("toy-v3")
V3 = preset("deepseek-v3")


def _no_name(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("name")
    return d


def _published_hf_v3() -> dict:
    """DeepSeek's published HF config.json of deepseek-ai/DeepSeek-V3 (R1 and V3-0324 are identical in shape)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    }


# inference/configs/config_671B.json of the official DeepSeek-V3 repository
OFFICIAL_671B = {
    "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 8,
    "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5, "score_func": "sigmoid", "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8",
}


# ---- presets -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(V3_PRESETS))
def test_presets_valid(name):
    cfg = preset(name)
    assert isinstance(cfg, DeepseekV3Config) and cfg.name == name
    assert cfg.validate() is cfg
    assert load_config(name) == cfg
    assert name in ALL_PRESETS and name not in PRESETS  # PRESETS stays V4-only
    assert all(isinstance(preset(n), ModelConfig) for n in PRESETS)


def test_toy_preset_fields():
    expect = dict(vocab_size=1024, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=4, n_mtp_layers=1,
                  n_dense_layers=1, n_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, n_expert_groups=4, n_limited_groups=2,
                  n_activated_experts=3, n_shared_experts=1, route_scale=2.5, norm_topk_prob=True, rope_factor=4.0,
                  original_seq_len=1024, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                  max_position_embeddings=4096, rope_theta=10000.0, score_func="sigmoid")
    assert {k: getattr(TOY, k) for k in expect} == expect
    assert TOY.qk_head_dim == 96 and TOY.yarn
    assert [i for i in range(5) if TOY.is_moe_layer(i)] == [1, 2, 3, 4]  # the MTP layer (id 4) is MoE
    assert TOY.dense_layers == [0] and TOY.moe_layers == [1, 2, 3]
    m = 0.1 * math.log(4.0) + 1.0
    assert TOY.softmax_scale == pytest.approx(96 ** -0.5 * m * m, rel=1e-12)
    assert TOY.rope_attention_factor == 1.0


def test_v3_preset_fields():
    expect = dict(vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_mtp_layers=1,
                  n_dense_layers=3, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_expert_groups=8, n_limited_groups=4,
                  n_activated_experts=8, n_shared_experts=1, route_scale=2.5, rope_theta=10000.0, rope_factor=40.0,
                  original_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                  max_position_embeddings=163840, dtype="fp8", bos_token_id=0, eos_token_id=1)
    assert {k: getattr(V3, k) for k in expect} == expect
    assert V3.qk_head_dim == 192 and V3.experts_per_group == 32
    assert V3.moe_layers == list(range(3, 61)) and V3.is_moe_layer(61)
    assert V3.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert V3.rope_attention_factor == 1.0


# ---- YaRN scaling = transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("factor, mscale, mscale_all_dim", [
    (40.0, 1.0, 1.0), (40.0, 0.707, 0.707), (4.0, 1.0, 0.5), (4.0, 0.0, 1.0), (4.0, 1.0, 0.0), (4.0, 0.0, 0.0),
    (1.0, 1.0, 1.0),
])
def test_yarn_scales_match_transformers(factor, mscale, mscale_all_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = TOY.replace(rope_factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim)
    hf = json.loads(json.dumps(cfg.to_hf_dict()))
    hf_cfg = transformers.DeepseekV3Config.from_dict(hf)
    if factor > 1:
        _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    else:
        attention_factor = 1.0
        assert hf_cfg.rope_parameters.get("rope_type", "default") == "default"
    assert cfg.rope_attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(yarn_apply_mscale(hf_cfg.rope_parameters, cfg.qk_head_dim ** -0.5),
                                              rel=1e-12)
    got = from_hf_dict_v3(hf)
    assert (got.rope_attention_factor, got.softmax_scale) == (cfg.rope_attention_factor, cfg.softmax_scale)


def test_yarn_get_mscale():
    assert yarn_get_mscale(1.0, 5.0) == 1.0 and yarn_get_mscale(0.5) == 1.0
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(1.3688879454113936)


# ---- HF parser -----------------------------------------------------------------------------------------

def test_hf_published_gives_v3_preset(tmp_path):
    d = _published_hf_v3()
    got = from_hf_dict_v3(d)
    assert _no_name(got) == _no_name(V3)
    assert isinstance(got.rope_factor, float) and isinstance(got.original_seq_len, int)
    assert got.extra["topk_method"] == "noaux_tc" and "hidden_size" not in got.extra
    assert _no_name(from_dict(d)) == _no_name(V3)
    # V3.1: same file with a ue8m0 scale format
    d31 = json.loads(json.dumps(d))
    d31["quantization_config"]["scale_fmt"] = "ue8m0"
    assert _no_name(from_hf_dict_v3(d31)) == _no_name(V3)
    # through a folder and a file
    (tmp_path / "config.json").write_text(json.dumps(d, indent=2))
    assert _no_name(load_config(str(tmp_path))) == _no_name(V3)
    assert isinstance(load_config(str(tmp_path / "config.json")), DeepseekV3Config)
    # no quantization_config: a BF16 checkpoint; eos as a list
    d.pop("quantization_config")
    d["eos_token_id"] = [1, 2]
    assert _no_name(from_hf_dict_v3(d)) == _no_name(V3.replace(dtype="bf16"))


@pytest.mark.parametrize("name", sorted(V3_PRESETS))
def test_hf_round_trip(name):
    cfg = preset(name)
    assert _no_name(from_dict(json.loads(json.dumps(cfg.to_hf_dict())))) == _no_name(cfg)


def _transformers_kwargs(cfg: DeepseekV3Config) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.inter_dim,
        moe_intermediate_size=cfg.moe_inter_dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_routed_experts, routed_scaling_factor=cfg.route_scale, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.n_expert_groups, topk_group=cfg.n_limited_groups,
        num_experts_per_tok=cfg.n_activated_experts, first_k_dense_replace=cfg.n_dense_layers,
        max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=cfg.n_mtp_layers,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor, "rope_theta": cfg.rope_theta,
                         "original_max_position_embeddings": cfg.original_seq_len, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow, "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim},
    )


@pytest.mark.parametrize("name", sorted(V3_PRESETS))
def test_transformers_written(name):
    transformers = pytest.importorskip("transformers")
    cfg = preset(name)
    d = json.loads(json.dumps(transformers.DeepseekV3Config(**_transformers_kwargs(cfg)).to_dict()))
    assert "rope_parameters" in d and "rope_scaling" not in d and "quantization_config" not in d
    got = from_dict(d)
    assert isinstance(got, DeepseekV3Config)
    assert _no_name(got) == _no_name(cfg.replace(dtype="bf16"))  # no quantization_config: BF16
    # with the FP8 quantization_config DeepSeek ships
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    c = transformers.DeepseekV3Config(**_transformers_kwargs(cfg), quantization_config=q)
    assert _no_name(from_dict(json.loads(json.dumps(c.to_dict())))) == _no_name(cfg)


def test_transformers_no_q_lora_and_default_rope():
    transformers = pytest.importorskip("transformers")
    kw = _transformers_kwargs(TOY)
    kw.update(q_lora_rank=None, rope_parameters=None)
    got = from_dict(json.loads(json.dumps(transformers.DeepseekV3Config(**kw).to_dict())))
    assert got.q_lora_rank == 0 and got.rope_factor == 1.0 and not got.yarn
    assert got.original_seq_len == got.max_position_embeddings == 4096
    assert got.softmax_scale == TOY.qk_head_dim ** -0.5 and got.rope_attention_factor == 1.0
    # transformers' defaults are V3's numbers (with a 4096-position window and no MTP override)
    d = json.loads(json.dumps(transformers.DeepseekV3Config().to_dict()))
    v = from_dict(d)
    assert (v.dim, v.n_layers, v.n_dense_layers, v.n_expert_groups, v.n_limited_groups, v.n_mtp_layers) == \
        (7168, 61, 3, 8, 4, 1)


def test_hf_nulls_and_missing_keys():
    d = _published_hf_v3()
    d.update(q_lora_rank=None, n_group=None, topk_group=None)
    got = from_hf_dict_v3(d)
    assert (got.q_lora_rank, got.n_expert_groups, got.n_limited_groups) == (0, 1, 1)
    d = _published_hf_v3()
    del d["num_nextn_predict_layers"], d["scoring_func"]
    got = from_hf_dict_v3(d)
    assert got.n_mtp_layers == 0 and got.score_func == "sigmoid"
    # YaRN without mscale keys: read as 0 (transformers: no softmax factor, cos/sin x g(factor))
    d = _published_hf_v3()
    del d["rope_scaling"]["mscale"], d["rope_scaling"]["mscale_all_dim"]
    got = from_hf_dict_v3(d)
    assert (got.mscale, got.mscale_all_dim) == (0.0, 0.0)
    assert got.softmax_scale == 192 ** -0.5 and got.rope_attention_factor == pytest.approx(yarn_get_mscale(40.0))


@pytest.mark.parametrize("key, value, field", [
    ("model_type", "deepseek_v2", "model_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("topk_method", "greedy", "topk_method"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type"),
    ("rope_scaling", {"type": "yarn", "original_max_position_embeddings": 4096}, "rope_scaling.factor"),
    ("rope_scaling", [40], "rope_scaling"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config.quant_method"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [64, 64]},
     "quantization_config.weight_block_size"),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
])
def test_hf_unsupported_values_name_the_field(key, value, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        from_hf_dict_v3({**_published_hf_v3(), key: value})


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "7168"), ("num_hidden_layers", 61.5), ("num_nextn_predict_layers", True), ("n_group", [8]),
    ("rms_norm_eps", float("nan")), ("routed_scaling_factor", float("inf")), ("norm_topk_prob", 1),
    ("scoring_func", 3), ("rope_theta", "1e4"),
])
def test_hf_wrong_types_name_the_field(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        from_hf_dict_v3({**_published_hf_v3(), key: value})


def test_hf_wrong_types_inside_rope_scaling():
    d = _published_hf_v3()
    d["rope_scaling"]["factor"] = "40"
    with pytest.raises(ConfigError, match="'rope_scaling.factor'"):
        from_hf_dict_v3(d)
    d["rope_scaling"]["factor"] = float("nan")
    with pytest.raises(ConfigError, match="'rope_scaling.factor'"):
        from_hf_dict_v3(d)


def test_hf_rule_violations_name_the_field():
    for key, value, field in [("topk_group", 9, "n_limited_groups"), ("n_group", 7, "n_expert_groups"),
                              ("first_k_dense_replace", 62, "n_dense_layers"), ("scoring_func", "softmax",
                                                                               "score_func")]:
        with pytest.raises(ConfigError, match=f"'{field}'"):
            from_hf_dict_v3({**_published_hf_v3(), key: value})


# ---- official parser -----------------------------------------------------------------------------------

def test_official_671b_config(tmp_path):
    got = from_official_dict_v3(OFFICIAL_671B)
    # the official converter drops model.layers.61 (MTP): no MTP layer; YaRN keys take ModelArgs defaults (= V3)
    assert _no_name(got) == _no_name(V3.replace(n_mtp_layers=0))
    assert _no_name(from_dict(dict(OFFICIAL_671B))) == _no_name(got)
    d = {**OFFICIAL_671B, "max_seq_len": 16384, "max_batch_size": 8}
    assert from_official_dict_v3(d).extra == {"max_seq_len": 16384, "max_batch_size": 8}
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "config.json").write_text(json.dumps(OFFICIAL_671B))
    assert _no_name(load_config(str(tmp_path))) == _no_name(got)


@pytest.mark.parametrize("name", sorted(V3_PRESETS))
def test_official_round_trip(name):
    cfg = preset(name)
    d = cfg.to_dict()
    assert "extra" not in d and d["model_type"] == "deepseek_v3"
    assert _no_name(from_dict(json.loads(json.dumps(d)))) == _no_name(cfg)
    d.pop("model_type")  # kv_lora_rank alone says V3
    assert _no_name(from_dict(json.loads(json.dumps(d)))) == _no_name(cfg)
    off = cfg.to_official_dict()
    assert set(off) == set(OFFICIAL_671B) | {"original_seq_len", "rope_theta", "rope_factor", "beta_fast",
                                             "beta_slow", "mscale"}
    assert _no_name(from_official_dict_v3(json.loads(json.dumps(off)))) == _no_name(cfg.replace(n_mtp_layers=0))


def test_official_defaults_are_model_args():
    # config_16B.json (DeepSeek-V2-Lite through the V3 code): no score_func -> ModelArgs' 'softmax'
    v2_lite = {"vocab_size": 102400, "dim": 2048, "inter_dim": 10944, "moe_inter_dim": 1408, "n_layers": 27,
               "n_dense_layers": 1, "n_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
               "n_activated_experts": 6, "route_scale": 1.0, "q_lora_rank": 0, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mscale": 0.707}
    with pytest.raises(ConfigError, match="'score_func'"):
        from_official_dict_v3(v2_lite)
    got = from_official_dict_v3({**v2_lite, "score_func": "sigmoid"})
    assert (got.q_lora_rank, got.n_expert_groups, got.n_limited_groups, got.dtype) == (0, 1, 1, "bf16")
    assert got.mscale_all_dim == 0.707 and got.rope_attention_factor == pytest.approx(1.0)
    assert got.softmax_scale == pytest.approx(192 ** -0.5 * yarn_get_mscale(40, 0.707) ** 2)
    assert got.max_position_embeddings == 4096 * 40


@pytest.mark.parametrize("key, value", [("dim", "7168"), ("n_layers", True), ("n_heads", 4.5), ("n_heads", None),
                                        ("rope_theta", "1e4"), ("n_layers", float("nan")), ("dim", float("inf")),
                                        ("rope_factor", float("nan")), ("score_func", 1), ("dtype", None)])
def test_official_wrong_types_name_the_field(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        from_official_dict_v3({**OFFICIAL_671B, key: value})


def test_nan_in_json_file_is_a_config_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(OFFICIAL_671B).replace('"dim": 7168', '"dim": NaN'))
    with pytest.raises(ConfigError, match="'dim'"):
        load_config(str(p))
    p.write_text(json.dumps(_published_hf_v3()).replace('"hidden_size": 7168', '"hidden_size": NaN'))
    with pytest.raises(ConfigError, match="'hidden_size'"):
        load_config(str(tmp_path))


def test_official_model_type_mismatch():
    with pytest.raises(ConfigError, match="'model_type'"):
        from_official_dict_v3({**OFFICIAL_671B, "model_type": "deepseek_v4"})
    with pytest.raises(ConfigError, match="JSON object"):
        from_official_dict_v3([1, 2])


def test_v4_dicts_still_parse_as_v4():
    for name in PRESETS:
        cfg = preset(name)
        d = cfg.to_dict()
        d.pop("model_type")
        assert isinstance(from_dict(d), ModelConfig)


# ---- rules ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    (dict(model_type="deepseek_v4"), "model_type"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(dim=-1), "dim"),
    (dict(dim="256"), "dim"),
    (dict(dim=256.0), "dim"),
    (dict(dim=True), "dim"),
    (dict(inter_dim=0), "inter_dim"),
    (dict(moe_inter_dim=0), "moe_inter_dim"),
    (dict(n_layers=0), "n_layers"),
    (dict(n_heads=0), "n_heads"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(n_routed_experts=0), "n_routed_experts"),
    (dict(n_activated_experts=0), "n_activated_experts"),
    (dict(n_expert_groups=0), "n_expert_groups"),
    (dict(n_limited_groups=0), "n_limited_groups"),
    (dict(original_seq_len=0), "original_seq_len"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(n_mtp_layers=-1), "n_mtp_layers"),
    (dict(n_dense_layers=-1), "n_dense_layers"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(q_lora_rank=-1), "q_lora_rank"),
    (dict(n_expert_groups=3), "n_expert_groups"),            # 16 % 3 != 0
    (dict(n_limited_groups=5), "n_limited_groups"),          # > 4 groups
    (dict(n_activated_experts=9, n_limited_groups=2), "n_activated_experts"),  # > 2 groups x 4 experts
    (dict(n_activated_experts=17, n_expert_groups=1, n_limited_groups=1), "n_activated_experts"),  # > 16 experts
    (dict(n_dense_layers=5), "n_dense_layers"),
    (dict(qk_rope_head_dim=31), "qk_rope_head_dim"),
    (dict(score_func="softmax"), "score_func"),
    (dict(dtype="fp16"), "dtype"),
    (dict(bos_token_id=1024), "bos_token_id"),
    (dict(eos_token_id=1024), "eos_token_id"),
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(route_scale=0.0), "route_scale"),
    (dict(route_scale=float("nan")), "route_scale"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_factor=0.5), "rope_factor"),
    (dict(rope_factor=float("inf")), "rope_factor"),
    (dict(beta_fast=0.0), "beta_fast"),
    (dict(beta_slow=-1.0), "beta_slow"),
    (dict(mscale=-0.1), "mscale"),
    (dict(mscale_all_dim=float("nan")), "mscale_all_dim"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
])
def test_rule_violations_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        TOY.replace(**changes)


def test_rules_at_the_boundary_pass():
    TOY.replace(n_activated_experts=8, n_limited_groups=2)  # exactly 2 groups x 4 experts
    TOY.replace(n_dense_layers=4, n_limited_groups=4, n_mtp_layers=0, q_lora_rank=0, n_shared_experts=0)
    TOY.replace(rope_factor=1.0, mscale=0.0, mscale_all_dim=0.0, dtype="bf16", eos_token_id=1023)


def test_replace_and_to_dict():
    c = TOY.replace(n_layers=6)
    assert c.n_layers == 6 and c != TOY and c.replace(n_layers=4) == TOY
    assert TOY.replace(extra={"x": 1}) == TOY  # extra is not compared
    d = TOY.to_dict()
    assert "extra" not in d and d["name"] == "toy-v3" and d["model_type"] == "deepseek_v3"
    with pytest.raises(Exception):
        TOY.dim = 1  # frozen


def test_unknown_preset_lists_v3_names():
    with pytest.raises(ConfigError, match="deepseek-v3") as e:
        preset("toy-v9")
    assert "toy-v3" in str(e.value) and "toy-v4" in str(e.value)
    with pytest.raises(ConfigError, match="toy-v3"):
        load_config("no-such-model")
