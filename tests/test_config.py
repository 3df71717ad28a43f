"""ModelConfig: presets (ascend_dsv4/models/deepseek_v4/README.md §1, §5.1), parsing of official / HF / transformers
config dicts, §5.2 rules."""

from __future__ import annotations

import json

import pytest

from ascend_dsv4.models import from_dict, load_config, preset
from ascend_dsv4.models.deepseek_v4.config import (
    PRESETS, DeepseekV4Config as ModelConfig, from_hf_dict, from_official_dict,
)
from ascend_dsv4.errors import AscendDSV4Error, ConfigError

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4] + [0]


def _no_name(cfg: ModelConfig) -> dict:
    d = cfg.to_dict()
    d.pop("name")
    return d


# ---- presets -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_validate(name):
    cfg = preset(name)
    assert cfg.name == name
    assert cfg.validate() is cfg
    assert load_config(name) == cfg
    assert len(cfg.compress_ratios) == cfg.n_layers + cfg.n_mtp_layers


def test_toy_matches_spec_5_1():
    c = preset("toy-v4")
    assert c.layers_of_kind("swa") == [0, 1]
    assert c.layers_of_kind("csa") == [2, 4, 6]
    assert c.layers_of_kind("hca") == [3, 5]
    assert c.compress_ratios == (0, 0, 4, 128, 4, 128, 4, 0)
    assert c.n_mtp_layers == 1 and c.layer_ratio(c.n_layers) == 0  # MTP layer is SWA-only
    assert [i for i in range(c.n_layers) if c.is_hash_layer(i)] == [0, 1, 2]
    expect = dict(vocab_size=1024, dim=256, moe_inter_dim=128, n_layers=7, n_hash_layers=3, n_heads=4,
                  head_dim=128, rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=32,
                  index_n_heads=4, index_head_dim=128, index_topk=16, n_routed_experts=16, n_shared_experts=1,
                  n_activated_experts=2, score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, hc_mult=4,
                  hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, rope_theta=10000.0,
                  compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16.0, beta_fast=32.0,
                  beta_slow=1.0, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4")
    assert {k: getattr(c, k) for k in expect} == expect


def test_flash_schedule_spec_1_2():
    c = preset("deepseek-v4-flash")
    assert list(c.compress_ratios) == FLASH_RATIOS and len(c.compress_ratios) == 44
    assert c.layers_of_kind("swa") == [0, 1]
    assert c.layers_of_kind("csa") == list(range(2, 43, 2)) and len(c.layers_of_kind("csa")) == 21
    assert c.layers_of_kind("hca") == list(range(3, 42, 2)) and len(c.layers_of_kind("hca")) == 20
    assert [c.layer_kind(i) for i in range(3)] == ["swa", "swa", "csa"]  # hash layers 0-2
    assert c.n_hash_layers == 3 and c.compress_ratios[-1] == 0
    assert (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups, c.moe_inter_dim, c.n_routed_experts,
            c.route_scale, c.index_topk) == (4096, 43, 64, 1024, 8, 2048, 256, 1.5, 512)


def test_pro_schedule_spec_1_2():
    c = preset("deepseek-v4-pro")
    assert list(c.compress_ratios) == PRO_RATIOS and len(c.compress_ratios) == 62
    assert c.layers_of_kind("swa") == []
    assert len(c.layers_of_kind("csa")) == 30 and c.layers_of_kind("csa") == list(range(2, 61, 2))
    assert len(c.layers_of_kind("hca")) == 31 and c.layers_of_kind("hca") == [0, 1] + list(range(3, 60, 2))
    assert [c.layer_kind(i) for i in range(3)] == ["hca", "hca", "csa"]
    assert (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups, c.moe_inter_dim, c.n_routed_experts,
            c.route_scale, c.index_topk) == (7168, 61, 128, 1536, 16, 3072, 384, 2.5, 1024)


# ---- round trips -----------------------------------------------------------------------------------------

def _official_dict(cfg: ModelConfig) -> dict:
    """What the official inference config.json holds (ModelArgs keys) plus the reference-only extras."""
    d = _no_name(cfg)
    d.pop("model_type")
    d.update(max_seq_len=4096, max_batch_size=4, scale_dtype="fp8")
    return d


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_official_round_trip(name, tmp_path):
    cfg = preset(name)
    d = _official_dict(cfg)
    got = from_official_dict(json.loads(json.dumps(d)))
    assert _no_name(got) == _no_name(cfg)
    assert got.extra["max_seq_len"] == 4096
    # n_mtp_layers is not in the official file: derived from len(compress_ratios)
    d.pop("n_mtp_layers")
    assert _no_name(from_official_dict(d)) == _no_name(cfg)
    # and through a file / a folder (also inference/config.json)
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "config.json").write_text(json.dumps(d))
    assert _no_name(load_config(str(tmp_path))) == _no_name(cfg)
    assert _no_name(load_config(str(tmp_path / "inference" / "config.json"))) == _no_name(cfg)


