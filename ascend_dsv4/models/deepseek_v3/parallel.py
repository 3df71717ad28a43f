"""DeepSeek-V3 under tensor / expert parallelism: which checkpoint tensors split on which dim, and the layout rules
(see :mod:`ascend_dsv4.models.parallel_plan` for what each rank holds)."""

from __future__ import annotations

import re

from ..layout_rules import check_blocks, check_divisible
from .config import DeepseekV3Config

# DeepSeek HF checkpoint names split on dim 0 / dim 1
SPLIT_DIM0 = re.compile(r"(embed_tokens\.weight$|lm_head\.weight$|\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight"
                        r"|\.shared_experts\.(gate_proj|up_proj)\.weight|\.mlp\.(gate_proj|up_proj)\.weight)")
SPLIT_DIM1 = re.compile(r"(\.self_attn\.o_proj\.weight|\.shared_experts\.down_proj\.weight|\.mlp\.down_proj\.weight)")


def check_parallel_layout(cfg: DeepseekV3Config, tp: int, ep: int) -> None:
    """V3's own rules: dense MLP and shared experts split over the ranks; FP8 shares must be whole 128-blocks."""
    shared = cfg.moe_inter_dim * cfg.n_shared_experts
    if cfg.n_shared_experts:
        check_divisible("moe_inter_dim (shared experts)", shared, tp, "tensor_parallel_size")
    if cfg.n_dense_layers:
        check_divisible("inter_dim", cfg.inter_dim, tp, "tensor_parallel_size")
    if cfg.dtype == "fp8" and tp > 1:
        h = cfg.n_heads // tp
        check_blocks("q_b_proj (n_heads * qk_head_dim)", h * cfg.qk_head_dim, 128, tp, "FP8")
        check_blocks("kv_b_proj (n_heads * (qk_nope_head_dim + v_head_dim))", h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                     128, tp, "FP8")
        check_blocks("o_proj (n_heads * v_head_dim)", h * cfg.v_head_dim, 128, tp, "FP8")
        if cfg.n_dense_layers:
            check_blocks("inter_dim", cfg.inter_dim // tp, 128, tp, "FP8")
        if cfg.n_shared_experts:
            check_blocks("moe_inter_dim (shared experts)", shared // tp, 128, tp, "FP8")
        if ep == 1:
            check_blocks("moe_inter_dim (routed experts)", cfg.moe_inter_dim // tp, 128, tp, "FP8")
