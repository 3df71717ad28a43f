"""Up-front validation of tensor / expert-parallel layouts and the per-rank sizing of `info`."""

from __future__ import annotations

import pytest

from ascend_dsv4.models import preset
from ascend_dsv4.entrypoints.cli import main
from ascend_dsv4.errors import ConfigError
from ascend_dsv4.parallel_plan import (format_layout_info, kv_bytes_per_token_rank, parse_bytes, rank_weight_bytes,
                                       split_rule, validate_layout)
from ascend_dsv4.models.deepseek_v3.sizing import weights_bytes as weights_bytes_v3
from ascend_dsv4.models.deepseek_v4.sizing import weights_bytes

V4, V3 = preset("deepseek-v4-flash"), preset("deepseek-v3")


@pytest.mark.parametrize("cfg,tp,ep,match", [
    (V4.replace(n_heads=60), 8, False, r"n_heads = 60 is not divisible by tensor_parallel_size 8"),
    (V4, 16, True, r"o_groups = 8 is not divisible"),
    (V4.replace(vocab_size=129281), 2, False, r"vocab_size = 129281"),
    (V4.replace(n_routed_experts=250), 8, True, r"n_routed_experts = 250 is not divisible by the expert-parallel"),
    (V4.replace(moe_inter_dim=384), 8, False, r"moe_inter_dim.*48"),
    (preset("deepseek-v4-pro"), 16, True, r"moe_inter_dim \(shared experts\).*192.*128-wide scale blocks"),
    (V4, 8, False, None),
    (V3, 16, True, None),
    (V3.replace(n_heads=100), 8, False, r"n_heads = 100"),
    (V3.replace(inter_dim=18432 + 4), 8, False, r"inter_dim = 18436"),
    (V3, 3, True, r"n_heads = 128 is not divisible by tensor_parallel_size 3"),
    (V3.replace(n_routed_experts=264, n_expert_groups=8), 16, True, r"n_routed_experts = 264"),
    (V3, 0, False, r"tensor_parallel_size must be a positive integer"),
])
def test_layout_errors_name_field_and_rule(cfg, tp, ep, match):
    if match is None:
        validate_layout(cfg, tp, ep)
        return
    with pytest.raises(ConfigError, match=match):
        validate_layout(cfg, tp, ep)


def test_fp4_experts_split_needs_32_wide_blocks():
    cfg = preset("toy-v4").replace(n_heads=8, o_groups=8, dtype="bf16", n_shared_experts=0)
    assert cfg.expert_dtype == "fp4"
    with pytest.raises(ConfigError, match=r"moe_inter_dim \(routed experts\).*16.*FP4.*32-wide"):
        validate_layout(cfg, 8)  # 128 / 8 = 16 columns of w2 per rank: less than one FP4 scale block
    validate_layout(cfg, 8, enable_expert_parallel=True)  # whole experts per rank: no split inside


def test_reference_numerics_needs_whole_rounding_blocks():
    cfg = preset("toy-v4")  # moe_inter_dim 128: 64 per rank at TP 2
    validate_layout(cfg, 2, quantized_checkpoint=False)
    with pytest.raises(ConfigError, match=r"shared expert w2 input\), reference numerics.*64"):
        validate_layout(cfg, 2, quantized_checkpoint=False, numerics="reference")


def test_devices_and_memory():
    with pytest.raises(ConfigError, match=r"needs 8 npu.*4 are visible"):
        validate_layout(V4, 8, True, visible_devices=4, device="npu")
    with pytest.raises(ConfigError, match=r"device memory: each of the 4 ranks needs .* GiB"):
        validate_layout(V4, 4, True, device_memory=parse_bytes("32GiB"))
    validate_layout(V4, 8, True, visible_devices=8, device_memory=parse_bytes("64GiB"))
    assert parse_bytes("64GiB") == parse_bytes("64G") == 64 << 30 and parse_bytes("1024") == 1024
    with pytest.raises(ConfigError, match="--device-memory"):
        parse_bytes("lots")


def test_rank_bytes_sum_to_the_model():
    # replicated bytes counted once + split bytes / tp per rank: ranks * per-rank - (ranks - 1) * replicated = total
    for cfg, total in ((V4, weights_bytes(V4)), (V3, weights_bytes_v3(V3))):
        assert rank_weight_bytes(cfg, 1) == total
        r8 = rank_weight_bytes(cfg, 8, True)
        assert total / 8 < r8 < total / 4
    assert split_rule("layers.3.attn.wo_b.scale", V4) == ("split", 1)
    assert split_rule("layers.3.attn.wkv.weight", V4) == ("replicate", -1)
    assert split_rule("layers.3.ffn.experts.17.w2.weight", V4) == ("expert", -1)
    assert split_rule("model.layers.5.self_attn.o_proj.weight_scale_inv", V3) == ("split", 1)
    assert kv_bytes_per_token_rank(V4) == 6880.0  # spec §4.2's BF16 buffers: replicated, same as one device


def test_info_cli_prints_the_layout(capsys):
    assert main(["info", "--model", "deepseek-v4-flash", "--tensor-parallel-size", "8", "--enable-expert-parallel",
                 "--device-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size=8, expert parallel on (ep=8)" in out
    assert "weights per rank" in out and "KV bytes per token per rank" in out
    fit = int(out.split("tokens of KV that fit per rank: ")[1].split()[0].replace(",", ""))
    w = rank_weight_bytes(V4, 8, True)
    assert fit == int((int(64 * (1 << 30) * 0.9) - w) // 6880)
    assert main(["info", "--model", "deepseek-v4-flash", "-tp", "16"]) == 2
    assert "o_groups = 8" in capsys.readouterr().err
    assert format_layout_info(V3, 16, True).startswith("parallel layout: tensor_parallel_size=16")