def _published_hf_flash() -> dict:
    """Shape of DeepSeek's published HF config.json for V4-Flash (current revision,
    ascend_dsv4/models/deepseek_v4/README.md §1.1)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
        "num_nextn_predict_layers": 1, "num_hash_layers": 3, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": FLASH_RATIOS, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
        "expert_dtype": "fp4",
    }


def test_hf_published_flash_gives_flash_preset(tmp_path):
    d = _published_hf_flash()
    flash = preset("deepseek-v4-flash")
    got = from_hf_dict(d)
    assert _no_name(got) == _no_name(flash)
    assert (got.dtype, got.scale_fmt, got.expert_dtype) == ("fp8", "ue8m0", "fp4")
    assert (got.rope_factor, got.original_seq_len, got.beta_fast, got.beta_slow) == (16.0, 65536, 32.0, 1.0)
    assert isinstance(got.rope_factor, float) and isinstance(got.original_seq_len, int)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d, indent=2))
    assert _no_name(load_config(str(tmp_path))) == _no_name(flash)
    # the initial revision had no expert_dtype: FP8 experts are assumed
    d.pop("expert_dtype")
    assert from_hf_dict(d).expert_dtype == "fp8"
    # Pro: same file shape with Pro's numbers
    pro = preset("deepseek-v4-pro")
    d.update(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
             moe_intermediate_size=3072, n_routed_experts=384, routed_scaling_factor=2.5, index_topk=1024,
             compress_ratios=PRO_RATIOS, expert_dtype="fp4")
    assert _no_name(from_hf_dict(d)) == _no_name(pro)


def test_hf_published_without_mtp_entry():
    d = _published_hf_flash()
    d["compress_ratios"] = FLASH_RATIOS[:-1]  # backbone only: MTP entries are appended as 0
    assert list(from_hf_dict(d).compress_ratios) == FLASH_RATIOS


@pytest.fixture(scope="module")
def hf_config_cls():
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV4Config


_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
         "beta_fast": 32.0, "beta_slow": 1.0}


def test_transformers_written_toy(hf_config_cls):
    types = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    toy = preset("toy-v4")
    c = hf_config_cls(
        vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=32,
        layer_types=[types[r] for r in toy.compress_ratios[:7]], mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 4,
        index_n_heads=4, index_head_dim=128, index_topk=16, n_routed_experts=16, num_experts_per_tok=2,
        max_position_embeddings=1048576, rope_parameters=dict(_YARN),
    )
    d = json.loads(json.dumps(c.to_dict()))
    assert "layer_types" in d and "mlp_layer_types" in d and set(d["rope_parameters"]) == {"main", "compress"}
    assert "compress_ratios" not in d and "num_hash_layers" not in d
    got = from_dict(d)
    assert got.compress_ratios == toy.compress_ratios  # 7 layer_types + the MTP layer
    assert got.n_hash_layers == 3
    assert (got.rope_factor, got.original_seq_len, got.beta_fast, got.beta_slow) == (16.0, 65536, 32.0, 1.0)
    assert (got.rope_theta, got.compress_rope_theta, got.rope_head_dim) == (10000.0, 160000.0, 64)
    # no quantization_config: a BF16 checkpoint
    assert (got.dtype, got.scale_fmt, got.expert_dtype) == ("bf16", None, None)
    expect = toy.replace(dtype="bf16", scale_fmt=None, expert_dtype=None, max_position_embeddings=1048576)
    assert _no_name(got) == _no_name(expect)


def test_transformers_written_flash_legacy_kwargs(hf_config_cls):
    """transformers folds the published legacy keys (compress_ratios, num_hash_layers) into layer_types etc."""
    c = hf_config_cls(compress_ratios=FLASH_RATIOS, num_hash_layers=2, qk_rope_head_dim=64,
                      rope_parameters=dict(_YARN), hidden_size=4096, num_hidden_layers=43,
                      quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                           "scale_fmt": "ue8m0"}, expert_dtype="fp4")
    d = json.loads(json.dumps(c.to_dict()))
    assert len(d["layer_types"]) == 43
    got = from_hf_dict(d)
    assert list(got.compress_ratios) == FLASH_RATIOS
    assert got.n_hash_layers == 2
    assert (got.dtype, got.scale_fmt, got.expert_dtype) == ("fp8", "ue8m0", "fp4")
    assert _no_name(got) == _no_name(preset("deepseek-v4-flash").replace(n_hash_layers=2))


def test_transformers_default_rope_means_no_yarn(hf_config_cls):
    d = json.loads(json.dumps(hf_config_cls(qk_rope_head_dim=64).to_dict()))
    got = from_hf_dict(d)
    assert got.original_seq_len == 0  # no YaRN
    # transformers' default pattern: 2 HCA, then HCA on even / CSA on odd offsets
    assert list(got.compress_ratios) == [128, 128] + [4 if i % 2 else 128 for i in range(41)] + [0]


def test_hf_custom_compress_rates_are_honoured():
    """transformers' compress_rates maps layer types to ratios; a non-default one must not be read as 4."""
    d = _published_hf_flash()
    d.pop("compress_ratios")
    d["layer_types"] = [{0: "sliding_attention", 4: "compressed_sparse_attention",
                         128: "heavily_compressed_attention"}[r] for r in FLASH_RATIOS[:43]]
    d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert list(from_hf_dict(d).compress_ratios) == FLASH_RATIOS
    d["compress_rates"] = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}
    with pytest.raises(ConfigError, match="compress_ratios"):
        from_hf_dict(d)


