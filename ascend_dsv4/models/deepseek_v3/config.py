"""Model configuration for the DeepSeek-V3 family (V3, V3-0324, V3.1, R1; V2-Lite-style ``q_lora_rank = 0`` too).

:class:`DeepseekV3Config` uses the official DeepSeek-V3 inference ``ModelArgs`` field names (``dim``, ``inter_dim``,
``n_dense_layers``, ``n_expert_groups``, ...) plus the few fields the official file leaves implicit
(``n_mtp_layers``, ``norm_topk_prob``, ``norm_eps``, ``mscale_all_dim``, ``max_position_embeddings``, token ids).
It is read from

* DeepSeek's published Hugging Face ``config.json`` (``hidden_size``, ``first_k_dense_replace``, ``n_group``,
  ``rope_scaling = {"type": "yarn", ...}``, ``quantization_config = {"quant_method": "fp8", ...}``) and from what
  ``transformers.DeepseekV3Config(...).to_dict()`` writes (``rope_parameters = {"rope_type": "yarn", ...}``,
  ``q_lora_rank = None`` for no query compression): :func:`from_hf_dict`;
* the official inference config (``inference/configs/config_671B.json``, ``ModelArgs`` keys):
  :func:`from_official_dict`;
* a preset: ``toy-v3`` (CPU test model) and ``deepseek-v3`` (the published V3 / R1 / V3.1 shapes).

YaRN scaling, exactly as transformers does it (``modeling_rope_utils._compute_yarn_parameters`` and
``modeling_deepseek_v3.yarn_apply_mscale``), with ``g(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1`` else ``1``:

* :attr:`DeepseekV3Config.softmax_scale` = ``qk_head_dim ** -0.5 * g(rope_factor, mscale_all_dim) ** 2`` when YaRN
  is on (``rope_factor > 1``) and ``mscale_all_dim != 0``, else ``qk_head_dim ** -0.5``. (The official inference
  code uses ``g(rope_factor, mscale) ** 2``: :func:`from_official_dict` therefore sets ``mscale_all_dim =
  mscale``.)
* :attr:`DeepseekV3Config.rope_attention_factor` (transformers' ``attention_factor``, multiplied into cos and sin):
  ``1.0`` without YaRN; with YaRN ``g(f, mscale) / g(f, mscale_all_dim)`` when *both* ``mscale`` and
  ``mscale_all_dim`` are non-zero, else ``g(f, 1)``. For V3 (``mscale = mscale_all_dim = 1``) it is exactly 1.0,
  matching the official code, which never scales cos/sin.

Every config is validated; a broken one raises :class:`~ascend_dsv4.errors.ConfigError` naming the field and the
rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' / DeepSeek's ``yarn_get_mscale``: ``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekV3Config:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    dim: int = 7168                     # HF hidden_size
    inter_dim: int = 18432              # HF intermediate_size: dense MLP width (layers < n_dense_layers)
    moe_inter_dim: int = 2048           # HF moe_intermediate_size: width of one routed / shared expert
    n_layers: int = 61                  # HF num_hidden_layers
    n_mtp_layers: int = 1               # HF num_nextn_predict_layers; MTP layer ids are n_layers + k
    n_dense_layers: int = 3             # HF first_k_dense_replace
    n_heads: int = 128
    q_lora_rank: int = 1536             # 0 = no query compression (a plain q_proj, as in V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8        # HF num_experts_per_tok
    n_expert_groups: int = 8            # HF n_group
    n_limited_groups: int = 4           # HF topk_group
    score_func: str = "sigmoid"         # HF scoring_func
    route_scale: float = 2.5            # HF routed_scaling_factor
    norm_topk_prob: bool = True
    norm_eps: float = 1e-6              # HF rms_norm_eps
    rope_theta: float = 10000.0
    rope_factor: float = 40.0           # YaRN factor; 1.0 = no YaRN
    original_seq_len: int = 4096        # YaRN original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    max_position_embeddings: int = 163840
    dtype: str = "fp8"                  # checkpoint format: "fp8" (e4m3, 128x128 blocks, F32 scale_inv) | "bf16"
    bos_token_id: int = 0
    eos_token_id: int = 1
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        """Whether YaRN scaling is on (``rope_factor > 1``)."""
        return self.rope_factor > 1

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``g(rope_factor, mscale_all_dim) ** 2`` under YaRN with
        ``mscale_all_dim != 0`` (transformers' ``yarn_apply_mscale``). V3: 192**-0.5 * 1.3689**2 = 0.13523."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn and self.mscale_all_dim:
            m = yarn_get_mscale(self.rope_factor, self.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """transformers' YaRN ``attention_factor`` (cos and sin are multiplied by it): 1.0 without YaRN; else
        ``g(f, mscale) / g(f, mscale_all_dim)`` if both are non-zero, else ``g(f, 1)``. 1.0 for V3."""
        if not self.yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.rope_factor, self.mscale) / yarn_get_mscale(self.rope_factor,
                                                                                     self.mscale_all_dim)
        return yarn_get_mscale(self.rope_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers ``0 .. n_dense_layers-1`` have a dense MLP; all later ones (MTP layers included) are MoE."""
        return layer_id >= self.n_dense_layers

    @property
    def dense_layers(self) -> list[int]:
        return list(range(min(self.n_dense_layers, self.n_layers)))

    @property
    def moe_layers(self) -> list[int]:
        """Backbone MoE layer ids (MTP layers excluded)."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    def replace(self, **changes: Any) -> "DeepseekV3Config":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        """All fields but ``extra`` (these are ``ModelArgs`` names: :func:`from_official_dict` reads it back)."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d

    def to_official_dict(self) -> dict:
        """The official inference ``config.json`` (``ModelArgs`` keys only). Reading it back gives
        ``n_mtp_layers = 0`` (the official converter drops the MTP layer) and ``mscale_all_dim = mscale``."""
        return {k: getattr(self, k) for k in _MODEL_ARGS}

    def dense(self) -> "DeepseekV3Config":
        """This config with BF16 weights (what a dequantised model holds)."""
        return self.replace(dtype="bf16")

    def with_layers(self, n_layers: int | None) -> "DeepseekV3Config":
        """This config cut to its first ``n_layers`` backbone layers (MTP kept, dense layers clipped)."""
        if n_layers is None or n_layers == self.n_layers:
            return self
        return self.replace(n_layers=n_layers, n_dense_layers=min(self.n_dense_layers, n_layers),
                            name=f"{self.name}-{n_layers}l")

    def to_hf_dict(self) -> dict:
        """DeepSeek's published Hugging Face ``config.json`` for this config (``rope_scaling`` / quantization style)."""
        d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        d.update({hf: getattr(self, ours) for hf, ours in _HF_MAP.items()})
        d["q_lora_rank"] = self.q_lora_rank or None
        d["num_key_value_heads"] = self.n_heads
        d.update(hidden_act="silu", topk_method="noaux_tc", moe_layer_freq=1, tie_word_embeddings=False,
                 attention_bias=False, torch_dtype="bfloat16")
        if self.yarn:
            d["rope_scaling"] = {"type": "yarn", "factor": self.rope_factor,
                                 "original_max_position_embeddings": self.original_seq_len,
                                 "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
                                 "mscale_all_dim": self.mscale_all_dim}
        else:
            d["rope_scaling"] = None
        if self.dtype == "fp8":
            d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]}
        return d

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> "DeepseekV3Config":
        def bad(fld: str, rule: str) -> None:
            src = f" ({self.name})" if self.name else ""
            raise ConfigError(f"config{src}: field '{fld}' = {getattr(self, fld, '?')!r} breaks the rule: {rule}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if self.model_type != "deepseek_v3":
            bad("model_type", "must be 'deepseek_v3' for this model class")
        for f in ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_activated_experts",
                  "n_expert_groups", "n_limited_groups", "original_seq_len", "max_position_embeddings"):
            if not is_int(getattr(self, f)) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        for f in ("n_mtp_layers", "n_dense_layers", "n_shared_experts", "q_lora_rank", "bos_token_id",
                  "eos_token_id"):
            if not is_int(getattr(self, f)) or getattr(self, f) < 0:
                bad(f, "must be a non-negative integer")
        for f in ("route_scale", "norm_eps", "rope_theta", "beta_fast", "beta_slow"):
            if not is_num(getattr(self, f)) or getattr(self, f) <= 0:
                bad(f, "must be a finite number > 0")
        for f in ("mscale", "mscale_all_dim"):
            if not is_num(getattr(self, f)) or getattr(self, f) < 0:
                bad(f, "must be a finite number >= 0")
        if not is_num(self.rope_factor) or self.rope_factor < 1:
            bad("rope_factor", "must be a finite number >= 1 (1.0 = no YaRN)")
        if self.rope_theta <= 1:
            bad("rope_theta", "must be a RoPE base > 1")
        if self.beta_fast < self.beta_slow:
            bad("beta_fast", f"must be >= beta_slow = {self.beta_slow!r} (YaRN's ramp runs from beta_fast to "
                             f"beta_slow rotations)")
        if not isinstance(self.norm_topk_prob, bool):
            bad("norm_topk_prob", "must be true or false")
        if self.n_routed_experts % self.n_expert_groups:
            bad("n_expert_groups", "n_routed_experts must be divisible by n_expert_groups")
        if self.n_limited_groups > self.n_expert_groups:
            bad("n_limited_groups", "must be <= n_expert_groups (topk_group <= n_group)")
        if self.n_activated_experts > self.n_routed_experts:
            bad("n_activated_experts", "must be <= n_routed_experts")
        if self.n_activated_experts > self.n_limited_groups * self.experts_per_group:
            bad("n_activated_experts", "must be <= n_limited_groups * (n_routed_experts / n_expert_groups): "
                                       "the top-k experts are picked from the selected groups only")
        if self.n_dense_layers > self.n_layers:
            bad("n_dense_layers", "must be <= n_layers (first_k_dense_replace <= num_hidden_layers)")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        if self.score_func != "sigmoid":
            bad("score_func", "DeepSeek-V3 routes with 'sigmoid' scores")
        if self.dtype not in ("fp8", "bf16"):
            bad("dtype", "must be 'fp8' or 'bf16'")
        if self.bos_token_id >= self.vocab_size:
            bad("bos_token_id", "must be < vocab_size")
        if self.eos_token_id >= self.vocab_size:
            bad("eos_token_id", "must be < vocab_size")
        return self


