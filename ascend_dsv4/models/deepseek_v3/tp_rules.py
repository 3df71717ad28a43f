"""DeepSeek-V3 / R1 under tensor / expert parallelism: which checkpoint tensors (DeepSeek's HF names) are split on
which dimension, and the layout rules beyond the common ones (see :mod:`ascend_dsv4.parallel_plan`).

Heads (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) are split and ``o_proj`` is row-parallel; ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated, and so is the MLA latent cache."""

from __future__ import annotations

import re

from ..layout_checks import divisible, whole_blocks
from .config import DeepseekV3Config

SPLIT_DIM0 = re.compile(r"(embed_tokens\.weight$|lm_head\.weight$|\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight"
                        r"|\.shared_experts\.(gate_proj|up_proj)\.weight|\.mlp\.(gate_proj|up_proj)\.weight)")
SPLIT_DIM1 = re.compile(r"(\.self_attn\.o_proj\.weight|\.shared_experts\.down_proj\.weight|\.mlp\.down_proj\.weight)")


def shared_expert_inter(cfg: DeepseekV3Config) -> int:
    return cfg.moe_inter_dim * cfg.n_shared_experts  # the shared experts are one wide MLP


def validate(cfg: DeepseekV3Config, tp: int, ep: int, quantized: bool = True, numerics: str = "exact") -> None:
    """The V3-only rules: dense layers split over TP; FP8 scale blocks whole on every rank (``quantized``: the
    weights come block-quantised from a checkpoint; V3 runs ``exact`` numerics only)."""
    if cfg.n_dense_layers:
        divisible("inter_dim", cfg.inter_dim, tp, "tensor_parallel_size")
    if cfg.dtype != "fp8" or tp == 1 or not quantized:
        return
    h = cfg.n_heads // tp
    whole_blocks("q_b_proj (n_heads * qk_head_dim)", h * cfg.qk_head_dim, 128, tp, "FP8")
    whole_blocks("kv_b_proj (n_heads * (qk_nope_head_dim + v_head_dim))", h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                 128, tp, "FP8")
    whole_blocks("o_proj (n_heads * v_head_dim)", h * cfg.v_head_dim, 128, tp, "FP8")
    if cfg.n_dense_layers:
        whole_blocks("inter_dim", cfg.inter_dim // tp, 128, tp, "FP8")
    if cfg.n_shared_experts:
        whole_blocks("moe_inter_dim (shared experts)", shared_expert_inter(cfg) // tp, 128, tp, "FP8")
    if ep == 1:
        whole_blocks("moe_inter_dim (routed experts)", cfg.moe_inter_dim // tp, 128, tp, "FP8")