# ---- §5.2 rule violations ------------------------------------------------------------------------------

TOY = preset("toy-v4")


@pytest.mark.parametrize("changes, field", [
    (dict(dim=200), "dim"),
    (dict(dim=0), "dim"),
    (dict(q_lora_rank=100), "q_lora_rank"),
    (dict(moe_inter_dim=96), "moe_inter_dim"),
    (dict(o_lora_rank=96, o_groups=1), "o_lora_rank"),
    (dict(head_dim=160), "head_dim"),  # 160 - 64 = 96 is not a multiple of 64
    (dict(rope_head_dim=128), "head_dim"),  # no nope channels left
    (dict(rope_head_dim=63), "rope_head_dim"),
    (dict(index_head_dim=96), "index_head_dim"),
    (dict(index_head_dim=64), "index_head_dim"),  # not > rope_head_dim
    (dict(n_heads=3, o_groups=256), "o_groups"),  # 3 * 128 % 256 != 0
    (dict(compress_ratios=(0, 0, 4, 128, 4, 128, 4)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 4, 128, 4, 128, 4, 0, 0)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 2, 128, 4, 128, 4, 0)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 4, 128, 4, 128, 4, 4)), "compress_ratios"),  # MTP ratio must be 0
    (dict(n_hash_layers=8), "n_hash_layers"),
    (dict(n_hash_layers=-1), "n_hash_layers"),
    (dict(n_mtp_layers=-1), "n_mtp_layers"),
    (dict(n_heads=-4), "n_heads"),
    (dict(n_layers=0), "n_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(window_size=0), "window_size"),
    (dict(index_topk=-1), "index_topk"),
    (dict(n_routed_experts=0), "n_routed_experts"),
    (dict(n_activated_experts=17), "n_activated_experts"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(dim="256"), "dim"),
    (dict(n_layers=7.0), "n_layers"),
    (dict(score_func="softmax"), "score_func"),
    (dict(dtype="fp16"), "dtype"),
    (dict(expert_dtype="int4"), "expert_dtype"),
    (dict(eos_token_id=1024), "eos_token_id"),
    (dict(model_type="llama"), "model_type"),
])
def test_rule_violations_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        TOY.replace(**changes)


