"""DeepSeek-V4 (Flash / Pro and the toy preset) on atb_ops, with paged KV state (README.md §2).

Forward over a ragged batch: ``input_ids`` [T] and a :class:`StepContext` -> hyper-connection streams
[T, hc_mult, dim] after the last block (what MTP consumes); :meth:`DeepseekV4Model.logits` applies
hc_head, the final norm and the head to selected rows. Parameter names follow the official checkpoint
(``layers.i.attn.wq_a.weight``, ``layers.i.ffn.experts.w1`` stacked over experts, ``mtp.0.e_proj.weight``).

Numerics: ``exact`` computes the math of the spec without activation fake-quantisation; ``reference``
adds the official model's FP8/FP4 activation rounding (linear inputs, KV, indexer) so logits can be
compared with the official implementation.
"""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.groups import Group
from parallel.layers import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import Linear

from ...kv.compressed_pools import V4KVPools
from ...kv.context import StepContext
from ...layers.norm import RMSNorm, fp32_param
from .attention import Attention
from .config import DeepseekV4Config
from .moe import MoE

NUMERICS = ("exact", "reference")


class Block(nn.Module):
    """mHC-wrapped attention then mHC-wrapped MoE (README.md §2.2)."""

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, dtype: torch.dtype, reference: bool, parallel=None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer_id, dtype, reference, parallel.tp if parallel is not None else None)
        self.ffn = MoE(cfg, layer_id, dtype, reference, parallel)
        self.hc_attn_fn, self.hc_ffn_fn = fp32_param(mix, n * cfg.dim), fp32_param(mix, n * cfg.dim)
        self.hc_attn_base, self.hc_ffn_base = fp32_param(mix), fp32_param(mix)
        self.hc_attn_scale, self.hc_ffn_scale = fp32_param(3), fp32_param(3)

    def _hc_norm(self, x, fn, base, scale, norm):
        """(norm(u), post, comb) of the collapse u = hc_pre(x): one fused op for a plain :class:`RMSNorm` (the same
        math; one launch fewer where the backend fuses it), else hc_pre then the module (e.g. an msModelSlim
        smoothed norm that replaced it at load)."""
        c = self.cfg
        if type(norm) is RMSNorm:
            return atb_ops.hc_pre_norm(x, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, norm.weight,
                                       norm.eps)
        u, post, comb = atb_ops.hc_pre(x, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
        return norm(u), post, comb

    def forward(self, x: torch.Tensor, ctx: StepContext, token_ids: torch.Tensor) -> torch.Tensor:
        h, post, comb = self._hc_norm(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm)
        x = atb_ops.hc_post(self.attn(h, ctx), x, post, comb)
        h, post, comb = self._hc_norm(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm)
        return atb_ops.hc_post(self.ffn(h, token_ids), x, post, comb)


class HCHeadMixin:
    """hc_head collapse + final RMSNorm, owned by the main model and by each MTP module (official names
    ``hc_head_fn``, ``hc_head_base``, ``hc_head_scale``, ``norm``)."""

    def _init_head(self, cfg: DeepseekV4Config) -> None:
        self.hc_head_fn = fp32_param(cfg.hc_mult, cfg.hc_mult * cfg.dim)
        self.hc_head_base = fp32_param(cfg.hc_mult)
        self.hc_head_scale = fp32_param(1)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if type(self.norm) is RMSNorm:  # one fused op (one launch fewer where the backend fuses it)
            return atb_ops.hc_head_norm(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps,
                                        c.norm_eps, self.norm.weight, self.norm.eps)
        u = atb_ops.hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.norm_eps)
        return self.norm(u)


class MTPBlock(Block, HCHeadMixin):
    """MTP module k (README.md §2.6): embeds token t+1, mixes it with the main streams at t, runs one SWA block."""

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, dtype: torch.dtype, reference: bool, parallel=None):
        super().__init__(cfg, layer_id, dtype, reference, parallel)
        self._init_head(cfg)
        self.e_proj = Linear(cfg.dim, cfg.dim, dtype, fp8_input=reference)
        self.h_proj = Linear(cfg.dim, cfg.dim, dtype, fp8_input=reference)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, ctx, token_ids, embed):  # see DeepseekV4Model.mtp_forward
        e = self.e_proj(self.enorm(embed(token_ids)))
        h = e.unsqueeze(1) + self.h_proj(self.hnorm(x))
        return Block.forward(self, h, ctx, token_ids)


class DeepseekV4Model(nn.Module, HCHeadMixin):
    """``parallel`` (a :class:`parallel.groups.ParallelState`, None = one device): this rank's share of the model
    (vocab-parallel embedding and head, split heads / output groups, TP or EP experts; see
    ``ascend_dsv4.parallel_plan``); streams and logits are the full single-device tensors on every rank."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16, numerics: str = "exact",
                 parallel=None):
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.cfg, self.dtype, self.numerics = cfg, dtype, numerics
        self.parallel = parallel
        tp = parallel.tp if parallel is not None else Group()
        ref = numerics == "reference"
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, dtype, tp)
        self.layers = nn.ModuleList(Block(cfg, i, dtype, ref, parallel) for i in range(cfg.n_layers))
        self._init_head(cfg)
        self.head = ParallelLMHead(cfg.dim, cfg.vocab_size, torch.float32, tp, compute_fp32=True)
        self.mtp = nn.ModuleList(MTPBlock(cfg, cfg.n_layers + k, dtype, ref, parallel)
                                 for k in range(cfg.n_mtp_layers))

    def make_pools(self, sizes, dtype: torch.dtype, device, layout=None) -> V4KVPools:
        """``layout`` (the backend's ``atb_ops.KVLayout``) changes nothing here: the V4 pools have one layout."""
        return V4KVPools(self.cfg, sizes, dtype, device)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] int64 -> streams [T, hc_mult, dim] (model dtype); writes this step's KV."""
        h = self.embed(input_ids)
        x = h.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            x = layer(x, ctx, input_ids)
        return x

    def logits(self, streams: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """streams [T, hc_mult, dim] -> float32 logits [len(index), vocab] (all rows if index is None)."""
        if index is not None:
            streams = streams[index]
        return self.head(self.collapse(streams))

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext, k: int = 0) -> torch.Tensor:
        """MTP module k: streams at positions t (main model output) and token ids at t+1 -> MTP streams.

        Uses the same ``ctx`` (positions t) as the main step; writes the MTP layer's window KV.
        """
        return self.mtp[k](streams, ctx, next_ids, self.embed)

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext, k: int = 0,
                   index: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits [len(index), vocab] predicting token t+2 (README.md §2.6)."""
        x = self.mtp_forward(streams, next_ids, ctx, k)
        if index is not None:
            x = x[index]
        return self.head(self.mtp[k].collapse(x))
