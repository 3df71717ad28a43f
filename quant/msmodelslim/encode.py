"""Encode float weights as msModelSlim tensors (the inverse of :mod:`quant.msmodelslim.schemes`): per-channel
int8 / int4 weights, asymmetric per-tensor int8 activation parameters, and the tensors of one W8A8_DYNAMIC,
W4A8_DYNAMIC (per channel, v1 layout) or static W8A8 linear, with msModelSlim 26.1.0's formulas (bit-exact
with its fixtures ``w8a8_dynamic_v1`` and ``w4a8_dynamic_perchannel_v1``).
"""

from __future__ import annotations

from typing import Optional

import torch

from quant.errors import QuantFormatError
from quant.msmodelslim.npu_params import compute_scale_bias, encode_deq_scale_msmodelslim
from quant.msmodelslim.packing import pack_int4_rows


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
    if w.shape[0] % 2:
        raise QuantFormatError(f"W4A8 needs an even number of output rows to pack two per byte, got {tuple(w.shape)}")
    q, s = quantize_weight_int4(w)
    return {"weight": pack_int4_rows(q), "weight_scale": s, "weight_offset": torch.zeros_like(s),
            "scale_bias": compute_scale_bias(q, s, scale_bias_chunks)}


def activation_qparams(x_min: float, x_max: float, model_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Asymmetric per-tensor int8 activation parameters (README.md §6): ``(input_scale, input_offset)``.

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
    """Static W8A8 tensors of one linear (v1 layout, README.md §4/§6) for given activation parameters.

    ``deq_scale = input_scale * weight_scale`` (float32); ``quant_bias = round(bias/deq - input_offset * sum_k q_w)``
    int32; ``deq_scale`` is stored as msModelSlim's int64 (float32 bits) unless ``model_dtype`` is bf16 (float32).
    A float ``bias`` is folded into ``quant_bias`` (the caller writes it FLOAT too, as msModelSlim does).
    """
    q, ws = quantize_weight_int8(w)
    s_x = torch.tensor(float(input_scale), dtype=torch.float32)
    o_x = float(input_offset)
    deq = (s_x * ws.reshape(-1)).to(torch.float32)
    corr = q.to(torch.float32).sum(dim=1) * o_x  # float32, as msModelSlim (exact: |corr| < 2^24)
    b = torch.zeros_like(corr) if bias is None else bias.detach().to(torch.float32).reshape(-1) / deq
    qb = torch.round(b - corr)
    if bool((qb.abs() > 2**31 - 1).any()):
        raise QuantFormatError("quant_bias exceeds the int32 range")
    deq_out = deq if model_dtype == torch.bfloat16 else encode_deq_scale_msmodelslim(deq)
    return {
        "weight": q,
        "input_scale": s_x.reshape(1),
        "input_offset": torch.tensor([o_x], dtype=torch.float32),
        "quant_bias": qb.to(torch.int32),
        "deq_scale": deq_out,
    }
