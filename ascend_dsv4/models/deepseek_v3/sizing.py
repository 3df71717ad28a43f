"""Sizes of a DeepSeek-V3-family model: tensors, parameters, MLA KV-cache bytes per token, memory plans.

Pure functions of a :class:`~ascend_dsv4.models.deepseek_v3.config.DeepseekV3Config` (no torch).

**Tensor inventory** (:func:`tensor_inventory`, Hugging Face names; ``d`` = dim, ``H`` = n_heads, ``q`` =
q_lora_rank, ``c`` = kv_lora_rank, ``n``/``r``/``v`` = qk_nope/qk_rope/v head dims, ``E`` routed experts of width
``I`` = moe_inter_dim, ``S`` = n_shared_experts)::

    model.embed_tokens.weight [vocab, d]; model.norm.weight [d]; lm_head.weight [vocab, d]
    model.layers.i.  input_layernorm, post_attention_layernorm [d]
      self_attn.q_a_proj [q, d], q_a_layernorm [q], q_b_proj [H(n+r), q]   (q = 0: self_attn.q_proj [H(n+r), d])
      self_attn.kv_a_proj_with_mqa [c+r, d], kv_a_layernorm [c], kv_b_proj [H(n+v), c], o_proj [d, Hv]
      dense (i < n_dense_layers): mlp.gate_proj, up_proj [inter_dim, d], down_proj [d, inter_dim]
      MoE: mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias [E], mlp.experts.e.{gate,up,down}_proj
           (width I), mlp.shared_experts.{gate,up,down}_proj (width I*S)
    MTP layer j (id n_layers + j, always MoE): the layer above plus enorm, hnorm [d], eh_proj [d, 2d],
      shared_head.norm [d], and the checkpoint's *copies* embed_tokens.weight / shared_head.head.weight [vocab, d]

Formats with ``dtype == "fp8"`` (the published checkpoint): every projection of the attention, dense MLP, routed
and shared experts is F8_E4M3 plus an F32 ``weight_scale_inv [ceil(out/128), ceil(in/128)]``; embeddings, heads,
norms, ``mlp.gate.weight`` and ``eh_proj`` are BF16; ``e_score_correction_bias`` is F32. With ``dtype == "bf16"``
the FP8 projections are BF16 without scales. At V3 sizes this reproduces the published checkpoint exactly:
91,991 tensors, 688,574,839,360 bytes (``checkpoint_bytes``).

**Parameter-count convention** (:func:`param_count`): Σ elements of every weight tensor, *including* norm weights
and ``e_score_correction_bias``, *excluding* the ``weight_scale_inv`` scales and the MTP layer's copies of the
embedding and head (``tensor.copy``: shared with the main model, counted once). At V3 sizes:

* main model (embedding, 61 layers, final norm, head): 671,026,419,200 = 671.03 B (the seed's "671B": +0.004 %);
* MTP unique (enorm, hnorm, eh_proj, shared_head.norm and its MoE decoder layer): 11,610,068,224 = 11.61 B (the
  seed's "11.5B unique": +0.96 %; without the 0.21 B ``eh_proj`` it is 11,507,307,776 = 11.51 B, +0.06 %);
  total with MTP 682,636,487,424; checkpoint weight elements incl. the two 0.93 B MTP copies 684,489,845,504
  (the model card's "685B");
* active per token (:func:`active_param_count`: 8 of 256 routed experts, shared expert, embedding and head):
  main 37,552,297,472 = 37.55 B (the seed says 36.7 B; V3's paper says 37 B); MTP 2,541,458,688 incl. the shared
  embedding and head (the seed says 2.4 B).

**KV cache** (:func:`kv_bytes_per_token`): MLA caches the latent ``c_kv`` plus the roped key per token and layer,
``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes`` = 1,152 B at V3 sizes in BF16, against
``H * (qk_head_dim + v_head_dim) * dtype_bytes`` = 81,920 B for the decompressed per-head K and V (the
"CacheCompressed 1.152 kB vs CacheDecompressed 81.92 kB" table of optimizing_mla.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import RequestError
from ..sizing import TensorSpec, fmt_bytes as _gib, fmt_ids as _ids, fmt_params as _params
from .config import DeepseekV3Config, yarn_get_mscale


@dataclass(frozen=True)
class TensorSpecV3(TensorSpec):
    """A checkpoint tensor (see :class:`~ascend_dsv4.models.sizing.TensorSpec`); ``copy`` marks the MTP layer's stored
    copies of the shared embedding and head (in the files, not extra parameters)."""

    copy: bool = False

    @property
    def is_param(self) -> bool:
        return not (self.scale or self.table or self.copy)


GROUPS = ("embed", "head", "attention", "dense_mlp", "router", "experts", "shared_experts", "norms", "mtp")


def tensor_inventory(cfg: DeepseekV3Config, include_mtp: bool = True) -> list[TensorSpecV3]:
    """Every tensor of the HF checkpoint described by ``cfg`` (module docstring: names, shapes, formats).

    Groups: 'embed', 'head', 'attention' (projections and q_a/kv_a layernorms), 'dense_mlp', 'router' (gate weight
    and e_score_correction_bias), 'experts' (routed), 'shared_experts', 'norms' (input/post-attention layernorms,
    final norm) and 'mtp' (everything of the MTP layers, their decoder layer included)."""
    d, H = cfg.dim, cfg.n_heads
    out: list[TensorSpecV3] = []

    def add(name, shape, dtype, group, **kw):
        out.append(TensorSpecV3(name, tuple(shape), dtype, group, **kw))

    def linear(name, o, i, group, count=1):
        """A projection [o, i]: FP8 + F32 scale_inv with dtype fp8, else BF16."""
        if cfg.dtype == "fp8":
            add(name + ".weight", (o, i), "F8_E4M3", group, count=count)
            add(name + ".weight_scale_inv", (-(-o // 128), -(-i // 128)), "F32", group, count=count, scale=True)
        else:
            add(name + ".weight", (o, i), "BF16", group, count=count)

    def layer(p: str, lid: int, mtp: bool) -> None:
        g = (lambda _: "mtp") if mtp else (lambda name: name)
        add(p + "input_layernorm.weight", (d,), "BF16", g("norms"))
        add(p + "post_attention_layernorm.weight", (d,), "BF16", g("norms"))
        a = p + "self_attn."
        if cfg.q_lora_rank:
            linear(a + "q_a_proj", cfg.q_lora_rank, d, g("attention"))
            add(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "BF16", g("attention"))
            linear(a + "q_b_proj", H * cfg.qk_head_dim, cfg.q_lora_rank, g("attention"))
        else:
            linear(a + "q_proj", H * cfg.qk_head_dim, d, g("attention"))
        linear(a + "kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, d, g("attention"))
        add(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "BF16", g("attention"))
        linear(a + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, g("attention"))
        linear(a + "o_proj", d, H * cfg.v_head_dim, g("attention"))
        m = p + "mlp."
        if not cfg.is_moe_layer(lid):
            for w, (o, i) in (("gate_proj", (cfg.inter_dim, d)), ("up_proj", (cfg.inter_dim, d)),
                              ("down_proj", (d, cfg.inter_dim))):
                linear(m + w, o, i, g("dense_mlp"))
            return
        E, I = cfg.n_routed_experts, cfg.moe_inter_dim
        add(m + "gate.weight", (E, d), "BF16", g("router"))
        add(m + "gate.e_score_correction_bias", (E,), "F32", g("router"))
        for w, (o, i) in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
            linear(m + f"experts.{{e}}.{w}", o, i, g("experts"), count=E)
        if cfg.n_shared_experts:
            Is = I * cfg.n_shared_experts
            for w, (o, i) in (("gate_proj", (Is, d)), ("up_proj", (Is, d)), ("down_proj", (d, Is))):
                linear(m + f"shared_experts.{w}", o, i, g("shared_experts"))

    add("model.embed_tokens.weight", (cfg.vocab_size, d), "BF16", "embed")
    for i in range(cfg.n_layers):
        layer(f"model.layers.{i}.", i, mtp=False)
    if include_mtp:
        for j in range(cfg.n_mtp_layers):
            lid = cfg.n_layers + j
            p = f"model.layers.{lid}."
            layer(p, lid, mtp=True)
            add(p + "embed_tokens.weight", (cfg.vocab_size, d), "BF16", "mtp", copy=True)
            add(p + "enorm.weight", (d,), "BF16", "mtp")
            add(p + "hnorm.weight", (d,), "BF16", "mtp")
            add(p + "eh_proj.weight", (d, 2 * d), "BF16", "mtp")
            add(p + "shared_head.norm.weight", (d,), "BF16", "mtp")
            add(p + "shared_head.head.weight", (cfg.vocab_size, d), "BF16", "mtp", copy=True)
    add("model.norm.weight", (d,), "BF16", "norms")
    add("lm_head.weight", (cfg.vocab_size, d), "BF16", "head")
    return out


def param_count(cfg: DeepseekV3Config, include_mtp: bool = True) -> int:
    """Unique parameters: Σ elements of all weights (norms and e_score_correction_bias included), scales and the
    MTP copies of embedding / head excluded. V3: 671,026,419,200 main; 682,636,487,424 with MTP."""
    return sum(t.logical_numel for t in tensor_inventory(cfg, include_mtp) if t.is_param)


def mtp_param_count(cfg: DeepseekV3Config) -> int:
    """Unique MTP parameters (the seed's "11.5B unique": V3 gives 11,610,068,224)."""
    return param_count(cfg, True) - param_count(cfg, False)


def param_breakdown(cfg: DeepseekV3Config, include_mtp: bool = True) -> dict[str, int]:
    """Unique parameters per group (:data:`GROUPS`); the values sum to :func:`param_count`."""
    out = {k: 0 for k in GROUPS}
    for t in tensor_inventory(cfg, include_mtp):
        if t.is_param:
            out[t.group] += t.logical_numel
    return out


def checkpoint_tensors(cfg: DeepseekV3Config, include_mtp: bool = True) -> dict[str, int]:
    """What the checkpoint files hold: 'tensors' (count), 'weight_elements' (all non-scale tensors, MTP copies
    included), 'scale_elements', 'copy_elements' (the MTP layers' embed_tokens / shared_head.head copies),
    'unique_params' (= :func:`param_count`) and 'bytes'. V3: 91,991 tensors, 688,574,839,360 B."""
    inv = tensor_inventory(cfg, include_mtp)
    return {
        "tensors": sum(t.count for t in inv),
        "weight_elements": sum(t.logical_numel for t in inv if not t.scale),
        "scale_elements": sum(t.logical_numel for t in inv if t.scale),
        "copy_elements": sum(t.logical_numel for t in inv if t.copy),
        "unique_params": sum(t.logical_numel for t in inv if t.is_param),
        "bytes": sum(t.nbytes for t in inv),
    }


def checkpoint_bytes(cfg: DeepseekV3Config, include_mtp: bool = True) -> int:
    """Bytes of every checkpoint tensor (weights, scales, MTP copies) in the format of ``cfg.dtype``."""
    return sum(t.nbytes for t in tensor_inventory(cfg, include_mtp))


def active_param_count(cfg: DeepseekV3Config, include_mtp: bool = False) -> int:
    """Parameters touched per token: all unique parameters except the routed experts, of which
    ``n_activated_experts / n_routed_experts``. ``include_mtp=True`` gives the MTP module alone *plus* the shared
    embedding and head (the seed's "2.4B activation parameters" convention: 2.54 B at V3); else the main model
    (37.55 B at V3; the seed says 36.7 B)."""
    inv = tensor_inventory(cfg, include_mtp)
    if include_mtp:
        inv = [t for t in inv if t.group in ("mtp", "embed", "head")]
    inv = [t for t in inv if t.is_param]
    experts = sum(t.logical_numel for t in inv if ".experts." in t.name)
    rest = sum(t.logical_numel for t in inv) - experts
    return rest + experts * cfg.n_activated_experts // cfg.n_routed_experts


# ---- KV cache ----------------------------------------------------------------------------------------

def kv_bytes_per_token(cfg: DeepseekV3Config, dtype_bytes: int = 2, include_mtp: bool = True) -> dict[str, int]:
    """KV bytes that one more token of context adds.

    * 'latent': per layer, the compressed MLA cache ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``
      (c_kv and the roped shared key): 1,152 B at V3 sizes in BF16;
    * 'decompressed': per layer, per-head K and V ``n_heads * (qk_head_dim + v_head_dim) * dtype_bytes``:
      81,920 B at V3 sizes in BF16 (71.1 x the latent);
    * 'layers': layers holding a cache (n_layers, + n_mtp_layers with ``include_mtp``);
    * 'latent_total', 'decompressed_total': the per-layer values times 'layers'.
    """
    if not isinstance(dtype_bytes, int) or isinstance(dtype_bytes, bool) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    decomp = cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * dtype_bytes
    n = cfg.n_layers + (cfg.n_mtp_layers if include_mtp else 0)
    return {"latent": latent, "decompressed": decomp, "layers": n, "latent_total": n * latent,
            "decompressed_total": n * decomp}


# ---- weights and memory plans ------------------------------------------------------------------------

def weights_bytes(cfg: DeepseekV3Config, include_mtp: bool = True) -> int:
    """Bytes of the weights an engine holds in the checkpoint format: every tensor (scales included) except the
    MTP copies of embedding and head (shared with the main model)."""
    return sum(t.nbytes for t in tensor_inventory(cfg, include_mtp) if not t.copy)


def dequantized_weights_bytes(cfg: DeepseekV3Config, dtype_bytes: int = 2, include_mtp: bool = True) -> int:
    """Bytes of the unique weights held dequantised at ``dtype_bytes`` (F32 tensors, i.e.
    e_score_correction_bias, at 4 B); scales dropped."""
    return sum((4 if t.dtype == "F32" else dtype_bytes) * t.logical_numel
               for t in tensor_inventory(cfg, include_mtp) if t.is_param)


def memory_plan(cfg: DeepseekV3Config, context_len: int, batch: int, dtype_bytes: int = 2,
                   include_mtp: bool = True) -> dict[str, int]:
    """Memory for ``batch`` sequences of ``context_len`` tokens each (bytes, all ints):

    * ``weights_bytes``: :func:`weights_bytes` (checkpoint format, scales included, MTP copies not);
      ``weights_dequantized_bytes``: :func:`dequantized_weights_bytes` at ``dtype_bytes``;
      ``checkpoint_bytes``: the files (:func:`checkpoint_bytes`, MTP copies included);
    * ``kv_per_seq`` = context_len * latent bytes per token over all cached layers (MLA latent cache at
      ``dtype_bytes``); ``kv_bytes`` = batch * kv_per_seq;
    * ``kv_decompressed_bytes``: the same batch with a decompressed per-head K/V cache, for comparison;
    * ``total_bytes`` = weights_bytes + kv_bytes (activations and workspace not included).
    """
    for name, v, lo in (("context_len", context_len, 0), ("batch", batch, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise RequestError(f"{name} must be an integer >= {lo}, got {v!r}")
    if context_len > cfg.max_position_embeddings:
        raise RequestError(f"context_len {context_len} exceeds the model's max_position_embeddings "
                           f"{cfg.max_position_embeddings}")
    kv = kv_bytes_per_token(cfg, dtype_bytes, include_mtp)
    w = weights_bytes(cfg, include_mtp)
    per_seq = context_len * kv["latent_total"]
    return {
        "context_len": context_len,
        "batch": batch,
        "weights_bytes": w,
        "weights_dequantized_bytes": dequantized_weights_bytes(cfg, dtype_bytes, include_mtp),
        "checkpoint_bytes": checkpoint_bytes(cfg, include_mtp),
        "kv_per_seq": per_seq,
        "kv_bytes": batch * per_seq,
        "kv_decompressed_bytes": batch * context_len * kv["decompressed_total"],
        "total_bytes": w + batch * per_seq,
    }


# ---- report ------------------------------------------------------------------------------------------

def format_info(cfg: DeepseekV3Config, context_len: int, batch: int) -> str:
    """Human-readable report printed by ``ascend-dsv4 info`` for a V3-family model: config summary (dense / MoE
    layers, MLA dims, group-limited routing, YaRN / mscale), parameters, MLA cache bytes per token per layer
    (compressed latent vs decompressed K/V) and the memory plan for ``batch`` x ``context_len``."""
    L: list[str] = []
    a = L.append
    a(f"model        {cfg.name or '(unnamed)'}  [{cfg.model_type}]")
    mtp = (f" + {cfg.n_mtp_layers} MTP [{_ids(list(range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers)))}, MoE]"
           if cfg.n_mtp_layers else "")
    a(f"layers       {cfg.n_layers}{mtp}:  dense MLP {len(cfg.dense_layers)} [{_ids(cfg.dense_layers)}]  "
      f"MoE {len(cfg.moe_layers)} [{_ids(cfg.moe_layers)}]")
    a(f"hidden       dim {cfg.dim}, vocab {cfg.vocab_size}, dense inter {cfg.inter_dim}, "
      f"max positions {cfg.max_position_embeddings:,}, rms eps {cfg.norm_eps:g}")
    q = f"q_lora {cfg.q_lora_rank}" if cfg.q_lora_rank else "no q compression (q_proj)"
    a(f"attention    MLA {cfg.n_heads} heads, {q}, kv_lora {cfg.kv_lora_rank}, qk {cfg.qk_nope_head_dim} nope + "
      f"{cfg.qk_rope_head_dim} rope = {cfg.qk_head_dim}, v {cfg.v_head_dim}; softmax scale {cfg.softmax_scale:.6g}")
    if cfg.yarn:
        m = yarn_get_mscale(cfg.rope_factor, cfg.mscale_all_dim) if cfg.mscale_all_dim else 1.0
        a(f"rope         theta {cfg.rope_theta:g}, YaRN factor {cfg.rope_factor:g} (original {cfg.original_seq_len:,}, "
          f"beta {cfg.beta_fast:g}/{cfg.beta_slow:g}), mscale {cfg.mscale:g} / mscale_all_dim "
          f"{cfg.mscale_all_dim:g}: softmax scale x {m * m:.6g} (= {m:.6g}^2), cos/sin x "
          f"{cfg.rope_attention_factor:.6g}")
    else:
        a(f"rope         theta {cfg.rope_theta:g}, no YaRN")
    a(f"moe          {cfg.n_routed_experts} routed + {cfg.n_shared_experts} shared experts, "
      f"{cfg.n_activated_experts} active, inter {cfg.moe_inter_dim}; {cfg.score_func} scores + bias, "
      f"group-limited: {cfg.n_expert_groups} groups of {cfg.experts_per_group}, top-{cfg.n_limited_groups} groups; "
      f"norm_topk_prob {str(cfg.norm_topk_prob).lower()}, route_scale {cfg.route_scale:g}")
    fmt = "fp8 (e4m3, 128x128 blocks, F32 weight_scale_inv)" if cfg.dtype == "fp8" else "bf16"
    a(f"checkpoint   {fmt}")
    main_p, all_p = param_count(cfg, False), param_count(cfg, True)
    ck = checkpoint_tensors(cfg)
    a(f"parameters   {_params(main_p)} ({main_p:,}) main + {_params(all_p - main_p)} ({all_p - main_p:,}) MTP "
      f"unique = {_params(all_p)}; {_params(active_param_count(cfg))} active per token (MTP excluded)")
    a("  " + ", ".join(f"{k} {_params(v)}" for k, v in param_breakdown(cfg).items() if v))
    a(f"  checkpoint: {ck['tensors']:,} tensors, {_gib(ck['bytes'])} ({ck['bytes']:,} B), incl. "
      f"{_params(ck['copy_elements'])} of MTP embed/head copies and {ck['scale_elements']:,} scale elements")
    p = memory_plan(cfg, context_len, batch)
    a(f"weights      {_gib(p['weights_bytes'])} in checkpoint format; "
      f"{_gib(p['weights_dequantized_bytes'])} dequantised to BF16")
    kv = kv_bytes_per_token(cfg, 2)
    ratio = kv["decompressed"] / kv["latent"]
    a(f"KV cache bytes per token (bf16), per layer and over {kv['layers']} layers (MTP included):")
    a(f"  compressed   latent (kv_lora {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}) x 2 B: "
      f"{kv['latent']:>7,} B per layer, {kv['latent_total']:>12,} B total")
    a(f"  decompressed {cfg.n_heads} heads x (K {cfg.qk_head_dim} + V {cfg.v_head_dim}) x 2 B: "
      f"{kv['decompressed']:>7,} B per layer, {kv['decompressed_total']:>12,} B total  ({ratio:.1f} x)")
    a(f"memory for {batch} x {context_len:,} tokens (bf16 latent KV):")
    a(f"  weights {_gib(p['weights_bytes'])}  +  KV {_gib(p['kv_bytes'])} ({_gib(p['kv_per_seq'])} per sequence)"
      f"  =  {_gib(p['total_bytes'])}")
    a(f"  (decompressed K/V cache for comparison: {_gib(p['kv_decompressed_bytes'])}; activations not included)")
    return "\n".join(L)