# ---- presets ---------------------------------------------------------------------------------------

def _toy() -> DeepseekV3Config:
    # CPU test model: dense + MoE layers, group-limited routing (4 groups, 2 kept), MTP, q compression,
    # YaRN (factor 4) with mscale = mscale_all_dim = 1 so the softmax mscale path is exercised.
    return DeepseekV3Config(
        name="toy-v3", vocab_size=1024, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=4, n_mtp_layers=1,
        n_dense_layers=1, n_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=16, n_shared_experts=1, n_activated_experts=3, n_expert_groups=4,
        n_limited_groups=2, score_func="sigmoid", route_scale=2.5, norm_topk_prob=True, rope_theta=10000.0,
        rope_factor=4.0, original_seq_len=1024, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        max_position_embeddings=4096, dtype="fp8", bos_token_id=0, eos_token_id=1,
    )


def _v3() -> DeepseekV3Config:
    # The published DeepSeek-V3 / R1 / V3.1 shapes (HF config.json of deepseek-ai/DeepSeek-V3).
    return DeepseekV3Config(
        name="deepseek-v3", vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61,
        n_mtp_layers=1, n_dense_layers=3, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
        n_expert_groups=8, n_limited_groups=4, score_func="sigmoid", route_scale=2.5, norm_topk_prob=True,
        norm_eps=1e-6, rope_theta=10000.0, rope_factor=40.0, original_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0, max_position_embeddings=163840, dtype="fp8", bos_token_id=0, eos_token_id=1,
    )


