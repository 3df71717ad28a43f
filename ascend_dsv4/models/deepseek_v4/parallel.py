"""DeepSeek-V4 under tensor / expert parallelism: which checkpoint tensors split on which dim, and the layout rules
(see :mod:`ascend_dsv4.models.parallel_plan` for what each rank holds)."""

from __future__ import annotations

import re

from ..layout_rules import check_blocks, check_divisible
from .config import DeepseekV4Config

# official checkpoint names split on dim 0 / dim 1 (scales follow their weights)
SPLIT_DIM0 = re.compile(r"(^embed\.weight$|^head\.weight$|\.attn\.(wq_b|wo_a)\.(weight|scale)$|\.attn\.attn_sink$"
                        r"|\.shared_experts\.(w1|w3)\.(weight|scale)$)")
SPLIT_DIM1 = re.compile(r"(\.attn\.wo_b\.(weight|scale)$|\.shared_experts\.w2\.(weight|scale)$)")


def check_parallel_layout(cfg: DeepseekV4Config, tp: int, ep: int) -> None:
    """V4's own rules: output groups split over the ranks; FP8 / FP4 shares must be whole scale blocks."""
    shared = cfg.moe_inter_dim
    if cfg.n_shared_experts:
        check_divisible("moe_inter_dim (shared experts)", shared, tp, "tensor_parallel_size")
    check_divisible("o_groups", cfg.o_groups, tp, "tensor_parallel_size")
    if cfg.dtype == "fp8" and tp > 1:
        check_blocks("wq_b (n_heads * head_dim)", cfg.n_heads // tp * cfg.head_dim, 128, tp, "FP8")
        check_blocks("wo_a / wo_b (o_groups * o_lora_rank)", cfg.o_groups // tp * cfg.o_lora_rank, 128, tp, "FP8")
        if cfg.n_shared_experts:
            check_blocks("moe_inter_dim (shared experts)", shared // tp, 128, tp, "FP8")
    ef = cfg.expert_dtype or cfg.dtype
    if ep == 1 and tp > 1 and ef in ("fp8", "fp4"):
        check_blocks("moe_inter_dim (routed experts)", cfg.moe_inter_dim // tp, 128 if ef == "fp8" else 32, tp,
                     ef.upper())
