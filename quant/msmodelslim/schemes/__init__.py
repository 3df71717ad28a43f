"""msModelSlim linears: the tensors of each type (:mod:`.layout`), one small class per scheme computing them
(:mod:`.linear`, :data:`SCHEME_CLASSES`), the activation quantisers (:mod:`.numerics`), norms and KV cache (:mod:`.norms`).

Notation: ``n`` = out_features, ``k`` = in_features, ``M`` = tokens. "float" below means any of
float32 / float16 / bfloat16: v0 writes every scale in the *model* dtype, v1 always float32
(README.md §4), so all three are accepted everywhere a float scale is expected.

Tensors of one linear ``<prefix>`` (keys ``<prefix>.<suffix>``; README.md §4, seed file):

=================  ===========================================================================================
type               tensors
=================  ===========================================================================================
FLOAT              ``weight`` float [n,k]; ``bias`` float [n] (optional)
W8A16 / W4A16      ``weight`` int8 [n,k] (W4A16: int4 values -8..7, unpacked); ``weight_scale`` float [n,1]
                   (per channel) or [n,k/gs] (per group); ``weight_offset`` float, same shape (0 when symmetric,
                   integral otherwise); ``bias`` float [n] optional
W8A8, W8A8S        ``weight`` int8 [n,k]; ``input_scale`` float [1]; ``input_offset`` float (integral) or int8
                   [1]; ``quant_bias`` int32 [n]; ``deq_scale`` int64 [n] (float32 bits, README.md §5) or float32 [n]
                   (bf16 models); optional ``weight_scale``/``weight_offset`` float [n,1] (v0 writes them, v1 does
                   not); ``bias`` float [n] optional and **already folded into quant_bias**
W8A8_MIX           W8A8 plus ``weight_scale`` / ``weight_offset`` [n,1] (required: the per-token prefill path)
W8A8_DYNAMIC       ``weight`` int8 [n,k]; ``weight_scale`` float [n,1] (or [n,k/gs] per group, v1);
                   ``weight_offset`` float same shape (zeros); ``bias`` optional
W4A8_DYNAMIC       per channel (v1, v0 ascendV1): ``weight`` int8 **[n/2,k] packed** two int4 per byte along the
                   output dim (:mod:`.packing`), ``weight_scale`` / ``weight_offset`` float [n,1], ``scale_bias``
                   float [n,1] (q/k/v/gate/up) or [n,16] (o/down); per group (older v0): plus
                   ``weight_scale_second`` float [n,k/gs] and ``weight_offset_second`` int64 [n,k/gs], weight
                   packed [n/2,k] (ascendV1 save, with scale_bias) or **unpacked** int8 [n,k] (safe_tensor save)
C8 (KV cache)      ``<attn>.k_proj.kv_cache_scale`` / ``kv_cache_offset`` and the same for ``v_proj``: float
                   [num_kv_heads*head_dim]; offset 0 when symmetric
anti-outlier norm  ``<norm>.weight`` (smoothed) and ``<norm>.bias`` (FLOAT); v0 also ``<norm>.module.weight`` /
                   ``<norm>.module.bias`` (tagged with the model quant type, not FLOAT; the pair MindIE reads)
=================  ===========================================================================================

Math of the :class:`QuantLinear` schemes (``x`` is cast to float32; the output is cast back to ``x.dtype``):

* **W8A8 static** (W8A8, W8A8S, W8A8_MIX with ``mix_mode="static"``), README.md §6 -- shared by both paths::

      q_x = clamp(round(x / input_scale + input_offset), -128, 127)        # round = half-to-even

  - ``path="int"`` (what ``npu_quantize`` + ``npu_quant_matmul`` compute)::

        acc = q_x @ W_q^T + quant_bias            # exact integer, checked to fit int32
        y   = float32(acc) * deq                  # deq = decoded deq_scale; the FLOAT bias is NOT added

  - ``path="float"`` (msModelSlim's fake-quant, README.md §6 "Float path"; ≤1.8e-7 on fp32 models)::

        y = ((q_x - input_offset) * input_scale) @ (W_q * (deq / input_scale))^T + bias

  The two differ by ``deq * (round(b/deq) - b/deq)`` (≤ deq/2 per output) plus float rounding.
* **dynamic** (W8A8_DYNAMIC, W8A8_MIX ``mix_mode="dynamic"``, W4A8_DYNAMIC): activations per token,
  symmetric, as ``npu_dynamic_quant`` (torch_npu documentation): ``s_t = max|x_t| / 127``,
  ``q = round(x / s_t)`` (a zero row gets ``q = 0``). Weight ``W = (W_q - off) * s_w`` per channel or group.

  - ``path="int"``: ``acc_g[m, n] = sum_{k in group g} q[m,k] * (W_q[n,k] - off[n,g])`` exactly;
    ``y = (acc * s_w[n]) * s_t[m] + bias`` per channel (``npu_quant_matmul`` order), or
    ``y = s_t[m] * sum_g s_w[n,g] * acc_g + bias`` per group. W4A8 per group (two stages,
    ``W = ((q4 - off2) * s2 - off1) * s1``): ``y = s_t * s1 * (sum_g s2[n,g] * acc_g - off1 * sum_k q) + bias``.
  - ``path="float"``: ``y = fq(x) @ W^T + bias`` where ``fq`` is chosen by ``act_sim``:

    - ``"runtime"`` (default): the NPU's symmetric per-token quant above, ``fq(x) = q * s_t``;
    - ``"msmodelslim_v0"``: asymmetric per-token min/max (the v0 simulation, README.md §7.1):
      ``s = (max(x_max,0) - min(x_min,0)) / 255``, ``o = round(-min(x_min,0)/s) - 128``,
      ``fq = (clamp(round(x/s + o), -128, 127) - o) * s``;
    - ``"msmodelslim_v1"``: statistics per *input channel* across tokens (the 26.1.0 v1 simulation,
      ``amin/amax(x.reshape(-1,k), dim=0)``, README.md §7.2), symmetric ``s_c = max|x_{:,c}| / 127``
      (the symmetric form is inferred from the per-token-sym dispatch key; the notes give only the axis).

  ``scale_bias`` (W4A8) is a grouped-matmul kernel input and is ignored by both paths (README.md §4).
* **W8A16 / W4A16** (weight only): ``y = x @ W^T + bias`` with ``W = (W_q - off) * s`` (float path) or the NPU
  antiquant form ``W = (W_q + (-off)) * s`` (int path); the two are equal.
* **FLOAT**: ``y = x @ W^T + bias``.

Integer accumulation uses int64 on CPU (no int32 matmul there); every accumulator is checked to lie in the int32
range the NPU has, and :func:`int32_accumulator_bound` bounds every partial sum for a given ``k``.
"""

