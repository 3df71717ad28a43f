"""DeepSeek-V3 sizes: checkpoint inventory, parameter counts (seed: 671B + 11.5B MTP), MLA cache bytes, info."""

from __future__ import annotations

import json

import pytest

from ascend_dsv4.models import preset
from ascend_dsv4.entrypoints.cli import main
from ascend_dsv4.errors import RequestError
from ascend_dsv4.models.deepseek_v3.sizing import (
    GROUPS,
    active_param_count as active_param_count_v3,
    checkpoint_bytes as checkpoint_bytes_v3,
    checkpoint_tensors as checkpoint_tensors_v3,
    dequantized_weights_bytes as dequantized_weights_bytes_v3,
    format_info as format_info_v3,
    kv_bytes_per_token as kv_bytes_per_token_v3,
    memory_plan as memory_plan_v3,
    mtp_param_count as mtp_param_count_v3,
    param_breakdown as param_breakdown_v3,
    param_count as param_count_v3,
    tensor_inventory as tensor_inventory_v3,
    weights_bytes as weights_bytes_v3,
)

V3 = preset("deepseek-v3")
TOY = preset("toy-v3")


# ---- checkpoint inventory and parameter counts ---------------------------------------------------------

def test_v3_checkpoint_matches_published_files():
    # deepseek-ai/DeepSeek-V3 safetensors headers: 91,991 tensors, 688,574,839,360 bytes
    ck = checkpoint_tensors_v3(V3)
    assert ck["tensors"] == 91_991
    assert ck["bytes"] == checkpoint_bytes_v3(V3) == 688_574_839_360
    # the MTP layer stores copies of the embedding and the head: in the files, not in the unique count
    assert ck["copy_elements"] == 2 * 129280 * 7168
    assert ck["weight_elements"] == ck["unique_params"] + ck["copy_elements"] == 684_489_845_504
    assert ck["unique_params"] == param_count_v3(V3)
    names = {t.name for t in tensor_inventory_v3(V3)}
    for n in ("model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight",
              "model.layers.61.eh_proj.weight", "model.layers.61.mlp.gate.e_score_correction_bias",
              "model.layers.2.mlp.down_proj.weight_scale_inv", "model.layers.3.mlp.experts.{e}.up_proj.weight",
              "model.layers.60.mlp.shared_experts.gate_proj.weight", "lm_head.weight"):
        assert n in names, n
    assert "model.layers.61.eh_proj.weight_scale_inv" not in names  # eh_proj is BF16
    assert "model.layers.2.mlp.gate.weight" not in names  # layers 0-2 are dense


def test_v3_param_counts_match_the_seed():
    main_p, all_p = param_count_v3(V3, include_mtp=False), param_count_v3(V3)
    assert main_p == 671_026_419_200
    assert abs(main_p / 671e9 - 1) < 0.005                       # "671B" main model
    mtp = mtp_param_count_v3(V3)
    assert mtp == all_p - main_p == 11_610_068_224
    assert abs(mtp / 11.5e9 - 1) < 0.01                          # "11.5B unique" MTP parameters
    eh = 7168 * 2 * 7168
    assert mtp - eh == 11_507_307_776                            # without eh_proj: 11.51 B
    bd = param_breakdown_v3(V3)
    assert set(bd) == set(GROUPS) and sum(bd.values()) == all_p
    assert bd["embed"] == bd["head"] == 926_679_040              # "0.9B" embedding and head
    assert bd["mtp"] == mtp
    assert active_param_count_v3(V3) == 37_552_297_472           # seed: 36.7B; paper: 37B
    assert active_param_count_v3(V3, include_mtp=True) == 2_541_458_688  # seed: 2.4B incl. shared embed/head


def test_toy_param_count_matches_transformers_model():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.DeepseekV3Config.from_dict(TOY.to_hf_dict())
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(hf)
    # transformers builds no MTP layer; e_score_correction_bias is a (persistent) buffer there
    n = sum(v.numel() for v in model.state_dict().values())
    assert n == param_count_v3(TOY, include_mtp=False) == 6_962_480


