"""transformers' DeepseekV4ForCausalLM as an oracle: build one from our config, with random weights."""

from __future__ import annotations

import torch

from ascend_dsv4.models.deepseek_v4.config import RATIO_TO_LAYER_TYPE, DeepseekV4Config as ModelConfig


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.n_activated_experts, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, routed_scaling_factor=cfg.route_scale,
        layer_types=[RATIO_TO_LAYER_TYPE[r] for r in cfg.compress_ratios[: cfg.n_layers]],
        num_hash_layers=cfg.n_hash_layers, swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=cfg.n_mtp_layers,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def random_hf_model(cfg: ModelConfig, seed: int = 0):
    """A float32 DeepseekV4ForCausalLM whose every parameter (sinks, biases, ape, hc bases too) is random."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = p.shape[-1] ** -0.5 if "embed" not in name else 1.0
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif name.endswith("scale"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.5 * torch.randn(b.shape, generator=g))
    return model
