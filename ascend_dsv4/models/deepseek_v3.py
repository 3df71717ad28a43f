"""DeepSeek-V3 / V3.1 / R1: Multi-head Latent Attention with a compressed latent cache, group-limited MoE, MTP.

Forward over a ragged batch (``input_ids`` [T] + an :class:`MLAStepContext`) -> final hidden states [T, dim]
before the last norm; :meth:`DeepseekV3Model.logits` applies norm + head. Module names follow the Hugging Face
checkpoint without the ``model.`` prefix (``layers.i.self_attn.kv_b_proj``); routed experts are stacked
(``layers.i.mlp.experts.w1`` [E, inter, dim]); the MTP module (checkpoint layer id ``num_hidden_layers``) lives
under ``mtp.0``.

Attention (seed ``optimizing_mla.md``): only the latent ``[c_kv | k_pe]`` is cached. Tokens of sequences that
decode one token run the absorbed form (W_UK folded into the query, W_UV applied after attention, rope and
nope scores computed separately and added: ``atb_ops.mla_decode``); tokens of prefills and prefill chunks run
the decompressed form over their context (``atb_ops.mla_prefill``), which costs fewer FLOPs for long queries.
"""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.linear import Linear

from .common import RMSNorm, fp32_param
from .v4_moe import Experts


class MLA(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        H, C, R = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.H, self.C, self.R, self.Dn, self.Dv = H, C, R, cfg.qk_nope_head_dim, cfg.v_head_dim
        qk = cfg.qk_nope_head_dim + R
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.dim, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, dtype)
        else:
            self.q_proj = Linear(cfg.dim, H * qk, dtype)
        self.kv_a_proj_with_mqa = Linear(cfg.dim, C + R, dtype)
        self.kv_a_layernorm = RMSNorm(C, cfg.norm_eps)
        self.kv_b_proj = Linear(C, H * (self.Dn + self.Dv), dtype)
        self.kv_b_proj.keep_checkpoint_format = False  # split into W_UK / W_UV for the absorbed decode
        self.o_proj = Linear(H * self.Dv, cfg.dim, dtype)
        self.scale = cfg.softmax_scale
        self.rope_factor = cfg.rope_attention_factor
        self.register_buffer("inv_freq", atb_ops.rope_inv_freq(R, cfg.rope_theta, cfg.rope_factor,
                                                               cfg.original_seq_len if cfg.rope_factor > 1 else 0,
                                                               cfg.beta_fast, cfg.beta_slow), persistent=False)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(T, self.H, self.Dn + self.R)
        q_nope, q_pe = q[..., : self.Dn], atb_ops.apply_rope(q[..., self.Dn:], ctx.positions, self.inv_freq)
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[:, : self.C])
        k_pe = atb_ops.apply_rope(kv[:, self.C:], ctx.positions, self.inv_freq)
        if self.rope_factor != 1.0:  # YaRN attention factor scales cos/sin of both q and k
            q_pe, k_pe = q_pe * self.rope_factor, k_pe * self.rope_factor
        pool = ctx.pools.layer(self.layer_id)
        pool.index_copy_(0, ctx.swa_slot, torch.cat([c, k_pe], dim=-1).to(pool.dtype))

        w = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.C)
        out = x.new_zeros(T, self.H, self.Dv)
        dec = (~ctx.prefill).nonzero(as_tuple=True)[0]
        pre = ctx.prefill.nonzero(as_tuple=True)[0]
        if len(dec):
            q_abs = atb_ops.group_linear(q_nope[dec], w[:, : self.Dn].transpose(1, 2))
            o_lat = atb_ops.mla_decode(q_abs, q_pe[dec], pool, ctx.context[dec], self.scale)
            out[dec] = atb_ops.group_linear(o_lat, w[:, self.Dn:]).to(out.dtype)
        if len(pre):
            idx = ctx.context[pre]
            slots = torch.unique(idx[idx >= 0])  # the latents these prefill tokens read, decompressed once
            rows = pool[slots]
            kvb = self.kv_b_proj(rows[:, : self.C].to(x.dtype)).view(-1, self.H, self.Dn + self.Dv)
            local = torch.where(idx >= 0, torch.searchsorted(slots, idx.clamp(min=0)), torch.full_like(idx, -1))
            out[pre] = atb_ops.mla_prefill(q_nope[pre], q_pe[pre], kvb[..., : self.Dn], rows[:, self.C:].to(x.dtype),
                                           kvb[..., self.Dn:], local, self.scale).to(out.dtype)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SiLU-gated MLP (dense layers and the shared experts)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, inter, dtype), Linear(dim, inter, dtype)
        self.down_proj = Linear(inter, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(atb_ops.swiglu(self.gate_proj(x), self.up_proj(x), 0.0).to(x.dtype))


class Gate(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = fp32_param(cfg.n_routed_experts)

    def forward(self, x):
        c = self.cfg
        return atb_ops.moe_gate(x, self.weight, self.e_score_correction_bias, c.n_activated_experts, c.route_scale,
                                score_func=c.score_func, n_groups=c.n_expert_groups, topk_groups=c.n_limited_groups,
                                normalize=c.norm_topk_prob)


class MoE(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim, 0.0, dtype, False)
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts, dtype) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = MLA(cfg, layer_id, dtype)
        self.mlp = MoE(cfg, dtype) if cfg.is_moe_layer(layer_id) else MLP(cfg.dim, cfg.inter_dim, dtype)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class MTPLayer(DecoderLayer):
    """V3 MTP module: eh_proj([enorm(embed(t+1)) | hnorm(h_t)]) -> one decoder layer -> shared_head.norm."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, layer_id, dtype)
        self.enorm, self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, dtype)
        self.shared_head = SharedHead(cfg)

    def forward(self, h, ctx, next_ids, embed):  # see DeepseekV3Model.mtp_forward
        x = self.eh_proj(torch.cat([self.enorm(embed[next_ids]), self.hnorm(h)], dim=-1))
        return DecoderLayer.forward(self, x, ctx)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16, numerics: str = "exact"):
        super().__init__()
        if numerics != "exact":
            raise ValueError("DeepSeek-V3 supports numerics='exact' only")
        self.cfg, self.dtype, self.numerics = cfg, dtype, numerics
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, dtype)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.n_layers + k, dtype) for k in range(cfg.n_mtp_layers))

    def canonical_name(self, checkpoint_name: str) -> str | None:
        """Module name of a checkpoint tensor (the loader's name map for V3)."""
        from ..weights.names import canonical_name_v3

        return canonical_name_v3(checkpoint_name, self.cfg.n_layers)

    def make_pools(self, sizes, dtype: torch.dtype, device):
        from ..engine.mla_pools import MLAKVPools

        return MLAKVPools(self.cfg, sizes, dtype, device)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids [T] -> hidden [T, dim] after the last layer (before the final norm)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return x

    def logits(self, hidden: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        if index is not None:
            hidden = hidden[index]
        return self.lm_head(self.norm(hidden)).float()

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, ctx, k: int = 0) -> torch.Tensor:
        """MTP module k on the main model's final-normed hidden states at positions t and token ids at t+1
        (vLLM / SGLang feed the normed hidden states); returns the MTP layer's hidden states."""
        return self.mtp[k](self.norm(hidden), ctx, next_ids, self.embed_tokens.weight)

    def mtp_logits(self, hidden, next_ids, ctx, k: int = 0, index=None) -> torch.Tensor:
        x = self.mtp_forward(hidden, next_ids, ctx, k)
        if index is not None:
            x = x[index]
        return self.lm_head(self.mtp[k].shared_head.norm(x)).float()
