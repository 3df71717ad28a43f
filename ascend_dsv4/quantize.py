"""``ascend-dsv4 quantize``: write msModelSlim-format quantised weights for DeepSeek-V4 and V3 ourselves.

msModelSlim 26.1.0 cannot quantise DeepSeek-V4 on CPU (its DeepSeek adapters hard-code the NPU; notes §2), so this
module produces the same on-disk format from our own float model, following the DeepSeek-V4 Ascend A3 recipe
(ascend_deployment_notes.md c.1: "All W8 = static per-channel int8, all A8 = dynamic per-token int8"):

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
  ``absmax/127``, clamp ±127), ``weight_scale`` float32 [n,1], ``weight_offset`` float32 [n,1] zeros (notes §4;
  identical to the v1 fixture ``w8a8_dynamic_v1``). Activations are quantised per token at run time.
* ``w8a8``: every quantised linear static W8A8 -- ``weight`` int8 [n,k], ``input_scale`` / ``input_offset``
  float32 [1] (asymmetric per tensor from calibration, notes §6), ``quant_bias`` int32 [n], ``deq_scale`` [n]
  (int64 float32-bits for ``dtype=float32``, float32 for ``bfloat16``, notes §5); no ``weight_scale`` (the v1
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
the routing weight for V4 (whose official MoE multiplies it into the hidden before w2, spec §8.9) and without it
for V3 (DeepSeek-V3 / transformers / vllm-ascend weight the expert's output; msModelSlim calibrates that). An
expert that received no token during calibration falls back to the whole MoE input of its layer (w1/w3) and to
the union of the other experts' w2 inputs of that layer (w2); the summary counts these fallbacks -- raise
``--calib-tokens`` to avoid them.

``dtype`` is the serving dtype written into config.json (``torch_dtype``): ``bfloat16`` (default; float tensors
are stored bf16 except the official checkpoint's F32 tensors, static ``deq_scale`` float32) or ``float32``
(everything float32, static ``deq_scale`` int64). For bf16, ``input_scale`` is rounded to bf16 before ``deq_scale``
is formed, because the runtime quantises activations with the bf16 ``input_scale`` (vllm-ascend keeps it in
params_dtype); ``deq_scale`` itself is kept at full float32 precision.

Output files (the v1 AscendV1Saver layout, notes §3): ``quant_model_description.json`` (every tensor -> type,
plus ``model_quant_type``, ``version`` "1.0.0", ``group_size`` 0, ``metadata``, ``optional``),
``quant_model_weights.safetensors`` or, above ``shard_gb``, ``quant_model_weights-0000i-of-0000N.safetensors`` with
``quant_model_weights.safetensors.index.json``; ``config.json`` (HF form, no ``quantization_config``,
``torch_dtype`` = ``dtype``; for ``w4a8_dynamic`` also the four keys msModelSlim's DeepSeek adapter adds:
``quantize`` / ``mla_quantize`` / ``mtp_quantize`` = ``w8a8_dynamic``, ``moe_quantize`` = ``w4a8_dynamic``) and the
source folder's tokenizer / generation files. ``model_quant_type`` is the ``--type`` in upper case (msModelSlim
itself would report a pure W4A8 / W8A8_DYNAMIC mix as ``W8A8_DYNAMIC``: W4A8_DYNAMIC is missing from its priority
list, notes §3). All linears are written in the description (MTP layer included), so no ``allow_float_mtp``.

Tensor names: V4 official names (``layers.N.attn.wq_b.weight``, per-expert ``layers.N.ffn.experts.E.w1.weight``,
``mtp.0.*``); V3 DeepSeek HF names (``model.layers.N.self_attn.q_a_proj.weight``,
``model.layers.N.mlp.experts.E.gate_proj.weight``, the MTP layer at ``model.layers.<num_hidden_layers>.*``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from parallel.linear import Linear
from quant.shard_writer import ShardWriter

from .errors import AscendDSV4Error, ConfigError
from .layers.experts import Experts
from .models import ModelFamily, family_of

QTYPES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}

W8A8 = "W8A8"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W4A8_DYNAMIC = "W4A8_DYNAMIC"
FLOAT = "FLOAT"

DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"
CALIB_CHUNK = 512
#: files copied from a source folder next to the weights (msModelSlim v1 copies *.json/*.py/*.txt/*.jinja)
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")

# quantised linear prefixes (output names, without ".weight")

# ---------------------------------------------------------------------------------------------------------------
# per-linear quantisers (pure functions; exactly the formulas of msmodelslim_notes §4 / §6)


def _absmax_rows(w: torch.Tensor) -> torch.Tensor:
    a = w.detach().to(torch.float32).abs().amax(dim=1, keepdim=True)
    return torch.where(a > 0, a, torch.ones_like(a))  # an all-zero row gets scale 1/qmax (its codes are 0)


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 (minmax): ``s = absmax/127``, ``q = clamp(round(w/s), -127, 127)``.

    ``w`` float [n, k] -> (int8 [n, k], float32 [n, 1]).
    """
    w32 = w.detach().to(torch.float32)
    s = _absmax_rows(w32) / 127.0
    q = torch.clamp(torch.round(w32 / s), -127, 127).to(torch.int8)
    return q, s


