"""DeepSeek-V4 under tensor / expert parallelism: which checkpoint tensors are split on which dimension, and the
layout rules beyond the common ones (see :mod:`ascend_dsv4.parallel_plan` for the table of what each rank holds).

Query heads (``wq_b``, ``attn_sink``) and output groups (``wo_a``) are split, ``wo_b`` is row-parallel; the single
MQA KV head, the compressor and the indexer are replicated so that every rank selects exactly the entries one
device does (a head split of the indexer would reduce scores in a layout-dependent order)."""

from __future__ import annotations

import re

from ..layout_checks import divisible, whole_blocks
from .config import DeepseekV4Config

SPLIT_DIM0 = re.compile(r"(^embed\.weight$|^head\.weight$|\.attn\.(wq_b|wo_a)\.(weight|scale)$|\.attn\.attn_sink$"
                        r"|\.shared_experts\.(w1|w3)\.(weight|scale)$)")
SPLIT_DIM1 = re.compile(r"(\.attn\.wo_b\.(weight|scale)$|\.shared_experts\.w2\.(weight|scale)$)")


def shared_expert_inter(cfg: DeepseekV4Config) -> int:
    return cfg.moe_inter_dim  # one shared expert


def validate(cfg: DeepseekV4Config, tp: int, ep: int, quantized: bool = True, numerics: str = "exact") -> None:
    """The V4-only rules: output groups split over TP; FP8/FP4 scale blocks whole on every rank (``quantized``:
    the weights come block-quantised from a checkpoint); in ``reference`` numerics, whole 128-wide activation
    rounding blocks on the split inputs of ``wo_b`` and of the experts' w2."""
    divisible("o_groups", cfg.o_groups, tp, "tensor_parallel_size")
    if cfg.dtype == "fp8" and tp > 1 and quantized:
        whole_blocks("wq_b (n_heads * head_dim)", cfg.n_heads // tp * cfg.head_dim, 128, tp, "FP8")
        whole_blocks("wo_a / wo_b (o_groups * o_lora_rank)", cfg.o_groups // tp * cfg.o_lora_rank, 128, tp, "FP8")
        if cfg.n_shared_experts:
            whole_blocks("moe_inter_dim (shared experts)", shared_expert_inter(cfg) // tp, 128, tp, "FP8")
    if numerics == "reference" and tp > 1:
        whole_blocks("wo_b input (o_groups * o_lora_rank), reference numerics", cfg.o_groups // tp * cfg.o_lora_rank,
                     128, tp, "activation-rounded")
        if cfg.n_shared_experts:
            whole_blocks("moe_inter_dim (shared expert w2 input), reference numerics", shared_expert_inter(cfg) // tp,
                         128, tp, "activation-rounded")
        if ep == 1:
            whole_blocks("moe_inter_dim (routed expert w2 input), reference numerics", cfg.moe_inter_dim // tp, 128,
                         tp, "activation-rounded")
    ef = cfg.expert_dtype or cfg.dtype
    if ep == 1 and tp > 1 and ef in ("fp8", "fp4") and quantized:
        whole_blocks("moe_inter_dim (routed experts)", cfg.moe_inter_dim // tp, 128 if ef == "fp8" else 32, tp,
                     ef.upper())