PRESETS = {"toy-v3": _toy, "deepseek-v3": _v3}


# ---- parsing ---------------------------------------------------------------------------------------

_TYPES = {f.name: f.type for f in dataclasses.fields(DeepseekV3Config)}
_FIELDS = set(_TYPES) - {"name", "extra", "model_type"}


def _coerce_one(v: Any, ours: str, src: str, where: str) -> Any:
    """Type-check one value destined for field ``ours`` (read from key ``src``); ints and floats must be finite
    JSON numbers (not bools, not strings), integers integral; ``norm_topk_prob`` a bool; strings strings."""
    t = _TYPES[ours]
    label = f"'{src}'" if src == ours else f"'{src}' (-> {ours})"
    if t in ("int", "float"):
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or (t == "int" and v != int(v))):
            raise ConfigError(f"{where}: field {label} must be a{'n integer' if t == 'int' else ' number'}, "
                              f"got {v!r}")
        return int(v) if t == "int" else float(v)
    if t == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: field {label} must be true or false, got {v!r}")
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{where}: field {label} must be a string, got {v!r}")
    return v


# ModelArgs of the official DeepSeek-V3 inference code (inference/model.py) and their defaults, used for keys
# the official config.json leaves out (config_671B.json holds no YaRN keys: they default to V3's values).
_MODEL_ARGS = {
    "dtype": "bf16", "vocab_size": 102400, "dim": 2048, "inter_dim": 10944, "moe_inter_dim": 1408, "n_layers": 27,
    "n_dense_layers": 1, "n_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "n_activated_experts": 6,
    "n_expert_groups": 1, "n_limited_groups": 1, "score_func": "softmax", "route_scale": 1.0, "q_lora_rank": 0,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "original_seq_len": 4096, "rope_theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0,
}


