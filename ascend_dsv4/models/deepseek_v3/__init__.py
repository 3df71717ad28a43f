"""DeepSeek-V3 / V3.1 / R1 (and V2-Lite-style configs): config, model (MLA over a latent cache, group-limited MoE,
MTP), checkpoint names, sizing, pool layout."""

from __future__ import annotations

from ..family import ModelFamily
from . import config, names, pools, random_weights, sizing, tp_rules

FAMILY = ModelFamily(
    model_type="deepseek_v3",
    title="DeepSeek-V3",
    config_class=config.DeepseekV3Config,
    presets=config.PRESETS,
    from_hf_dict=config.from_hf_dict,
    from_official_dict=config.from_official_dict,
    # the official V3 config.json has no model_type: MLA's kv_lora_rank without V4's compress_ratios says V3
    claims_official_dict=lambda d: d.get("model_type") == "deepseek_v3" or ("kv_lora_rank" in d
                                                                            and "compress_ratios" not in d),
    numerics=("exact",),
    model_module="ascend_dsv4.models.deepseek_v3.model",
    model_class_name="DeepseekV3Model",
    canonical_name=names.canonical_name,
    checkpoint_name=names.checkpoint_name,
    expert_checkpoint_name=names.expert_checkpoint_name,
    stored_copies=names.stored_copies,
    quant_linear_re=names.QUANT_LINEAR_RE,
    routed_expert_re=names.ROUTED_EXPERT_RE,
    experts_weight_after_w2=True,
    tensor_inventory=sizing.tensor_inventory,
    format_info=sizing.format_info,
    checkpoint_formats=random_weights.FORMATS,
    random_checkpoint=random_weights.random_checkpoint,
    token_pages_per_sequence=pools.token_pages_per_sequence,
    weights_bytes=sizing.weights_bytes,
    kv_pool_bytes_per_token=lambda cfg, b: float(sizing.kv_bytes_per_token(cfg, b)["latent_total"]),
    memory_plan=sizing.memory_plan,
    needs_custom_ops=False,
    tp_split_dim0=tp_rules.SPLIT_DIM0,
    tp_split_dim1=tp_rules.SPLIT_DIM1,
    validate_tp=tp_rules.validate,
    shared_expert_inter=tp_rules.shared_expert_inter,
)
