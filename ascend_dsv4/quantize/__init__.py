"""``ascend-dsv4 quantize``: write msModelSlim-format quantised weights for DeepSeek-V4 and V3 ourselves.

msModelSlim 26.1.0 cannot quantise DeepSeek-V4 on CPU (its DeepSeek adapters hard-code the NPU;
``quant/msmodelslim/README.md`` §2), so this package produces the same on-disk format from our own float model,
following the DeepSeek-V4 Ascend A3 recipe (all weights static per-channel int8, all activations dynamic per-token
int8):

========================  ====================================================================================
quantised (DeepSeek-V4)   ``attn.wq_b``, ``attn.indexer.wq_b``, ``attn.wo_b``, ``ffn.shared_experts.w1/w2/w3``,
                          the routed experts ``ffn.experts.E.w1/w2/w3`` -- of every layer and of the MTP layer
                          ``mtp.0.*``
float (DeepSeek-V4)       everything else: ``wq_a``, ``wkv``, ``wo_a``, compressors, ``indexer.weights_proj``,
                          ``ffn.gate`` (+ bias / tid2eid), norms, ``hc_*``, ``attn_sink``, ``embed``, ``head``,
                          MTP ``e_proj`` / ``h_proj``
quantised (DeepSeek-V3)   ``self_attn.q_a_proj`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``o_proj``,
                          the dense MLP ``gate/up/down_proj``, shared experts, routed experts -- MTP layer included
float (DeepSeek-V3)       ``kv_b_proj`` (vllm-ascend needs it float for W_UK/W_UV), ``mlp.gate`` (+
                          ``e_score_correction_bias``), norms, ``embed_tokens``, ``lm_head``, MTP ``eh_proj``,
                          ``enorm``/``hnorm``, ``shared_head`` and the MTP layer's stored embed/head copies
========================  ====================================================================================

``--type`` (model_quant_type = the type in upper case):

* ``w8a8_dynamic``: every quantised linear W8A8_DYNAMIC -- ``weight`` int8 [n,k] (symmetric per channel,
  ``absmax/127``, clamp ±127), ``weight_scale`` float32 [n,1], ``weight_offset`` float32 [n,1] zeros
  (quant/msmodelslim/README.md §4;
  identical to the v1 fixture ``w8a8_dynamic_v1``). Activations are quantised per token at run time.
* ``w8a8``: every quantised linear static W8A8 -- ``weight`` int8 [n,k], ``input_scale`` / ``input_offset``
  float32 [1] (asymmetric per tensor from calibration, quant/msmodelslim/README.md §6), ``quant_bias`` int32 [n],
  ``deq_scale`` [n]
  (int64 float32-bits for ``dtype=float32``, float32 for ``bfloat16``, quant/msmodelslim/README.md §5); no
  ``weight_scale`` (the v1
  AscendV1Saver does not write it for W8A8).
* ``w4a8_dynamic``: the routed experts W4A8_DYNAMIC per channel (v1 layout, identical to the fixture
  ``w4a8_dynamic_perchannel_v1``: int4 ``absmax/7`` per output channel, ``weight`` int8 **[n/2,k] packed** two
  output rows per byte, ``weight_scale`` / ``weight_offset`` (zeros) float32 [n,1], ``scale_bias`` float32
  [n,1] for w1/w3 and [n,16] for w2), everything else of the quantised set W8A8_DYNAMIC (the V4-Pro recipe).

Calibration (``w8a8`` only): ``calib_tokens`` random token ids (seeded) run through the float model in chunks of at
most 512 tokens; forward pre-hooks on every quantised ``parallel.linear.Linear`` record the input min/max. The MTP
layer is calibrated by running it on the main model's output with the true next tokens (as speculative decoding
does). Routed experts (the stacked ``Experts`` module) are calibrated **per expert**: a pre-hook on ``Experts``
re-computes, for each expert, its routed rows (w1/w3 input) and its w2 input ``swiglu(x W1^T, x W3^T)``, times
the routing weight for V4 (whose official MoE multiplies it into the hidden before w2,
ascend_dsv4/models/deepseek_v4/README.md §8 item 9) and without it
for V3 (DeepSeek-V3 / transformers / vllm-ascend weight the expert's output; msModelSlim calibrates that). An
expert that received no token during calibration falls back to the whole MoE input of its layer (w1/w3) and to
the union of the other experts' w2 inputs of that layer (w2); the summary counts these fallbacks -- raise
``--calib-tokens`` to avoid them.

``dtype`` is the serving dtype written into config.json (``torch_dtype``): ``bfloat16`` (default; float tensors
are stored bf16 except the official checkpoint's F32 tensors, static ``deq_scale`` float32) or ``float32``
(everything float32, static ``deq_scale`` int64). For bf16, ``input_scale`` is rounded to bf16 before ``deq_scale``
is formed, because the runtime quantises activations with the bf16 ``input_scale`` (vllm-ascend keeps it in
params_dtype); ``deq_scale`` itself is kept at full float32 precision.

Output files (the v1 AscendV1Saver layout, quant/msmodelslim/README.md §3): ``quant_model_description.json`` (every
tensor -> type,
plus ``model_quant_type``, ``version`` "1.0.0", ``group_size`` 0, ``metadata``, ``optional``),
``quant_model_weights.safetensors`` or, above ``shard_gb``, ``quant_model_weights-0000i-of-0000N.safetensors`` with
``quant_model_weights.safetensors.index.json``; ``config.json`` (HF form, no ``quantization_config``,
``torch_dtype`` = ``dtype``; for ``w4a8_dynamic`` also the four keys msModelSlim's DeepSeek adapter adds:
``quantize`` / ``mla_quantize`` / ``mtp_quantize`` = ``w8a8_dynamic``, ``moe_quantize`` = ``w4a8_dynamic``) and the
source folder's tokenizer / generation files. ``model_quant_type`` is the ``--type`` in upper case (msModelSlim
itself would report a pure W4A8 / W8A8_DYNAMIC mix as ``W8A8_DYNAMIC``: W4A8_DYNAMIC is missing from its priority
list, quant/msmodelslim/README.md §3). All linears are written in the description (MTP layer included), so no
``allow_float_mtp``.

Tensor names: V4 official names (``layers.N.attn.wq_b.weight``, per-expert ``layers.N.ffn.experts.E.w1.weight``,
``mtp.0.*``); V3 DeepSeek HF names (``model.layers.N.self_attn.q_a_proj.weight``,
``model.layers.N.mlp.experts.E.gate_proj.weight``, the MTP layer at ``model.layers.<num_hidden_layers>.*``).
"""

from quant.msmodelslim.encode import (
    activation_qparams, quantize_weight_int4, quantize_weight_int8, w4a8_dynamic_tensors, w8a8_dynamic_tensors,
    w8a8_static_tensors, w8a8_static_tensors_from_qparams,
)

from .calibrate import Calibration, calibrate
from .checkpoint import checkpoint_tensors, expected_tensor_names, names_for
from .write import QTYPES, format_summary, quantize_model

__all__ = [
    "Calibration",
    "QTYPES",
    "activation_qparams",
    "calibrate",
    "checkpoint_tensors",
    "expected_tensor_names",
    "format_summary",
    "names_for",
    "quantize_model",
    "quantize_weight_int4",
    "quantize_weight_int8",
    "w4a8_dynamic_tensors",
    "w8a8_dynamic_tensors",
    "w8a8_static_tensors",
    "w8a8_static_tensors_from_qparams",
]