def from_official_dict(d: dict, where: str = "config.json") -> DeepseekV3Config:
    """Parse the official DeepSeek-V3 inference config (``ModelArgs`` keys; any other field of
    :class:`DeepseekV3Config` is read too, so ``cfg.to_dict()`` round-trips).

    Keys the file leaves out take the ``ModelArgs`` defaults (so ``config_671B.json``, which has no YaRN keys, gets
    V3's YaRN). Fields ``ModelArgs`` lacks: ``n_mtp_layers`` 0 (``convert.py`` drops ``model.layers.61``),
    ``norm_topk_prob`` true (the official gate always renormalises sigmoid weights), ``norm_eps`` 1e-6,
    ``mscale_all_dim`` = ``mscale`` (the official softmax scale uses ``mscale``; cos/sin are never scaled),
    ``max_position_embeddings`` = ``original_seq_len * rope_factor`` (``original_seq_len`` without YaRN),
    ``bos_token_id`` 0, ``eos_token_id`` 1. Other keys (``max_seq_len``, ``max_batch_size``, ...) go to ``extra``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ConfigError(f"{where}: field 'model_type' is {d.get('model_type')!r}; this loader reads 'deepseek_v3'")
    kw = {**_MODEL_ARGS, **{k: v for k, v in d.items() if k in _FIELDS}}
    kw = {k: _coerce_one(v, k, k, where) for k, v in kw.items()}
    kw.setdefault("n_mtp_layers", 0)
    kw.setdefault("mscale_all_dim", kw["mscale"])
    if "max_position_embeddings" not in kw:
        mp = kw["original_seq_len"] * (kw["rope_factor"] if kw["rope_factor"] > 1 else 1)
        kw["max_position_embeddings"] = int(round(mp))
    extra = {k: v for k, v in d.items() if k not in _FIELDS}
    return DeepseekV3Config(name=where, extra=extra, **kw).validate()


# HF config.json key -> our field (DeepSeek's published file and transformers' to_dict()).
_HF_MAP = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "intermediate_size": "inter_dim",
    "moe_intermediate_size": "moe_inter_dim", "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers", "first_k_dense_replace": "n_dense_layers",
    "num_attention_heads": "n_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "n_group": "n_expert_groups", "topk_group": "n_limited_groups",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk_prob",
    "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
}
# null in a transformers-written file means: q_lora_rank -> 0 (plain q_proj), n_group / topk_group -> 1 group,
# first_k_dense_replace -> 0 dense layers.
_HF_NULL = {"q_lora_rank": 0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}
# keys whose value, when present, must be the one this model family uses (what our model implements)
_HF_FIXED = {"hidden_act": ("silu",), "moe_layer_freq": (1,), "topk_method": ("noaux_tc",),
             "tie_word_embeddings": (False,), "attention_bias": (False,)}
_YARN_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
              "mscale_all_dim": "mscale_all_dim"}


def from_hf_dict(d: dict, where: str = "config.json") -> DeepseekV3Config:
    """Parse a Hugging Face ``config.json`` of the V3 family: DeepSeek's published file (``rope_scaling`` with
    ``type: yarn``, ``quantization_config`` fp8 / e4m3 / 128x128 blocks) or what transformers writes
    (``rope_parameters`` with ``rope_type``, ``rope_theta`` inside it, ``q_lora_rank: null``).

    Missing keys take the V3 values except ``num_nextn_predict_layers`` (missing = 0: no MTP weights expected) and
    ``scoring_func`` (sigmoid). Without YaRN, ``rope_factor`` = 1 and ``original_seq_len`` =
    ``max_position_embeddings``; YaRN without ``mscale`` / ``mscale_all_dim`` reads them as 0 (transformers'
    rule). ``dtype`` is "fp8" with an fp8 ``quantization_config`` and "bf16" without one (``torch_dtype`` /
    ``dtype`` are the activation dtype, not the checkpoint format). Unused keys go to ``extra``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ConfigError(f"{where}: field 'model_type' is {d.get('model_type')!r}; this loader reads 'deepseek_v3'")
    for k, allowed in _HF_FIXED.items():
        v = d.get(k)
        if v is not None and (v not in allowed or isinstance(v, bool) != isinstance(allowed[0], bool)):
            raise ConfigError(f"{where}: field '{k}' = {v!r} is not supported; DeepSeek-V3 uses {allowed[0]!r}")
    kw: dict[str, Any] = {}
    for hf, ours in _HF_MAP.items():
        if hf not in d:
            continue
        v = d[hf]
        if v is None:
            if hf not in _HF_NULL:
                continue
            v = _HF_NULL[hf]
        if hf == "eos_token_id" and isinstance(v, list) and v:
            v = v[0]
        kw[ours] = _coerce_one(v, ours, hf, where)
    if "n_mtp_layers" not in kw and d.get("num_mtp_layers") is not None:
        kw["n_mtp_layers"] = _coerce_one(d["num_mtp_layers"], "n_mtp_layers", "num_mtp_layers", where)
    kw.setdefault("n_mtp_layers", 0)

    rope_key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope = d.get(rope_key)
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: field '{rope_key}' must be an object, got {rope!r}")
    if "rope_theta" in rope and rope["rope_theta"] is not None:
        kw["rope_theta"] = _coerce_one(rope["rope_theta"], "rope_theta", f"{rope_key}.rope_theta", where)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        if rope.get("attention_factor") is not None:
            raise ConfigError(f"{where}: field '{rope_key}.attention_factor' is not supported: DeepSeek-V3 derives "
                              f"it from mscale / mscale_all_dim")
        for key, ours in _YARN_KEYS.items():
            v = rope.get(key)
            if v is None:
                if key in ("factor", "original_max_position_embeddings"):
                    raise ConfigError(f"{where}: field '{rope_key}.{key}' is missing (YaRN needs it)")
                v = 0.0 if key.startswith("mscale") else getattr(DeepseekV3Config, ours)
            kw[ours] = _coerce_one(v, ours, f"{rope_key}.{key}", where)
    elif kind in (None, "default"):
        kw["rope_factor"] = 1.0
        kw["original_seq_len"] = kw.get("max_position_embeddings", DeepseekV3Config.max_position_embeddings)
    else:
        raise ConfigError(f"{where}: field '{rope_key}.rope_type' is {kind!r}; DeepSeek-V3 uses 'yarn' or none")

    q = d.get("quantization_config")
    if q is None:
        kw["dtype"] = "bf16"
    elif not isinstance(q, dict) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ConfigError(f"{where}: field 'quantization_config.quant_method' is {method!r}; only 'fp8' "
                          f"(e4m3, 128x128 blocks) or no quantization_config (BF16) is supported")
    else:
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}: field 'quantization_config.fmt' is {q.get('fmt')!r}; expected 'e4m3'")
        if list(q.get("weight_block_size") or [128, 128]) != [128, 128]:
            raise ConfigError(f"{where}: field 'quantization_config.weight_block_size' is "
                              f"{q.get('weight_block_size')!r}; expected [128, 128]")
        kw["dtype"] = "fp8"
    used = set(_HF_MAP) | {"model_type", "rope_scaling", "rope_parameters", "quantization_config", "num_mtp_layers"}
    extra = {k: v for k, v in d.items() if k not in used}
    extra.update({k: d[k] for k in ("rope_scaling", "rope_parameters", "quantization_config") if d.get(k)})
    return DeepseekV3Config(name=where, extra=extra, **kw).validate()
