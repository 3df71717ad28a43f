"""DeepSeek-V3 Multi-head Latent Attention over the paged latent pool (absorbed decode, decompressed prefill).

Only the latent ``[c_kv | k_pe]`` is cached (:mod:`ascend_dsv4.kv.latent_pool`). Tokens of sequences that decode
one token run the absorbed form (W_UK folded into the query, W_UV applied after attention, rope and nope scores
computed separately and added: ``atb_ops.mla_decode``); tokens of prefills and prefill chunks run the
decompressed form over their context (``atb_ops.mla_prefill``), which costs fewer FLOPs for long queries.
"""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.groups import Group
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.linear import Linear, stacked_linear

from ...kv.latent_pool import MLAStepContext
from ...layers.norm import RMSNorm


class MLA(nn.Module):
    """Under tensor parallelism (``tp``) the heads are split (``q_b_proj`` / ``q_proj``, ``kv_b_proj`` column-,
    ``o_proj`` row-parallel); ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated and so is the latent cache."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype, tp: Group | None = None):
        super().__init__()
        tp = tp or Group()
        self.layer_id = layer_id
        H, C, R = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.H, self.C, self.R, self.Dn, self.Dv = H // tp.size, C, R, cfg.qk_nope_head_dim, cfg.v_head_dim
        qk = cfg.qk_nope_head_dim + R
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.dim, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * qk, dtype, tp)
        else:
            self.q_proj = ColumnParallelLinear(cfg.dim, H * qk, dtype, tp)
        self.kv_a_proj_with_mqa = Linear(cfg.dim, C + R, dtype)
        self.kv_a_layernorm = RMSNorm(C, cfg.norm_eps)
        self.kv_b_proj = ColumnParallelLinear(C, H * (self.Dn + self.Dv), dtype, tp)
        self.kv_b_proj.keep_checkpoint_format = False  # split into W_UK / W_UV for the absorbed decode
        self.o_proj = RowParallelLinear(H * self.Dv, cfg.dim, dtype, tp)
        self.scale = cfg.softmax_scale
        self.rope_factor = cfg.rope_attention_factor
        self.register_buffer("inv_freq", atb_ops.rope_inv_freq(R, cfg.rope_theta, cfg.rope_factor,
                                                               cfg.original_seq_len if cfg.rope_factor > 1 else 0,
                                                               cfg.beta_fast, cfg.beta_slow), persistent=False)

    def stacked_linears(self):
        """q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM once stacked (parallel.linear)."""
        return ((self.q_a_proj, self.kv_a_proj_with_mqa),) if hasattr(self, "q_a_proj") else ()

    def forward(self, x: torch.Tensor, ctx: MLAStepContext) -> torch.Tensor:
        """x [T, dim] -> [T, dim]; writes this step's latents into ``ctx.pools``."""
        T = x.shape[0]
        if hasattr(self, "q_a_proj"):
            qa, kv = stacked_linear((self.q_a_proj, self.kv_a_proj_with_mqa), x)
            q = self.q_b_proj(self.q_a_layernorm(qa))
        else:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(T, self.H, self.Dn + self.R)
        q_nope, q_pe = q[..., : self.Dn], atb_ops.apply_rope(q[..., self.Dn:], ctx.positions, self.inv_freq)
        c = self.kv_a_layernorm(kv[:, : self.C])
        k_pe = atb_ops.apply_rope(kv[:, self.C:], ctx.positions, self.inv_freq)
        if self.rope_factor != 1.0:  # YaRN attention factor scales cos/sin of both q and k
            q_pe, k_pe = q_pe * self.rope_factor, k_pe * self.rope_factor
        pools = ctx.pools
        pools.write(self.layer_id, ctx.swa_slot, c, k_pe)

        w = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.C)
        out = x.new_zeros(T, self.H, self.Dv)
        dec = (~ctx.prefill).nonzero(as_tuple=True)[0]
        pre = ctx.prefill.nonzero(as_tuple=True)[0]
        if len(dec):
            q_abs = atb_ops.group_linear(q_nope[dec], w[:, : self.Dn].transpose(1, 2))
            if pools.split_rope:  # the layout the backend asked for (atb_ops.KVLayout): two caches
                c_kv, kpe = pools.layer_split(self.layer_id)
                o_lat = atb_ops.mla_decode_split(q_abs, q_pe[dec], c_kv, kpe, ctx.context[dec], self.scale)
            else:
                o_lat = atb_ops.mla_decode(q_abs, q_pe[dec], pools.layer(self.layer_id), ctx.context[dec],
                                           self.scale)
            out[dec] = atb_ops.group_linear(o_lat, w[:, self.Dn:]).to(out.dtype)
        if len(pre):
            idx = ctx.context[pre]
            slots = torch.unique(idx[idx >= 0])  # the latents these prefill tokens read, decompressed once
            rows = pools.rows(self.layer_id, slots)
            kvb = self.kv_b_proj(rows[:, : self.C].to(x.dtype)).view(-1, self.H, self.Dn + self.Dv)
            local = torch.where(idx >= 0, torch.searchsorted(slots, idx.clamp(min=0)), torch.full_like(idx, -1))
            out[pre] = atb_ops.mla_prefill(q_nope[pre], q_pe[pre], kvb[..., : self.Dn], rows[:, self.C:].to(x.dtype),
                                           kvb[..., self.Dn:], local, self.scale).to(out.dtype)
        return self.o_proj(out.flatten(1))
