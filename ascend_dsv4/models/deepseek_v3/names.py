"""DeepSeek-V3 tensor name maps: DeepSeek's Hugging Face checkpoint names <-> our module names.

Our modules use the HF names without ``model.``; the MTP module (checkpoint layer ``num_hidden_layers + k``) is
``mtp.k``; routed experts are stacked per layer (``layers.i.mlp.experts.w1`` [E, inter, dim]).
"""

from __future__ import annotations

import re

_PROJ_TO_W = {"gate": "w1", "up": "w3", "down": "w2"}
_W_TO_PROJ = {v: k for k, v in _PROJ_TO_W.items()}
_V3_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_V3_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|scale)$")


def canonical_name(name: str, n_layers: int) -> str | None:
    """Our DeepSeek-V3 module name of a Hugging Face V3 checkpoint tensor ("" = a duplicate to ignore).

    ``model.`` is dropped; layer ``n_layers + k`` (the MTP module) becomes ``mtp.k``, whose stored copies of
    the embedding and head (``embed_tokens``, ``shared_head.head``) are ignored; per-expert
    ``mlp.experts.e.{gate,up,down}_proj`` become ``mlp.experts.e.{w1,w3,w2}``; ``weight_scale_inv`` -> ``scale``.
    """
    if name == "lm_head.weight":
        return name
    m = _V3_LAYER_RE.match(name)
    if not m:
        rest = name[len("model."):] if name.startswith("model.") else name
        return rest if rest in ("embed_tokens.weight", "norm.weight") else None
    lid, rest = int(m.group(1)), m.group(2)
    prefix = f"layers.{lid}" if lid < n_layers else f"mtp.{lid - n_layers}"
    if lid >= n_layers and rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return ""
    e = _V3_EXPERT_RE.match(rest)
    if e:
        suffix = "weight" if e.group(3) == "weight" else "scale"
        return f"{prefix}.mlp.experts.{e.group(1)}.{_PROJ_TO_W[e.group(2)]}.{suffix}"
    if rest == "mlp.experts.down_proj":
        return f"{prefix}.mlp.experts.w2"  # transformers' fused layout
    if rest.endswith(".weight_scale_inv"):
        rest = rest[: -len(".weight_scale_inv")] + ".scale"
    return f"{prefix}.{rest}"


def checkpoint_name(ours: str, n_layers: int) -> str:
    """DeepSeek's HF checkpoint name of one of our (non-stacked) parameter / module names (inverse of
    :func:`canonical_name`): ``mtp.k.*`` -> ``model.layers.{n_layers + k}.*``, ``lm_head`` kept, else ``model.``."""
    if ours == "lm_head" or ours.startswith("lm_head."):
        return ours
    if ours.startswith("mtp."):
        k, _, rest = ours[len("mtp."):].partition(".")
        return f"model.layers.{n_layers + int(k)}" + (f".{rest}" if rest else "")
    return "model." + ours


def expert_checkpoint_name(module: str, e: int, w: str, n_layers: int) -> str:
    """HF name (no ``.weight``) of expert ``e``'s ``w`` (w1 / w2 / w3) of the stacked ``module``
    (``mlp.experts.e.{gate,down,up}_proj``)."""
    return checkpoint_name(f"{module}.{e}.{_W_TO_PROJ[w]}_proj", n_layers)


def stored_copies(n_layers: int, n_mtp_layers: int) -> list[tuple[str, str]]:
    """(checkpoint name, our parameter) of the tensors DeepSeek's HF checkpoints store twice: every MTP layer's
    copy of the embedding and of the head."""
    out = []
    for k in range(n_mtp_layers):
        out += [(f"model.layers.{n_layers + k}.embed_tokens.weight", "embed_tokens.weight"),
                (f"model.layers.{n_layers + k}.shared_head.head.weight", "lm_head.weight")]
    return out


# linears (HF names without ``.weight``) msModelSlim's DeepSeek recipe quantises, and the routed-expert linears
QUANT_LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn\.(?:q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|o_proj)"
                             r"|mlp\.(?:gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj))$")
ROUTED_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj$")