def test_every_rule_violation_through_the_parsers():
    base = _official_dict(TOY)
    for key, value in [("dim", 200), ("index_head_dim", 96), ("rope_head_dim", 63), ("n_hash_layers", 9),
                       ("compress_ratios", [0, 0, 2, 128, 4, 128, 4, 0]), ("head_dim", 160)]:
        with pytest.raises(ConfigError, match=key if key != "rope_head_dim" else "rope_head_dim"):
            from_official_dict({**base, key: value})


@pytest.mark.parametrize("key, value", [("dim", "4096"), ("n_layers", True), ("n_heads", 4.5), ("n_heads", None),
                                        ("rope_theta", "1e4"), ("compress_ratios", [0, "4"]),
                                        ("compress_ratios", "0,4"), ("n_layers", float("nan")),
                                        ("dim", float("inf")), ("rope_theta", float("nan"))])
def test_wrong_types_name_the_field(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        from_official_dict({**_official_dict(TOY), key: value})


def test_wrong_types_in_hf_dict_name_the_field():
    for key, value in [("num_hidden_layers", "43"), ("num_nextn_predict_layers", "1"), ("hidden_size", [4096]),
                       ("head_dim", "512")]:
        d = {**_published_hf_flash(), key: value}
        if key == "head_dim":
            d.pop("qk_rope_head_dim")
            d["partial_rotary_factor"] = 0.125
        with pytest.raises(ConfigError, match="'(num_hidden_layers|num_nextn_predict_layers|n_layers|n_mtp_layers|"
                                              "hidden_size|dim|head_dim)'"):
            from_hf_dict(d)


def test_nan_in_json_file_is_a_config_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_official_dict(TOY)).replace('"dim": 256', '"dim": NaN'))
    with pytest.raises(ConfigError, match="'dim'"):
        load_config(str(p))


def test_unknown_preset():
    with pytest.raises(ConfigError, match="no-such-model") as e:
        preset("no-such-model")
    assert "toy-v4" in str(e.value)
    with pytest.raises(ConfigError, match="no-such-model"):
        load_config("no-such-model")


def test_malformed_json_names_file_and_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{\n  "dim": 256,\n  "n_layers": 7,,\n}\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert str(p) in str(e.value) and "line 3" in str(e.value)
    # also when given the folder
    with pytest.raises(ConfigError, match="line 3"):
        load_config(str(tmp_path))


def test_binary_file_is_a_config_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe\x00garbage\x9c")
    with pytest.raises(ConfigError, match="config.json"):
        load_config(str(p))


def test_not_an_object_and_not_a_deepseek_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(p))
    p.write_text('{"foo": 1}')
    with pytest.raises(ConfigError, match="not a DeepSeek config"):
        load_config(str(p))


def test_folder_without_config_json(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(str(tmp_path))


def test_missing_path():
    with pytest.raises(ConfigError, match="not a preset"):
        load_config("/nonexistent/dir/config.json")


def test_model_type_llama(tmp_path):
    d = {**_published_hf_flash(), "model_type": "llama"}
    with pytest.raises(ConfigError, match="'model_type'"):
        from_hf_dict(d)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="'model_type'"):
        load_config(str(tmp_path))
    # an official-style dict that says it is another model is refused too
    with pytest.raises(ConfigError, match="'model_type'"):
        from_official_dict({**_official_dict(TOY), "model_type": "llama"})


def test_hf_unknown_layer_type_and_missing_schedule():
    d = _published_hf_flash()
    d.pop("compress_ratios")
    with pytest.raises(ConfigError, match="compress_ratios"):
        from_hf_dict(d)
    d["layer_types"] = ["full_attention"] * 43
    with pytest.raises(ConfigError, match="'layer_types'"):
        from_hf_dict(d)
    with pytest.raises(ConfigError, match="'compress_ratios' is missing"):
        from_official_dict({k: v for k, v in _official_dict(TOY).items() if k != "compress_ratios"})


def test_hf_hash_layers_must_be_a_prefix():
    d = _published_hf_flash()
    d.pop("num_hash_layers")
    d["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    assert from_hf_dict(d).n_hash_layers == 3
    d["mlp_layer_types"] = ["moe", "hash_moe", "hash_moe"] + ["moe"] * 40
    with pytest.raises(ConfigError, match="'mlp_layer_types'"):
        from_hf_dict(d)


def test_config_error_is_the_cli_error_type():
    assert issubclass(ConfigError, AscendDSV4Error) and issubclass(ConfigError, ValueError)