def test_inventory_variants():
    no_q = TOY.replace(q_lora_rank=0, n_shared_experts=0, n_mtp_layers=0)
    names = {t.name for t in tensor_inventory_v3(no_q)}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n or "shared_experts" in n or "layers.4." in n for n in names)
    bf16 = TOY.replace(dtype="bf16")
    inv = tensor_inventory_v3(bf16)
    assert not any(t.scale for t in inv) and {t.dtype for t in inv} == {"BF16", "F32"}
    ck = checkpoint_tensors_v3(bf16)
    f32 = sum(t.logical_numel for t in inv if t.dtype == "F32")  # e_score_correction_bias
    assert ck["bytes"] == 2 * ck["weight_elements"] + 2 * f32
    assert param_count_v3(bf16) == param_count_v3(TOY)
    assert weights_bytes_v3(bf16) == checkpoint_bytes_v3(bf16) - 2 * 2 * 1024 * 256  # MTP copies not held
    assert dequantized_weights_bytes_v3(TOY) == 2 * param_count_v3(TOY) + 2 * f32


# ---- KV cache ------------------------------------------------------------------------------------------

def test_kv_bytes_per_token_match_the_seed_table():
    kv = kv_bytes_per_token_v3(V3)
    # optimizing_mla.md: CacheCompressed 1.152 kB vs CacheDecompressed 81.92 kB per token per layer
    assert kv["latent"] == 1152 and kv["latent"] / 1000 == 1.152
    assert kv["decompressed"] == 81920 and kv["decompressed"] / 1000 == 81.92
    assert 1 - kv["latent"] / kv["decompressed"] == pytest.approx(0.986, abs=5e-4)  # "about 98.6%" smaller
    assert kv["layers"] == 62 and kv["latent_total"] == 62 * 1152 and kv["decompressed_total"] == 62 * 81920
    no_mtp = kv_bytes_per_token_v3(V3, include_mtp=False)
    assert no_mtp["layers"] == 61 and no_mtp["latent_total"] == 61 * 1152
    assert kv_bytes_per_token_v3(V3, dtype_bytes=1)["latent"] == 576
    assert kv_bytes_per_token_v3(TOY) == {"latent": 320, "decompressed": 1280, "layers": 5, "latent_total": 1600,
                                          "decompressed_total": 6400}
    with pytest.raises(ValueError):
        kv_bytes_per_token_v3(V3, dtype_bytes=0)


def test_memory_plan():
    p = memory_plan_v3(V3, 131072, 4)
    assert p["kv_per_seq"] == 131072 * 62 * 1152 and p["kv_bytes"] == 4 * p["kv_per_seq"]
    assert p["kv_decompressed_bytes"] == 4 * 131072 * 62 * 81920
    assert p["checkpoint_bytes"] == 688_574_839_360
    assert p["weights_bytes"] == p["checkpoint_bytes"] - 2 * 2 * 129280 * 7168
    assert p["total_bytes"] == p["weights_bytes"] + p["kv_bytes"]
    assert memory_plan_v3(TOY, 0, 1)["kv_bytes"] == 0
    for bad in (dict(context_len=-1, batch=1), dict(context_len=10, batch=0), dict(context_len=4097, batch=1),
                dict(context_len=1.5, batch=1), dict(context_len=10, batch=True)):
        with pytest.raises(RequestError):
            memory_plan_v3(TOY, **bad)


# ---- report / CLI --------------------------------------------------------------------------------------

def test_format_info_v3():
    out = format_info_v3(V3, 131072, 1)
    for needle in ("deepseek-v3", "dense MLP 3 [0-2]", "MoE 58 [3-60]", "1 MTP [61, MoE]", "kv_lora 512",
                   "8 groups of 32, top-4 groups", "YaRN factor 40", "mscale 1 / mscale_all_dim 1",
                   "671,026,419,200", "11,610,068,224", "91,991 tensors", "688,574,839,360", "1,152", "81,920"):
        assert needle in out, needle


def test_cli_info_deepseek_v3(capsys):
    assert main(["info", "--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "1,152" in out and "81,920" in out
    assert "deepseek_v3" in out and "MoE" in out


def test_cli_info_v3_folder_and_toy(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TOY.to_hf_dict()))
    assert main(["info", "--model", str(tmp_path), "--context-len", "1024", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "320 B per layer" in out and "1,280 B per layer" in out and "2 x 1,024 tokens" in out
    assert main(["info", "--model", "toy-v3", "--context-len", "5000"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
