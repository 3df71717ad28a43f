"""Model configuration of DeepSeek-V4.

:class:`DeepseekV4Config` uses the official inference ``ModelArgs`` field names (README.md §1.1). It is read from

* the official inference ``config.json`` (keys ``dim``, ``n_layers``, ...),
* a Hugging Face ``config.json`` (keys ``hidden_size``, ``num_hidden_layers``, ...; both the published
  DeepSeek files with ``compress_ratios`` and what ``transformers`` writes, with ``layer_types``),
* a built-in preset name (``toy-v4`` = README.md §5.1, ``deepseek-v4-flash``, ``deepseek-v4-pro``).

Every config is validated against the rules of README.md §5.2; a broken one raises :class:`ConfigError`
naming the field and the rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError

LAYER_TYPE_TO_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
RATIO_TO_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_TO_RATIO.items()}


@dataclass(frozen=True)
class DeepseekV4Config:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 2048
    n_layers: int = 43
    n_mtp_layers: int = 1
    n_hash_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = ()
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    # checkpoint formats: "fp8" (128x128 blocks, ue8m0 scales) or "bf16"; experts "fp4" | "fp8" | None
    dtype: str = "fp8"
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str | None = "fp4"
    bos_token_id: int = 0
    eos_token_id: int = 1
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of backbone layer ``layer_id`` (0 = SWA only); MTP layers are ``n_layers + k``."""
        return self.compress_ratios[layer_id]

    def layer_kind(self, layer_id: int) -> str:
        return {0: "swa", 4: "csa", 128: "hca"}[self.compress_ratios[layer_id]]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers

    def layers_of_kind(self, kind: str) -> list[int]:
        """Backbone layer ids of one kind ('swa' | 'csa' | 'hca'), MTP layers excluded."""
        return [i for i in range(self.n_layers) if self.layer_kind(i) == kind]

    def replace(self, **changes: Any) -> "DeepseekV4Config":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def dense(self) -> "DeepseekV4Config":
        """This config with BF16 weights and experts (what a dequantised model holds)."""
        return self.replace(dtype="bf16", expert_dtype=None, scale_fmt=None)

    def with_layers(self, n_layers: int | None) -> "DeepseekV4Config":
        """This config cut to its first ``n_layers`` backbone layers (MTP kept, hash layers clipped)."""
        if n_layers is None or n_layers == self.n_layers:
            return self
        ratios = self.compress_ratios[:n_layers] + self.compress_ratios[self.n_layers:]
        return self.replace(n_layers=n_layers, compress_ratios=ratios, n_hash_layers=min(self.n_hash_layers, n_layers),
                            name=f"{self.name}-{n_layers}l")

    def to_official_dict(self) -> dict:
        """The official inference ``config.json`` (``ModelArgs`` keys; :func:`from_official_dict` reads it)."""
        return {k: v for k, v in self.to_dict().items() if k != "name"}

    def to_hf_dict(self) -> dict:
        """DeepSeek's Hugging Face ``config.json`` for this config (:func:`from_hf_dict` reads it back)."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": self.vocab_size,
            "hidden_size": self.dim, "moe_intermediate_size": self.moe_inter_dim, "num_hidden_layers": self.n_layers,
            "num_nextn_predict_layers": self.n_mtp_layers, "num_hash_layers": self.n_hash_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size, "compress_ratios": list(self.compress_ratios),
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts, "scoring_func": self.score_func, "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "tie_word_embeddings": False,
            "rope_scaling": {"type": "yarn", "factor": self.rope_factor, "original_max_position_embeddings": self.original_seq_len,
                             "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
        }
        if self.dtype == "fp8":
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128], "scale_fmt": self.scale_fmt or "ue8m0"}
            if self.expert_dtype:
                d["quantization_config"]["expert_dtype"] = self.expert_dtype
        return d

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    # ---- validation (README.md §5.2) ------------------------------------------------------------------
    def validate(self) -> "DeepseekV4Config":
        def bad(fld: str, rule: str) -> None:
            src = f" ({self.name})" if self.name else ""
            raise ConfigError(f"config{src}: field '{fld}' = {getattr(self, fld, '?')!r} breaks the rule: {rule}")

        if self.model_type != "deepseek_v4":
            bad("model_type", "must be 'deepseek_v4' for this model class")
        positive = ["vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "rope_head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                    "index_topk", "n_routed_experts", "n_activated_experts", "hc_mult", "hc_sinkhorn_iters",
                    "max_position_embeddings"]
        for f in positive:
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        for f in ("n_mtp_layers", "n_hash_layers", "n_shared_experts"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                bad(f, "must be a non-negative integer")
        for f in ("dim", "q_lora_rank", "moe_inter_dim"):
            if getattr(self, f) % 128:
                bad(f, "must be a multiple of 128 (FP8 activation blocks along K)")
        if (self.o_groups * self.o_lora_rank) % 128:
            bad("o_lora_rank", "o_groups * o_lora_rank must be a multiple of 128")
        if self.rope_head_dim % 2:
            bad("rope_head_dim", "must be even (interleaved RoPE pairs)")
        if self.rope_head_dim >= self.head_dim or (self.head_dim - self.rope_head_dim) % 64:
            bad("head_dim", "head_dim - rope_head_dim must be a positive multiple of 64 (KV FP8 blocks)")
        ihd = self.index_head_dim
        if ihd & (ihd - 1) or ihd % 32 or ihd <= self.rope_head_dim:
            bad("index_head_dim", "must be a power of two, a multiple of 32 and larger than rope_head_dim")
        if (self.n_heads * self.head_dim) % self.o_groups:
            bad("o_groups", "n_heads * head_dim must be divisible by o_groups")
        n_total = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_total:
            bad("compress_ratios", f"needs n_layers + n_mtp_layers = {n_total} entries, got {len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios):
            if r not in (0, 4, 128):
                bad("compress_ratios", f"entry {i} is {r}; every ratio must be 0, 4 or 128")
        if any(r != 0 for r in self.compress_ratios[self.n_layers:]):
            bad("compress_ratios", "MTP entries (after the first n_layers) must be 0")
        if self.n_hash_layers > self.n_layers:
            bad("n_hash_layers", "must be <= n_layers")
        if self.n_activated_experts > self.n_routed_experts:
            bad("n_activated_experts", "must be <= n_routed_experts")
        if self.score_func != "sqrtsoftplus":
            bad("score_func", "DeepSeek-V4 routes with 'sqrtsoftplus'")
        if self.n_shared_experts > 1:
            bad("n_shared_experts", "DeepSeek-V4 has at most one shared expert")
        if self.dtype not in ("fp8", "bf16"):
            bad("dtype", "must be 'fp8' or 'bf16'")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            bad("expert_dtype", "must be 'fp4', 'fp8', 'bf16' or null")
        for f in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, f) < self.vocab_size:
                bad(f, f"must be a token id in [0, vocab_size = {self.vocab_size})")
        # values that would make the math non-finite (NaN logits, or math domain errors while building RoPE)
        for f in ("norm_eps", "hc_eps"):
            if not getattr(self, f) > 0:
                bad(f, "must be > 0 (it keeps a division finite)")
        for f in ("rope_theta", "compress_rope_theta"):
            if not getattr(self, f) > 1:
                bad(f, "must be a RoPE base > 1")
        if not self.rope_factor > 0:
            bad("rope_factor", "must be > 0 (YaRN divides the rotary frequencies by it)")
        if self.original_seq_len < 0:
            bad("original_seq_len", "must be >= 0 (0: no YaRN)")
        for f in ("beta_fast", "beta_slow"):
            if not getattr(self, f) > 0:
                bad(f, "must be > 0 (YaRN takes its logarithm)")
        if self.beta_fast < self.beta_slow:
            bad("beta_fast", f"must be >= beta_slow = {self.beta_slow!r} (YaRN's ramp runs from beta_fast to "
                             f"beta_slow rotations)")
        return self


# ---- presets ---------------------------------------------------------------------------------------

def _flash() -> DeepseekV4Config:
    return DeepseekV4Config(name="deepseek-v4-flash", compress_ratios=tuple([0, 0] + [4, 128] * 20 + [4] + [0]))


def _pro() -> DeepseekV4Config:
    return DeepseekV4Config(
        name="deepseek-v4-pro", dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16,
        moe_inter_dim=3072, n_routed_experts=384, route_scale=2.5, index_topk=1024,
        compress_ratios=tuple([128, 128] + [4, 128] * 29 + [4] + [0]),
    )


def _toy() -> DeepseekV4Config:
    # README.md §5.1: all three layer kinds, hash layers, MTP, 4 HC streams, an indexer whose top-k is smaller
    # than the number of compressed entries of a few-hundred-token prompt.
    return DeepseekV4Config(
        name="toy-v4", vocab_size=1024, dim=256, moe_inter_dim=128, n_layers=7, n_mtp_layers=1, n_hash_layers=3,
        n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=32,
        compress_ratios=(0, 0, 4, 128, 4, 128, 4, 0), index_n_heads=4, index_head_dim=128, index_topk=16,
        n_routed_experts=16, n_shared_experts=1, n_activated_experts=2, max_position_embeddings=4096,
    )


PRESETS = {"toy-v4": _toy, "deepseek-v4-flash": _flash, "deepseek-v4-pro": _pro}


# ---- parsing ---------------------------------------------------------------------------------------

_OFFICIAL_KEYS = {f.name for f in dataclasses.fields(DeepseekV4Config)} - {"name", "extra", "model_type"}


def _num(d: dict, key: str, kind: type, where: str):
    v = d[key]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or (kind is int and v != int(v))):
        raise ConfigError(f"{where}: field '{key}' must be a{'n integer' if kind is int else ' number'}, got {v!r}")
    return kind(v)


def _coerce(kw: dict, where: str) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(DeepseekV4Config)}
    out = {}
    for k, v in kw.items():
        t = types[k]
        if t == "int":
            out[k] = _num(kw, k, int, where)
        elif t == "float":
            out[k] = _num(kw, k, float, where)
        elif k == "compress_ratios":
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ConfigError(f"{where}: field 'compress_ratios' must be a list of integers, got {v!r}")
            out[k] = tuple(v)
        else:
            out[k] = v
    return out


# Fields that size the model: a config without one of them is refused (naming it) instead of taking the
# Flash value from the config's defaults.
OFFICIAL_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "moe_inter_dim", "n_routed_experts",
                     "n_activated_experts")
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
               "n_routed_experts", "num_experts_per_tok")


def _require(d: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if d.get(f) is None]
    if missing:
        raise ConfigError(f"{where}: required field(s) {', '.join(repr(f) for f in missing)} missing "
                          f"(they size the model: no default applies)")


def from_official_dict(d: dict, where: str = "config.json") -> DeepseekV4Config:
    """Parse the official inference ``config.json`` (``ModelArgs`` keys)."""
    if d.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"{where}: field 'model_type' is {d.get('model_type')!r}; this loader reads 'deepseek_v4'")
    kw = {k: v for k, v in d.items() if k in _OFFICIAL_KEYS}
    _require(d, OFFICIAL_REQUIRED, where)
    if "compress_ratios" not in kw:
        raise ConfigError(f"{where}: field 'compress_ratios' is missing")
    kw = _coerce(kw, where)
    if "n_mtp_layers" not in kw:
        kw["n_mtp_layers"] = len(kw["compress_ratios"]) - kw.get("n_layers", DeepseekV4Config.n_layers)
    extra = {k: v for k, v in d.items() if k not in _OFFICIAL_KEYS}
    return DeepseekV4Config(name=where, extra=extra, **kw).validate()


_HF_MAP = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_nextn_predict_layers": "n_mtp_layers", "num_hash_layers": "n_hash_layers",
    "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta",
    "max_position_embeddings": "max_position_embeddings", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}


def from_hf_dict(d: dict, where: str = "config.json") -> DeepseekV4Config:
    """Parse a Hugging Face ``config.json`` (DeepSeek's published file or one written by transformers)."""
    if d.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"{where}: field 'model_type' is {d.get('model_type')!r}; this loader reads 'deepseek_v4'")
    _require(d, HF_REQUIRED, where)
    kw = {ours: d[hf] for hf, ours in _HF_MAP.items() if hf in d and d[hf] is not None}
    if isinstance(kw.get("eos_token_id"), list) and kw["eos_token_id"]:
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw = _coerce(kw, where)
    n_layers = kw.get("n_layers", DeepseekV4Config.n_layers)
    n_mtp = kw.get("n_mtp_layers", 1)
    if "rope_head_dim" not in kw and d.get("partial_rotary_factor"):
        kw["rope_head_dim"] = int(kw.get("head_dim", 512) * d["partial_rotary_factor"])
    if "compress_ratios" in d:
        ratios = list(d["compress_ratios"])
    elif "layer_types" in d:
        try:
            rates = {**LAYER_TYPE_TO_RATIO, **(d.get("compress_rates") or {})}
            ratios = [rates[t] if LAYER_TYPE_TO_RATIO[t] else 0 for t in d["layer_types"]]  # compress_rates wins
        except KeyError as e:
            raise ConfigError(f"{where}: field 'layer_types' has unknown entry {e.args[0]!r}; "
                              f"expected one of {sorted(LAYER_TYPE_TO_RATIO)}") from None
    else:
        raise ConfigError(f"{where}: neither 'compress_ratios' nor 'layer_types' is present")
    if len(ratios) == n_layers:  # transformers' layer_types lists backbone layers only; MTP layers are SWA
        ratios += [0] * n_mtp
    kw["compress_ratios"] = ratios
    if "n_hash_layers" not in kw and "mlp_layer_types" in d:
        kinds = list(d["mlp_layer_types"])
        kw["n_hash_layers"] = sum(1 for t in kinds if t == "hash_moe")
        if any(t != "hash_moe" for t in kinds[:kw["n_hash_layers"]]):
            raise ConfigError(f"{where}: field 'mlp_layer_types' must list its 'hash_moe' layers first "
                              f"(hash routing covers layers 0 .. num_hash_layers-1)")
    rope = d.get("rope_scaling") or {}
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("compress"), dict):
        rope = rp["compress"]
        kw.setdefault("compress_rope_theta", rope.get("rope_theta", DeepseekV4Config.compress_rope_theta))
        if isinstance(rp.get("main"), dict) and "rope_theta" in rp["main"]:
            kw["rope_theta"] = rp["main"]["rope_theta"]
    if rope and rope.get("rope_type", rope.get("type")) == "yarn":
        kw["rope_factor"] = rope.get("factor", DeepseekV4Config.rope_factor)
        kw["original_seq_len"] = rope.get("original_max_position_embeddings", DeepseekV4Config.original_seq_len)
        kw["beta_fast"] = rope.get("beta_fast", DeepseekV4Config.beta_fast)
        kw["beta_slow"] = rope.get("beta_slow", DeepseekV4Config.beta_slow)
    elif rope or rp:
        kw["original_seq_len"] = 0  # no YaRN
    q = d.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        kw["dtype"] = "fp8"
        kw["scale_fmt"] = q.get("scale_fmt", "ue8m0")
        kw["expert_dtype"] = q.get("expert_dtype", d.get("expert_dtype", "fp8"))
    else:
        kw["dtype"], kw["scale_fmt"] = "bf16", None
        kw["expert_dtype"] = d.get("expert_dtype") if q else None
    kw = _coerce(kw, where)
    extra = {k: v for k, v in d.items() if k not in _HF_MAP}
    return DeepseekV4Config(name=where, extra=extra, **kw).validate()
