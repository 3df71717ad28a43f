"""DeepSeek-V4 (Flash, Pro, the toy preset): config, model (attention, MoE, hyper-connections, MTP), checkpoint
names, sizing, pool layout. The model math is written down in ``README.md`` beside this file."""

from __future__ import annotations

from ..family import ModelFamily
from . import config, names, pools, random_weights, sizing, tp_rules

FAMILY = ModelFamily(
    model_type="deepseek_v4",
    title="DeepSeek-V4",
    config_class=config.DeepseekV4Config,
    presets=config.PRESETS,
    from_hf_dict=config.from_hf_dict,
    from_official_dict=config.from_official_dict,
    claims_official_dict=lambda d: d.get("model_type") == "deepseek_v4" or "compress_ratios" in d,
    numerics=("exact", "reference"),
    model_module="ascend_dsv4.models.deepseek_v4.model",
    model_class_name="DeepseekV4Model",
    canonical_name=lambda name, n_layers: names.canonical_name(name),
    checkpoint_name=names.checkpoint_name,
    expert_checkpoint_name=names.expert_checkpoint_name,
    stored_copies=lambda n_layers, n_mtp: [],
    quant_linear_re=names.QUANT_LINEAR_RE,
    routed_expert_re=names.ROUTED_EXPERT_RE,
    experts_weight_after_w2=False,
    tensor_inventory=sizing.tensor_inventory,
    format_info=sizing.format_info,
    checkpoint_formats=random_weights.FORMATS,
    random_checkpoint=random_weights.random_checkpoint,
    token_pages_per_sequence=pools.token_pages_per_sequence,
    weights_bytes=sizing.weights_bytes,
    kv_pool_bytes_per_token=lambda cfg, b: float(sizing.kv_bytes_per_token(cfg, "pool", b)["total"]),
    memory_plan=sizing.memory_plan,
    needs_custom_ops=True,
    tp_split_dim0=tp_rules.SPLIT_DIM0,
    tp_split_dim1=tp_rules.SPLIT_DIM1,
    validate_tp=tp_rules.validate,
    shared_expert_inter=tp_rules.shared_expert_inter,
)
