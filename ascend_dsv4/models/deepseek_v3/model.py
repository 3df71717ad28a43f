"""DeepSeek-V3 / V3.1 / R1: Multi-head Latent Attention with a compressed latent cache, group-limited MoE, MTP.

Forward over a ragged batch (``input_ids`` [T] + an :class:`MLAStepContext`) -> final hidden states [T, dim]
before the last norm; :meth:`DeepseekV3Model.logits` applies norm + head. Module names follow the Hugging Face
checkpoint without the ``model.`` prefix (``layers.i.self_attn.kv_b_proj``); routed experts are stacked
(``layers.i.mlp.experts.w1`` [E, inter, dim]); the MTP module (checkpoint layer id ``num_hidden_layers``) lives
under ``mtp.0``.

Attention (MLA, DeepSeek-V2 paper §2.1): only the latent ``[c_kv | k_pe]`` is cached. Tokens of sequences that
decode one token run the absorbed form (W_UK folded into the query, W_UV applied after attention, rope and
nope scores computed separately and added: ``atb_ops.mla_decode``); tokens of prefills and prefill chunks run
the decompressed form over their context (``atb_ops.mla_prefill``), which costs fewer FLOPs for long queries.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.groups import Group
from parallel.layers import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import Linear

from ...kv.latent_pool import MLAKVPools, MLAStepContext
from ...layers.norm import RMSNorm, add_norm
from .attention import MLA
from .moe import MLP, MoE
from .names import canonical_name


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype: torch.dtype, parallel=None):
        super().__init__()
        tp = parallel.tp if parallel is not None else Group()  # never the default group at world size 1
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = MLA(cfg, layer_id, dtype, tp)
        self.mlp = MoE(cfg, dtype, parallel) if cfg.is_moe_layer(layer_id) else MLP(cfg.dim, cfg.inter_dim, dtype, tp)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        normed, h = add_norm(self.post_attention_layernorm, x, self.self_attn(self.input_layernorm(x), ctx))
        return h + self.mlp(normed)


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class MTPLayer(DecoderLayer):
    """V3 MTP module: eh_proj([enorm(embed(t+1)) | hnorm(h_t)]) -> one decoder layer -> shared_head.norm."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype, parallel=None):
        super().__init__(cfg, layer_id, dtype, parallel)
        self.enorm, self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, dtype)
        self.shared_head = SharedHead(cfg)

    def forward(self, h, ctx, next_ids, embed):  # see DeepseekV3Model.mtp_forward
        x = self.eh_proj(torch.cat([self.enorm(embed(next_ids)), self.hnorm(h)], dim=-1))
        return DecoderLayer.forward(self, x, ctx)


class DeepseekV3Model(nn.Module):
    """``parallel`` (a :class:`parallel.groups.ParallelState`, None = one device): this rank's share (vocab-parallel
    embedding and head, split heads, TP or EP experts); hidden states and logits are full on every rank."""

    def __init__(self, cfg, dtype: torch.dtype = torch.bfloat16, numerics: str = "exact", parallel=None):
        super().__init__()
        if numerics != "exact":
            raise ValueError("DeepSeek-V3 supports numerics='exact' only")
        self.cfg, self.dtype, self.numerics = cfg, dtype, numerics
        self.parallel = parallel
        tp = parallel.tp if parallel is not None else Group()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, parallel) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = ParallelLMHead(cfg.dim, cfg.vocab_size, dtype, tp)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.n_layers + k, dtype, parallel) for k in range(cfg.n_mtp_layers))

    def canonical_name(self, checkpoint_name: str) -> str | None:
        """Module name of a checkpoint tensor (the loader's name map for V3)."""
        return canonical_name(checkpoint_name, self.cfg.n_layers)

    def make_pools(self, sizes, dtype: torch.dtype, device, layout=None) -> MLAKVPools:
        """``layout``: the ``atb_ops.KVLayout`` the op backend asks for (None: the reference layout)."""
        return MLAKVPools(self.cfg, sizes, dtype, device, split_rope=bool(layout and layout.mla_split_rope))

    def forward(self, input_ids: torch.Tensor, ctx: MLAStepContext) -> torch.Tensor:
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
        return self.mtp[k](self.norm(hidden), ctx, next_ids, self.embed_tokens)

    def mtp_logits(self, hidden, next_ids, ctx, k: int = 0, index=None) -> torch.Tensor:
        x = self.mtp_forward(hidden, next_ids, ctx, k)
        if index is not None:
            x = x[index]
        return self.lm_head(self.mtp[k].shared_head.norm(x)).float()
