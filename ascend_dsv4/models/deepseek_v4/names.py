"""DeepSeek-V4 tensor name maps: transformers' names <-> official names (README.md §3.1, §3.4) <-> our modules.

Our module tree uses the official names, except that routed experts are stacked per layer
(``layers.i.ffn.experts.w1`` [E, inter, dim] instead of ``layers.i.ffn.experts.e.w1.weight``).
"""

from __future__ import annotations

import re

# transformers (HF-T) suffix -> official suffix, inside "model.layers.i." (applied in order)
_HF_LAYER = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"), ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.experts.gate_up_proj", "ffn.experts.gate_up_proj"),  # fused [E, 2I, d]: split by the loader
    ("mlp.experts.down_proj", "ffn.experts.w2"),  # stacked [E, d, I]
]
_HF_TOP = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(layers\.\d+|mtp\.\d+)\.(?:ffn|mlp)\.experts\.(\d+)\.(w[123])\.weight$")


def is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name == "lm_head.weight"


# transformers' save_pretrained reverses its load-time renames lossily: the attention's `kv_norm` comes out
# as `attn.norm` (and the top level keeps its module names). These fix-ups undo that.
_SAVED_TOP = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale"}


def hf_to_official(name: str) -> str | None:
    """Official (stacked-expert) name of a transformers tensor name, or None if it has no counterpart.

    Accepts transformers' module names (README.md §3.4, e.g. ``model.layers.0.self_attn.q_a_proj.weight``) and
    what ``save_pretrained`` writes (official names under ``model.``, e.g. ``model.layers.0.attn.wq_a.weight``).
    """
    if name in _HF_TOP:
        return _HF_TOP[name]
    m = _HF_LAYER_RE.match(name)
    if not m:
        rest = name[len("model."):] if name.startswith("model.") else name
        return _SAVED_TOP.get(rest, rest if rest in ("head.weight", "norm.weight") else None)
    for hf, off in _HF_LAYER:
        if m.group(2) == hf:
            return f"layers.{m.group(1)}.{off}"
    rest = "attn.kv_norm.weight" if m.group(2) == "attn.norm.weight" else m.group(2)
    return f"layers.{m.group(1)}.{rest}"


def official_to_hf(name: str) -> str | None:
    for hf, off in _HF_TOP.items():
        if name == off:
            return hf
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m:
        return None
    for hf, off in _HF_LAYER:
        if m.group(2) == off:
            return f"model.layers.{m.group(1)}.{hf}"
    return None


def expert_key(name: str) -> tuple[str, int, str] | None:
    """``layers.3.ffn.experts.17.w1.weight`` -> ("layers.3.ffn.experts", 17, "w1")."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    return (name[: name.index(".experts.") + len(".experts")], int(m.group(2)), m.group(3))


# DeepSeek's HF layout of per-expert weights (V3 style, also what our HF-format writer uses for quantised experts)
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|scale)$")
_PROJ_TO_W = {"gate": "w1", "up": "w3", "down": "w2"}
_W_TO_PROJ = {v: k for k, v in _PROJ_TO_W.items()}


def canonical_name(name: str) -> str | None:
    """Official name of any supported checkpoint tensor name, with quantisation scales as ``<module>.scale``.

    Handles official names (``layers.i.*``, ``mtp.j.*``), transformers module names, what transformers'
    ``save_pretrained`` writes, DeepSeek's HF per-expert names (``mlp.experts.e.gate_proj``) and HF FP8 scales
    (``weight_scale_inv``). Returns None for names that map to nothing. The fused transformers expert tensors
    come back as ``layers.i.ffn.experts.gate_up_proj`` / ``layers.i.ffn.experts.w2`` (stacked).
    """
    m = _HF_EXPERT_RE.match(name)
    if m:
        suffix = "weight" if m.group(4) == "weight" else "scale"
        return f"layers.{m.group(1)}.ffn.experts.{m.group(2)}.{_PROJ_TO_W[m.group(3)]}.{suffix}"
    # hyper-connection `scale` parameters are not quantisation scales
    is_scale = name.endswith((".weight_scale_inv", ".scale")) and not name.endswith(("attn_hc.scale", "ffn_hc.scale"))
    base = name
    if name.endswith(".weight_scale_inv"):
        base = name[: -len("_scale_inv")]
    elif is_scale:
        base = name[: -len(".scale")] + ".weight"
    off = hf_to_official(base) if is_hf_name(base) else base
    if off is None:
        return None
    return off[: -len(".weight")] + ".scale" if is_scale else off


def hf_writer_name(official: str) -> str:
    """The name our HF-format writer gives an official tensor name (inverse of :func:`canonical_name`).

    Non-expert tensors use transformers' module names (README.md §3.4), FP8 scales become ``weight_scale_inv``,
    routed experts use DeepSeek's per-expert HF names (``model.layers.i.mlp.experts.e.gate_proj.weight``),
    MTP tensors keep their official names (transformers ignores ``mtp.*``).
    """
    if official.startswith("mtp."):
        return official
    ek = expert_key(official.replace(".scale", ".weight"))
    if ek is not None:
        layer = ek[0].split(".")[1]
        suffix = "weight_scale_inv" if official.endswith(".scale") else "weight"
        return f"model.layers.{layer}.mlp.experts.{ek[1]}.{_W_TO_PROJ[ek[2]]}_proj.{suffix}"
    if official.endswith(".scale") and not official.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
        hf = official_to_hf(official[: -len(".scale")] + ".weight")
        return None if hf is None else hf + "_scale_inv"
    return official_to_hf(official)


def checkpoint_name(ours: str, n_layers: int) -> str:
    """Official checkpoint name of one of our parameter / module names: the same (our modules use official
    names; only routed experts are stacked, see :func:`expert_checkpoint_name`)."""
    return ours


def expert_checkpoint_name(module: str, e: int, w: str, n_layers: int) -> str:
    """Official name (no ``.weight``) of expert ``e``'s ``w`` (w1 / w2 / w3) of the stacked ``module``."""
    return f"{module}.{e}.{w}"


# linears (official names without ``.weight``) the msModelSlim DeepSeek-V4 recipe for Ascend A3 quantises
# (wq_b, the indexer's wq_b, wo_b, shared experts), and the routed-expert linears
QUANT_LINEAR_RE = re.compile(r"^(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_b|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])$")
ROUTED_EXPERT_RE = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]$")