def quantize_weight_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int4 (minmax, v1 ``int4 per_channel``): ``s = absmax/7``, ``q = clamp(round(w/s), -8, 7)``.

    ``w`` float [n, k] -> (int4 values as int8 [n, k], float32 [n, 1]). Bit-exact with msModelSlim 26.1.0 (fixture
    ``w4a8_dynamic_perchannel_v1``).
    """
    w32 = w.detach().to(torch.float32)
    s = _absmax_rows(w32) / 7.0
    q = torch.clamp(torch.round(w32 / s), -8, 7).to(torch.int8)
    return q, s


def w8a8_dynamic_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """W8A8_DYNAMIC tensors of one linear: ``weight`` int8 [n,k], ``weight_scale`` / ``weight_offset`` float32 [n,1]."""
    q, s = quantize_weight_int8(w)
    return {"weight": q, "weight_scale": s, "weight_offset": torch.zeros_like(s)}


def w4a8_dynamic_tensors(w: torch.Tensor, scale_bias_chunks: int = 1) -> dict[str, torch.Tensor]:
    """W4A8_DYNAMIC per-channel tensors (v1): packed ``weight`` int8 [n/2,k], ``weight_scale`` / ``weight_offset``
    float32 [n,1], ``scale_bias`` float32 [n, chunks] (1 for gate/up/w1/w3, 16 for down/w2)."""
    from quant.msmodelslim.npu_params import compute_scale_bias
    from quant.msmodelslim.packing import pack_int4_rows

    if w.shape[0] % 2:
        raise ConfigError(f"W4A8 needs an even number of output rows to pack two per byte, got {tuple(w.shape)}")
    q, s = quantize_weight_int4(w)
    return {"weight": pack_int4_rows(q), "weight_scale": s, "weight_offset": torch.zeros_like(s),
            "scale_bias": compute_scale_bias(q, s, scale_bias_chunks)}


def activation_qparams(x_min: float, x_max: float, model_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Asymmetric per-tensor int8 activation parameters (notes §6): ``(input_scale, input_offset)``.

    ``input_scale = (max(x_max,0) - min(x_min,0)) / 255`` rounded to ``model_dtype`` (the runtime quantises with the
    params-dtype scale), ``input_offset = round(-min(x_min,0) / input_scale) - 128`` (integral, additive zero point).
    """
    lo, hi = min(float(x_min), 0.0), max(float(x_max), 0.0)
    s = max(hi - lo, 1e-8) / 255.0
    s = float(torch.tensor(s, dtype=torch.float32).to(model_dtype).to(torch.float32))
    o = float(torch.clamp(torch.round(torch.tensor(-lo / s, dtype=torch.float64)) - 128, -128, 127))
    return s, o


