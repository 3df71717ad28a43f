"""DeepSeek-V4 attention: sliding window + compressed entries (CSA with indexer, HCA) + sink (README.md §2.3).

Every tensor is token-major over a ragged batch: ``x`` is ``[T, dim]``; KV state lives in the paged pools
of ``ctx.pools`` and is addressed with the slot tensors of the :class:`StepContext`.
"""

from __future__ import annotations

import torch
from torch import nn

import atb_ops
from parallel.groups import Group
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.linear import Linear, stacked_linear

from ...kv.context import StepContext
from ...layers.norm import RMSNorm, fp32_param
from ...layers.overlap import run_beside
from .config import DeepseekV4Config


def layer_inv_freq(cfg: DeepseekV4Config, ratio: int) -> torch.Tensor:
    """RoPE table of a layer: base 10000 without YaRN for ratio 0, else base 160000 with YaRN (README.md §2.0)."""
    if ratio == 0:
        return atb_ops.rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta)
    return atb_ops.rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor,
                                 cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)


class Compressor(nn.Module):
    """Gated pooling of ``ratio`` tokens (2*ratio with overlap) into one ``head_dim`` entry.

    Parameters (official names): ``wkv``, ``wgate`` [kappa*c, dim] (float32 compute), ``ape`` [r, kappa*c],
    ``norm`` [c]. ``rotate`` marks the indexer's compressor (Hadamard + FP4 in reference numerics) versus
    the main one (FP8 on the non-rope channels in reference numerics).
    """

    def __init__(self, cfg: DeepseekV4Config, ratio: int, head_dim: int, rotate: bool, dtype: torch.dtype,
                 reference: bool):
        super().__init__()
        self.ratio, self.head_dim, self.rotate, self.reference = ratio, head_dim, rotate, reference
        self.overlap = ratio == 4
        width = (2 if self.overlap else 1) * head_dim
        self.rope_head_dim = cfg.rope_head_dim
        self.wkv = Linear(cfg.dim, width, torch.float32, compute_fp32=True)
        self.wgate = Linear(cfg.dim, width, torch.float32, compute_fp32=True)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)
        self.dtype = dtype

    def stacked_linears(self):
        """wkv and wgate read the same input: one GEMM once stacked (parallel.linear.stack_model_linears_)."""
        return ((self.wkv, self.wgate),)

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_id: int, inv_freq: torch.Tensor) -> None:
        """Write this step's state rows, pool the entries completed in this step, store them."""
        which = "index" if self.rotate else "main"
        kv_rows, score_rows = ctx.pools.state_layer(layer_id, which)
        a, z = stacked_linear((self.wkv, self.wgate), x)
        atb_ops.compressor_state_write(kv_rows, score_rows, a, z, self.ape, ctx.positions, ctx.swa_slot)
        cc = ctx.compress[self.ratio]
        if cc.new_slot.numel() == 0:
            return
        if not self.reference and type(self.norm) is RMSNorm:  # pool, norm, rope and the store as one op
            atb_ops.compressor_entries(kv_rows, score_rows, cc.new_cand, self.overlap, self.norm.weight, self.norm.eps,
                                       cc.new_pos, inv_freq, self.dtype, ctx.pools.entry_layer(layer_id, which),
                                       cc.new_slot)
            return
        e = atb_ops.compressor_pool(kv_rows, score_rows, cc.new_cand, self.overlap).to(self.dtype)
        e = self.norm(e)
        e = atb_ops.apply_rope(e, cc.new_pos, inv_freq)
        if self.reference:
            if self.rotate:
                e = atb_ops.fp4_act_round(atb_ops.hadamard(e), 32)
            else:
                e = _fp8_nope(e, self.rope_head_dim)
        ctx.pools.entry_layer(layer_id, which).index_copy_(0, cc.new_slot, e.to(ctx.pools.dtype))