from quant.msmodelslim.schemes.layout import (
    ACT_SIMS,
    DYNAMIC_TYPES,
    FLOAT_DTYPES,
    INT4_TYPES,
    KV_SUFFIXES,
    LINEAR_SUFFIXES,
    NORM_MODULE_SUFFIXES,
    PATHS,
    QUANT_LINEAR_TYPES,
    SCHEMES,
    STATIC_TYPES,
    WEIGHT_ONLY_TYPES,
    LinearLayout,
    ParamSpec,
    inspect_linear,
)
from quant.msmodelslim.schemes.linear import (
    SCHEME_CLASSES,
    DynamicLinear,
    FloatLinear,
    MixLinear,
    QuantLinear,
    StaticLinear,
    W4A8PerGroupLinear,
    WeightOnlyLinear,
)
from quant.msmodelslim.schemes.norms import AntiOutlierNorm, KVCacheQuant
from quant.msmodelslim.schemes.numerics import (
    INT32_MAX,
    dynamic_quant_per_token,
    fake_quant_asym_per_token,
    fake_quant_sym_per_input_channel,
    int32_accumulator_bound,
)

__all__ = [
    "ACT_SIMS",
    "AntiOutlierNorm",
    "DYNAMIC_TYPES",
    "DynamicLinear",
    "FLOAT_DTYPES",
    "FloatLinear",
    "INT32_MAX",
    "INT4_TYPES",
    "KVCacheQuant",
    "KV_SUFFIXES",
    "LINEAR_SUFFIXES",
    "LinearLayout",
    "MixLinear",
    "NORM_MODULE_SUFFIXES",
    "PATHS",
    "ParamSpec",
    "QUANT_LINEAR_TYPES",
    "QuantLinear",
    "SCHEMES",
    "SCHEME_CLASSES",
    "STATIC_TYPES",
    "StaticLinear",
    "W4A8PerGroupLinear",
    "WEIGHT_ONLY_TYPES",
    "WeightOnlyLinear",
    "dynamic_quant_per_token",
    "fake_quant_asym_per_token",
    "fake_quant_sym_per_input_channel",
    "inspect_linear",
    "int32_accumulator_bound",
]