def w8a8_static_tensors(w: torch.Tensor, x_min: float, x_max: float, model_dtype: torch.dtype = torch.bfloat16,
                        bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Static W8A8 tensors of one linear from its calibrated input range (:func:`activation_qparams`), see
    :func:`w8a8_static_tensors_from_qparams`."""
    s_x, o_x = activation_qparams(x_min, x_max, model_dtype)
    return w8a8_static_tensors_from_qparams(w, s_x, o_x, model_dtype, bias)


def w8a8_static_tensors_from_qparams(w: torch.Tensor, input_scale: float, input_offset: float,
                                     model_dtype: torch.dtype = torch.bfloat16,
                                     bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Static W8A8 tensors of one linear (v1 layout, notes §4/§6) for given activation parameters.

    ``deq_scale = input_scale * weight_scale`` (float32); ``quant_bias = round(bias/deq - input_offset * sum_k q_w)``
    int32; ``deq_scale`` is stored as msModelSlim's int64 (float32 bits) unless ``model_dtype`` is bf16 (float32).
    A float ``bias`` is folded into ``quant_bias`` (the caller writes it FLOAT too, as msModelSlim does).
    """
    from quant.msmodelslim.npu_params import encode_deq_scale_msmodelslim

    q, ws = quantize_weight_int8(w)
    s_x = torch.tensor(float(input_scale), dtype=torch.float32)
    o_x = float(input_offset)
    deq = (s_x * ws.reshape(-1)).to(torch.float32)
    corr = q.to(torch.float32).sum(dim=1) * o_x  # float32, as msModelSlim (exact: |corr| < 2^24)
    b = torch.zeros_like(corr) if bias is None else bias.detach().to(torch.float32).reshape(-1) / deq
    qb = torch.round(b - corr)
    if bool((qb.abs() > 2**31 - 1).any()):
        raise ConfigError("quant_bias exceeds the int32 range")
    deq_out = deq if model_dtype == torch.bfloat16 else encode_deq_scale_msmodelslim(deq)
    return {
        "weight": q,
        "input_scale": s_x.reshape(1),
        "input_offset": torch.tensor([o_x], dtype=torch.float32),
        "quant_bias": qb.to(torch.int32),
        "deq_scale": deq_out,
    }


# ---------------------------------------------------------------------------------------------------------------
# names


@dataclass
class _Names:
    """Our module names <-> the output (checkpoint) names of one model family (asked of its family record)."""

    family: ModelFamily
    n_layers: int
    n_mtp_layers: int = 0

    def out(self, ours: str) -> str:
        """Output name of one of our (non-stacked) parameter / buffer names."""
        return self.family.checkpoint_name(ours, self.n_layers)

    def expert(self, module: str, e: int, w: str) -> str:
        """Output prefix (no ``.weight``) of expert ``e`` weight ``w`` (w1/w2/w3) of the stacked ``module``."""
        return self.family.expert_checkpoint_name(module, e, w, self.n_layers)

    def qtype_of(self, prefix: str, qtype: str) -> str:
        """Description type of the linear ``prefix`` (output name without ``.weight``) for ``--type qtype``."""
        routed = bool(self.family.routed_expert_re.match(prefix))
        if not routed and not self.family.quant_linear_re.match(prefix):
            return FLOAT
        if qtype == "w8a8":
            return W8A8
        if qtype == "w4a8_dynamic" and routed:
            return W4A8_DYNAMIC
        return W8A8_DYNAMIC


def names_for(cfg) -> _Names:
    """The name map of ``cfg``'s family."""
    return _Names(family_of(cfg), cfg.n_layers, cfg.n_mtp_layers)


def _inventory_dtypes(cfg) -> dict[str, str]:
    """Checkpoint tensor name -> checkpoint dtype string, experts expanded, scales dropped."""
    out: dict[str, str] = {}
    for s in family_of(cfg).tensor_inventory(cfg):
        if getattr(s, "scale", False):
            continue
        names = [s.name.format(e=e) for e in range(s.count)] if "{e}" in s.name else [s.name]
        for n in names:
            out[n] = s.dtype
    return out


def expected_tensor_names(cfg) -> set[str]:
    """The (non-scale) tensor names of the published checkpoint of ``cfg`` (what the output must hold)."""
    return set(_inventory_dtypes(cfg))


# ---------------------------------------------------------------------------------------------------------------
# calibration


@dataclass
class _Range:
    lo: float = float("inf")
    hi: float = float("-inf")
    n: int = 0

    def add(self, t: torch.Tensor) -> None:
        if t.numel():
            t = t.detach()
            self.lo = min(self.lo, float(t.min()))
            self.hi = max(self.hi, float(t.max()))
            self.n += int(t.shape[0]) if t.dim() > 1 else 1

    def merge(self, o: "_Range") -> None:
        if o.n:
            self.lo, self.hi, self.n = min(self.lo, o.lo), max(self.hi, o.hi), self.n + o.n


@dataclass
class Calibration:
    """Input ranges (min, max) per output linear prefix, and the experts that fell back to a layer-wide range."""

    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    tokens: int = 0


def calibrate(llm, names: _Names, qtype_of: Callable[[str], str], n_tokens: int, seed: int) -> Calibration:
    """Run ``n_tokens`` random tokens through the float model (and its MTP layers) recording input ranges."""
    import atb_ops

    model, runner = llm.model, llm.runner
    # w2's input: V4 multiplies the routing weight into the expert hidden before w2 (our Experts);
    # DeepSeek-V3 (official / transformers, hence msModelSlim and vllm-ascend) weights the expert *output*
    weighted_w2 = not names.family.experts_weight_after_w2
    lin_ranges: dict[str, _Range] = {}
    moe_in: dict[str, _Range] = {}
    exp_ranges: dict[tuple[str, int, str], _Range] = {}
    hooks = []

    def lin_hook(prefix):
        def f(_mod, args):
            lin_ranges.setdefault(prefix, _Range()).add(args[0].reshape(-1, args[0].shape[-1]))
        return f

    def exp_hook(mod_name):
        def f(mod, args):
            x, weights, ids = args[0], args[1], args[2]
            moe_in.setdefault(mod_name, _Range()).add(x)
            if mod.fmt != "dense":
                raise AscendDSV4Error("calibration needs dense expert weights (load with dequantize=True)")
            xf = x.float()
            for e in torch.unique(ids).tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                xs = xf[tok]
                exp_ranges.setdefault((mod_name, e, "w1"), _Range()).add(xs)
                g = xs @ mod.w1[e].float().T
                u = xs @ mod.w3[e].float().T
                h = atb_ops.swiglu(g, u, mod.limit)
                if weighted_w2:
                    h = h * weights[tok, slot].float().unsqueeze(-1)
                exp_ranges.setdefault((mod_name, e, "w2"), _Range()).add(h.to(x.dtype))
        return f

    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            prefix = names.out(name + ".weight")[: -len(".weight")]
            if qtype_of(prefix) == W8A8:
                hooks.append(mod.register_forward_pre_hook(lin_hook(prefix)))
        elif isinstance(mod, Experts):
            if qtype_of(names.expert(name, 0, "w1")) == W8A8:
                hooks.append(mod.register_forward_pre_hook(exp_hook(name)))

    g = torch.Generator().manual_seed(seed)
    vocab = llm.cfg.vocab_size
    n_mtp = len(getattr(model, "mtp", None) or [])
    limit = max(1, min(CALIB_CHUNK, getattr(llm, "max_num_batched_tokens", CALIB_CHUNK), llm.max_model_len - 1))
    left = n_tokens
    try:
        with torch.inference_mode(), llm._ops():
            while left > 0:
                L = min(left, limit)
                toks = torch.randint(0, vocab, (L + 1,), generator=g).tolist()
                seq = runner.new_sequence()
                try:
                    ids, ctx = runner.prepare([seq], [toks[:L]], "last")
                    streams = model(ids, ctx)
                    nxt = torch.tensor(toks[1:], dtype=torch.long, device=ids.device)
                    for k in range(n_mtp):
                        model.mtp_forward(streams, nxt, ctx, k)
                    runner.commit([seq], ctx)
                finally:
                    runner.release(seq)
                left -= L
    finally:
        for h in hooks:
            h.remove()

    cal = Calibration(tokens=n_tokens)
    for prefix, r in lin_ranges.items():
        cal.ranges[prefix] = (r.lo, r.hi)
    for mod_name in {k[0] for k in exp_ranges} | set(moe_in):
        E = getattr(dict(model.named_modules())[mod_name], "w1").shape[0]
        w2_all = _Range()
        for (m, _e, w), r in exp_ranges.items():
            if m == mod_name and w == "w2":
                w2_all.merge(r)
        for e in range(E):
            for w in ("w1", "w2"):
                r = exp_ranges.get((mod_name, e, w))
                if r is None or not r.n:
                    r = moe_in.get(mod_name, _Range()) if w == "w1" else w2_all
                    cal.fallbacks.append(f"{names.expert(mod_name, e, w)}")
                if not r.n:
                    continue
                cal.ranges[names.expert(mod_name, e, w)] = (r.lo, r.hi)
                if w == "w1":
                    cal.ranges[names.expert(mod_name, e, "w3")] = (r.lo, r.hi)
    return cal


# ---------------------------------------------------------------------------------------------------------------
# the model -> checkpoint walk


def checkpoint_tensors(llm, names: Optional[_Names] = None
                       ) -> Iterator[tuple[str, torch.Tensor, Optional[tuple[str, int, str]]]]:
    """(output name, tensor, expert key or None) of every checkpoint tensor of the float model, in module order.

    Output names are V4 official / V3 HF names (:func:`names_for`); routed experts come one slice per expert.
    """
    names = names or names_for(llm.cfg)
    model = llm.model
    mods = dict(model.named_modules())
    for name, p in model.named_parameters():
        mod_name, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        mod = mods.get(mod_name)
        if isinstance(mod, Experts):
            if leaf not in ("w1", "w2", "w3"):
                raise AscendDSV4Error(f"{name}: experts must be dense to quantise (load with dequantize=True)")
            for e in range(p.shape[0]):
                yield names.expert(mod_name, e, leaf) + ".weight", p[e], (mod_name, e, leaf)
            continue
        if getattr(mod, "fmt", "dense") != "dense" or leaf == "scale":
            raise AscendDSV4Error(f"{name}: weights must be dense to quantise (load with dequantize=True)")
        yield names.out(name), p, None
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            yield names.out(name), b, None
    # tensors the checkpoint format stores twice (DeepSeek-V3 HF: the MTP layer's copies of embed and head)
    for ck, ours in names.family.stored_copies(names.n_layers, len(getattr(model, "mtp", None) or [])):
        yield ck, model.get_parameter(ours), None


def _float_dtype(name: str, t: torch.Tensor, inv: dict[str, str], model_dtype: torch.dtype) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        return t
    return t.to(torch.float32 if inv.get(name) == "F32" else model_dtype)


def _config_dict(cfg, model_dtype: torch.dtype, qtype: str) -> dict:
    name = "bfloat16" if model_dtype == torch.bfloat16 else "float32"
    d = cfg.dense().to_hf_dict()
    d.pop("quantization_config", None)
    d["torch_dtype"] = name
    if qtype == "w4a8_dynamic":  # what msModelSlim's DeepSeek adapter adds for W4A8 (notes §4, DeepSeek)
        d.update(quantize="w8a8_dynamic", moe_quantize="w4a8_dynamic", mla_quantize="w8a8_dynamic",
                 mtp_quantize="w8a8_dynamic")
    return d


def _load_llm(model: str, seed: int):
    from .entrypoints.llm import LLM

    return LLM(model=model, device="cpu", dtype="float32", seed=seed, dequantize=True, progress=False,
               max_num_seqs=1, max_num_batched_tokens=CALIB_CHUNK)


def quantize_model(model, qtype: str, out: str, calib_tokens: int = 64, seed: int = 0, dtype: str = "bfloat16",
                   shard_gb: float = 4.0, log: Optional[Callable[[str], None]] = print) -> dict:
    """Quantise ``model`` (preset name, model folder, or an already built ``LLM``) to ``out`` in msModelSlim format.

    ``qtype``: ``w8a8_dynamic`` | ``w8a8`` | ``w4a8_dynamic`` (module docstring). ``calib_tokens`` random tokens
    (seed ``seed``) calibrate static W8A8; ``seed`` also seeds a preset's random weights. ``dtype``: serving dtype
    written to config.json (``bfloat16`` | ``float32``). Returns the summary dict (also printed through ``log``).
    """
    if qtype not in QTYPES:
        raise ConfigError(f"--type must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of bfloat16, float32, got {dtype!r}")
    if qtype == "w8a8" and calib_tokens < 1:
        raise ConfigError(f"--calib-tokens must be >= 1 for static W8A8, got {calib_tokens}")
    if os.path.isdir(out) and os.listdir(out):
        raise AscendDSV4Error(f"--out {out} exists and is not empty; refusing to overwrite")
    model_dtype = DTYPES[dtype]
    src_dir = model if isinstance(model, str) and os.path.isdir(model) else None
    llm = _load_llm(model, seed) if isinstance(model, str) else model
    cfg = llm.cfg
    names = names_for(cfg)
    inv = _inventory_dtypes(cfg)
    qtype_of = lambda prefix: names.qtype_of(prefix, qtype)  # noqa: E731

    cal = calibrate(llm, names, qtype_of, calib_tokens, seed) if qtype == "w8a8" else Calibration()

    os.makedirs(out, exist_ok=True)
    writer = ShardWriter(out, int(shard_gb * (1 << 30)), stem=WEIGHTS_STEM, single_file=True)
    desc: dict[str, object] = {}
    stats: dict[str, dict[str, int]] = {}

    def put(key: str, t: torch.Tensor, typ: str) -> None:
        writer.add(key, t)
        desc[key] = typ

    with torch.no_grad():
        for key, t, ek in checkpoint_tensors(llm, names):
            prefix = key[: -len(".weight")] if key.endswith(".weight") else None
            typ = qtype_of(prefix) if prefix is not None and t.dim() == 2 else FLOAT
            if typ == FLOAT:
                ft = _float_dtype(key, t, inv, model_dtype)
                put(key, ft, FLOAT)
                s = stats.setdefault(FLOAT, {"tensors": 0, "linears": 0, "params": 0, "bytes": 0})
                s["tensors"] += 1
                s["params"] += ft.numel()
                s["bytes"] += ft.numel() * ft.element_size()
                continue
            if typ == W8A8_DYNAMIC:
                parts = w8a8_dynamic_tensors(t)
            elif typ == W4A8_DYNAMIC:
                w = ek[2] if ek is not None else prefix.rsplit(".", 1)[-1]
                parts = w4a8_dynamic_tensors(t, 16 if w in ("w2", "down_proj") else 1)
            else:
                r = cal.ranges.get(prefix)
                if r is None:
                    raise AscendDSV4Error(f"{prefix}: no calibration data reached this linear; raise --calib-tokens")
                parts = w8a8_static_tensors(t, r[0], r[1], model_dtype)
            s = stats.setdefault(typ, {"tensors": 0, "linears": 0, "params": 0, "bytes": 0})
            s["linears"] += 1
            s["params"] += t.numel()
            for suffix, v in parts.items():
                put(f"{prefix}.{suffix}", v, typ)
                s["tensors"] += 1
                s["bytes"] += v.numel() * v.element_size()
    files = writer.close()

    desc_out = {"model_quant_type": qtype.upper(), "version": "1.0.0", "group_size": 0, "metadata": {}, "optional": {}}
    desc_out.update(desc)
    with open(os.path.join(out, DESCRIPTION_NAME), "w") as f:
        json.dump(desc_out, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(_config_dict(cfg, model_dtype, qtype), f, indent=2)
    copied = []
    if src_dir:
        for fn in COPY_FILES:
            p = os.path.join(src_dir, fn)
            if os.path.isfile(p):
                shutil.copyfile(p, os.path.join(out, fn))
                copied.append(fn)

    total_bytes = sum(s["bytes"] for s in stats.values())
    total_params = sum(s["params"] for s in stats.values())
    summary = {
        "model": model if isinstance(model, str) else (cfg.name or "model"), "family": names.family.title, "type": qtype,
        "model_quant_type": qtype.upper(),
        "dtype": "bfloat16" if model_dtype == torch.bfloat16 else "float32", "out": out,
        "files": [os.path.basename(p) for p in files], "copied": copied, "per_type": stats,
        "bytes": total_bytes, "params": total_params,
        "bytes_per_param": total_bytes / total_params if total_params else float("nan"),
        "calib_tokens": cal.tokens, "calib_fallbacks": cal.fallbacks,
    }
    if log is not None:
        log(format_summary(summary))
    return summary


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_summary(s: dict) -> str:
    lines = [f"wrote {s['model']} ({s['family']}) as msModelSlim {s['model_quant_type']} ({s['dtype']}) to {s['out']}: "
             f"{', '.join(s['files'])}"]
    for typ in sorted(s["per_type"], key=lambda t: (t == FLOAT, t)):
        st = s["per_type"][typ]
        what = f"{st['linears']} linears, {st['tensors']} tensors" if typ != FLOAT else f"{st['tensors']} tensors"
        bpp = st["bytes"] / st["params"] if st["params"] else float("nan")
        lines.append(f"  {typ:<13} {what:<32} {st['params']:>14,} params  {_fmt_bytes(st['bytes']):>11}  "
                     f"{bpp:.3f} bytes/param")
    lines.append(f"  total         {s['params']:,} params, {_fmt_bytes(s['bytes'])}, "
                 f"{s['bytes_per_param']:.3f} bytes/param")
    if s["calib_tokens"]:
        fb = s["calib_fallbacks"]
        lines.append(f"  calibration   {s['calib_tokens']} random tokens; {len(fb)} expert linear(s) without routed "
                     f"tokens used the layer-wide range" + (f" (e.g. {fb[0]})" if fb else ""))
    if s["copied"]:
        lines.append(f"  copied        {', '.join(s['copied'])}")
    return "\n".join(lines)


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