def _fp8_nope(v: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8 round trip of the non-rope channels in blocks of 64 (official QAT simulation of the KV)."""
    return torch.cat([atb_ops.fp8_act_round(v[..., :-rope_dim], 64), v[..., -rope_dim:]], dim=-1)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: picks ``index_topk`` compressed entries per query."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, reference: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.reference = reference
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, fp8_input=reference)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype)
        self.compressor = Compressor(cfg, 4, self.head_dim, True, dtype, reference)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, x, qr, ctx: StepContext, layer_id: int, inv_freq) -> torch.Tensor:
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = atb_ops.apply_rope(q, ctx.positions, inv_freq)
        if self.reference:
            q = atb_ops.fp4_act_round(atb_ops.hadamard(q), 32)
        self.compressor(x, ctx, layer_id, inv_freq)
        w = self.weights_proj(x).float() * self.weight_scale
        keys = ctx.pools.entry_layer(layer_id, "index")
        return atb_ops.indexer_topk(q, w, keys, ctx.compress[4].visible, self.topk)


class Attention(nn.Module):
    """Under tensor parallelism (``tp``) the query heads (``wq_b``, ``attn_sink``) and the output groups (``wo_a``)
    are split, ``wo_b`` is row-parallel (all-reduce); the single MQA KV head (``wkv``), the compressor and the
    indexer are replicated so that every rank writes and selects exactly the single-device entries."""

    _param_shards = {"attn_sink": 0}  # split on dim 0 over ``tp`` (the loader's slicing rule)

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, dtype: torch.dtype, reference: bool,
                 tp: Group | None = None):
        super().__init__()
        self.tp = tp = tp or Group()
        self.layer_id, self.ratio = layer_id, cfg.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_head_dim = cfg.n_heads // tp.size, cfg.head_dim, cfg.rope_head_dim
        self.o_groups, self.o_lora_rank, self.eps = cfg.o_groups // tp.size, cfg.o_lora_rank, cfg.norm_eps
        self.reference = reference
        H, D = cfg.n_heads, cfg.head_dim
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype, fp8_input=reference)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, H * D, dtype, tp, fp8_input=reference)
        self.wkv = Linear(cfg.dim, D, dtype, fp8_input=reference)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        # wo_a runs in BF16 in the official model (dequantised at load): no activation rounding
        self.wo_a = ColumnParallelLinear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype, tp)
        self.wo_a.keep_checkpoint_format = False  # used as a dense einsum weight (README.md §3.3)
        # ... which a CUDA runner stores back in FP8 with ASCEND_DSV4_WO_A_FP8=1 where its values are exactly FP8
        # (the checkpoint's E8M0 blocks: parallel.linear.compact_fp8_weights_; group_linear takes both, same results)
        self.wo_a.fp8_compact = cfg.o_lora_rank % 128 == 0
        self.wo_b = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dtype, tp, fp8_input=reference)
        self.attn_sink = fp32_param(H // tp.size)
        self.compressor = Compressor(cfg, self.ratio, D, False, dtype, reference) if self.ratio else None
        self.indexer = Indexer(cfg, dtype, reference) if self.ratio == 4 else None
        self.register_buffer("inv_freq", layer_inv_freq(cfg, self.ratio), persistent=False)

    def stacked_linears(self):
        """wq_a and wkv read the same input: one GEMM once stacked (parallel.linear.stack_model_linears_)."""
        return ((self.wq_a, self.wkv),)

    def _query(self, qr: torch.Tensor, kv: torch.Tensor, swa: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The query heads [T, H, D] (normed, rotated); writes this step's window KV rows."""
        pos, inv_freq = ctx.positions, self.inv_freq
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = atb_ops.rms_norm_rope(q, None, self.eps, pos, inv_freq)
        if self.reference or type(self.kv_norm) is not RMSNorm:
            kv = atb_ops.apply_rope(self.kv_norm(kv), pos, inv_freq)
            if self.reference:
                kv = _fp8_nope(kv, self.rope_head_dim)
            swa.index_copy_(0, ctx.swa_slot, kv.to(swa.dtype))
        else:  # norm, rope and the window write in one op (one launch where the backend fuses them)
            atb_ops.rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, pos, inv_freq, swa, ctx.swa_slot)
        return q

    def _beside_query(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The compressed entries each query sees ([T, N] entry rows, -1 padded): CSA, the indexer's top-k (the
        layer's longest chain of small launches); HCA, all visible ones, after this step's compressor write. What
        runs beside the query; a CSA layer's compressor runs with the query instead (balancing the two streams)."""
        if self.indexer is not None:
            return self.indexer(x, qr, ctx, self.layer_id, self.inv_freq)
        self.compressor(x, ctx, self.layer_id, self.inv_freq)
        return ctx.compress[self.ratio].visible

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        pos, inv_freq = ctx.positions, self.inv_freq
        qa, kv = stacked_linear((self.wq_a, self.wkv), x)
        qr = self.q_norm(qa)
        swa = ctx.pools.swa_layer(self.layer_id)
        extra_kv = extra_idx = None
        if self.ratio:  # the compressed entries beside the query (a side stream on a GPU)
            def query_side():
                q = self._query(qr, kv, swa, ctx)
                if self.indexer is not None:  # CSA: the compressor with the query, the indexer beside them
                    self.compressor(x, ctx, self.layer_id, inv_freq)
                return q

            extra_idx, q = run_beside(lambda: self._beside_query(x, qr, ctx), query_side, x)
            extra_kv = ctx.pools.entry_layer(self.layer_id)
        else:
            q = self._query(qr, kv, swa, ctx)
        o = atb_ops.sparse_attention(q, swa, ctx.window, self.attn_sink, self.head_dim ** -0.5, extra_kv, extra_idx)
        o = atb_ops.apply_rope(o, pos, inv_freq, inverse=True)
        # grouped low-rank output: group g of heads -> o_lora_rank, then wo_b over all groups
        o = o.reshape(T, self.o_groups, -1)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)
        if self.wo_a.fmt == "fp8_block":
            scale = self.wo_a.scale.view(self.o_groups, self.o_lora_rank // 128, -1)
            z = atb_ops.group_linear(o, wo_a, scale, "fp8_block")
        else:
            z = atb_ops.group_linear(o, wo_a)
        return self.wo_b(z.flatten(1))
