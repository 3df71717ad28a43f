"""Emulated torch_npu quantisation / quantised-matmul ops.

npu_dynamic_quant, npu_quantize, npu_quant_matmul, npu_weight_quant_batchmatmul, npu_trans_quant_param,
npu_format_cast. Integer products are accumulated exactly (int64 on the CPU; the device accumulates in int32 and
the caller keeps the sums in range).
"""

from __future__ import annotations

import torch

from .common import enum_to_dtype, refuse, round_half_even


def _unpack_int4_int32(w: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n/8]`` holding 8 signed nibbles, element 0 in bits 0-3 (LSB first) -> int8 ``[..., n]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    nib = (w.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.flatten(-2).to(torch.int8)


def npu_dynamic_quant(input: torch.Tensor, *, smooth_scales=None, group_index=None, dst_type=None,
                      quant_mode: str = "pertoken", dst_type_max: float = 0.0):
    """Per-token symmetric int8 quant (torch_npu doc ``npu_dynamic_quant``; op-plugin golden).

    ``x' = x * smooth``; ``scale = max|x'| / 127`` over the last dim; ``y = round(x' / scale)`` (half to even).
    Returns ``(y int8 [same shape], scale float32 x.shape[:-1])``. A zero row gives scale 0; its y is set to 0
    here (the golden divides by zero; the device behaviour is unspecified).
    """
    if group_index is not None:
        refuse("npu_dynamic_quant", "group_index")
    if quant_mode != "pertoken":
        refuse("npu_dynamic_quant", f"quant_mode={quant_mode!r}")
    if dst_type not in (None, torch.int8, 1):
        refuse("npu_dynamic_quant", f"dst_type={dst_type!r}")
    x = input.float()
    if smooth_scales is not None:
        x = x * smooth_scales.float()
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = round_half_even(x / safe.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    return y, scale


def npu_quantize(self: torch.Tensor, scales: torch.Tensor, zero_points, dtype, axis: int = 1, div_mode: bool = True):
    """Static quant (torch_npu doc ``npu_quantize``): ``div_mode=True``: ``round(x / scale) + zp``;
    ``div_mode=False``: ``round(x * scale + zp)``; saturated to the output type. Scales/zero points broadcast
    along ``axis`` (a 1-element scale is per tensor). Output int8 for ``torch.qint8`` / ``torch.int8``."""
    out_dtype = {torch.qint8: torch.int8, torch.int8: torch.int8, 12: torch.int8, 1: torch.int8}.get(dtype)
    if out_dtype is None:
        refuse("npu_quantize", f"dtype={dtype!r}")
    x = self.float()

    def along(t: torch.Tensor) -> torch.Tensor:
        t = t.float().reshape(-1)
        if t.numel() == 1:
            return t.reshape(())
        shape = [1] * x.dim()
        shape[axis] = t.numel()
        return t.reshape(shape)

    s = along(scales)
    zp = along(zero_points) if zero_points is not None else torch.zeros((), dtype=torch.float32)
    q = round_half_even(x / s) + zp if div_mode else round_half_even(x * s + zp)  # div_mode: quantize_per_channel
    return q.clamp(-128, 127).to(out_dtype)


def npu_trans_quant_param(scale: torch.Tensor, offset=None, round_mode: int = 0) -> torch.Tensor:
    """int64 words for the quant matmuls (torch_npu doc ``npu_trans_quant_param``; op-plugin golden):
    ``(float32_bits(scale) & 0xFFFFE000) | 1 << 46`` and, with an offset, ``(round(offset) clamped to
    [-256, 255]) & 0x1FF`` in bits 37..45."""
    if round_mode not in (0, None):
        refuse("npu_trans_quant_param", f"round_mode={round_mode}")
    bits = scale.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = (bits & 0xFFFFE000) | (1 << 46)
    if offset is not None:
        o = round_half_even(offset.float()).clamp(-256, 255).to(torch.int64)
        out, o = torch.broadcast_tensors(out, o)
        out = (out & 0x4000FFFFFFFF) | ((o & 0x1FF) << 37)
    return out


def _decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """A per-channel matmul scale as float32: int64 words carry the float32 bits in their low 32 bits
    (npu_trans_quant_param packs 19 bits + flag bit 46; a raw bit-cast packs all 32)."""
    if scale.dtype == torch.int64:
        low = scale & 0xFFFFFFFF
        low = torch.where(low >= 2**31, low - 2**32, low)
        return low.to(torch.int32).view(torch.float32)
    return scale.float()


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset=None, pertoken_scale=None,
                     bias=None, output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None, y_scale=None) -> torch.Tensor:
    """``out = (x1 @ x2 [+ bias_int32]) * scale[n] * pertoken_scale[m] [+ bias_float]`` (torch_npu doc
    ``npu_quant_matmul``; op-plugin golden). x1 int8 ``[..., m, k]``, x2 int8 ``[k, n]`` (or int4 packed into
    int32 ``[k, n/8]``, LSB first); int32 accumulation (exact here). ``scale`` float32/bfloat16 ``[n]``/``[1]``
    or int64 words (float32 bits in the low word). ``output_dtype`` float16 / bfloat16 / int32 (raw
    accumulator); int8 output (requantisation) is not emulated."""
    for name, v in (("offset", offset), ("x1_dtype", x1_dtype), ("x2_dtype", x2_dtype), ("group_sizes", group_sizes),
                    ("y_scale", y_scale)):
        if v is not None:
            refuse("npu_quant_matmul", name)
    out_dtype = torch.int8 if output_dtype is None else enum_to_dtype(output_dtype, "npu_quant_matmul", "output_dtype")
    if out_dtype == torch.int8:
        refuse("npu_quant_matmul", "int8 output (requantisation)")
    if x1.dtype != torch.int8:
        refuse("npu_quant_matmul", f"x1 dtype {x1.dtype}")
    w = _unpack_int4_int32(x2) if x2.dtype == torch.int32 else x2
    if w.dtype != torch.int8:
        refuse("npu_quant_matmul", f"x2 dtype {x2.dtype}")
    acc = torch.matmul(x1.to(torch.int64), w.to(torch.int64))
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    if out_dtype == torch.int32:
        return acc.to(torch.int32)
    y = acc.to(torch.float32) * _decode_scale(scale)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(out_dtype)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
                                 antiquant_group_size: int = 0, inner_precise: int = 0, weight_dtype=None):
    """``y = x @ ((w + antiquant_offset) * antiquant_scale) + bias`` (torch_npu doc
    ``npu_weight_quant_batchmatmul``): note the offset is **added**. x float ``[m, k]``; weight int8 ``[k, n]`` or
    int4 packed in int32 ``[k, n/8]``; scale/offset per tensor ``[1]``, per channel ``[n]``/``[1, n]`` or per group
    ``[ceil(k/g), n]`` with ``antiquant_group_size = g``. Output in x's dtype (float32 arithmetic here)."""
    for name, v in (("quant_scale", quant_scale), ("quant_offset", quant_offset), ("weight_dtype", weight_dtype)):
        if v is not None:
            refuse("npu_weight_quant_batchmatmul", name)
    w = (_unpack_int4_int32(weight) if weight.dtype == torch.int32 else weight).float()  # [k, n]
    k, n = w.shape[-2], w.shape[-1]

    def expand(t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        if antiquant_group_size > 0:
            g = antiquant_group_size
            return t.reshape(-1, n).repeat_interleave(g, dim=0)[:k]
        return t.reshape(-1) if t.numel() == 1 else t.reshape(1, n)

    if antiquant_offset is not None:
        w = w + expand(antiquant_offset)
    w = w * expand(antiquant_scale)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def npu_format_cast(self: torch.Tensor, acl_format: int, *, customize_dtype=None, input_dtype=None) -> torch.Tensor:
    """Storage re-tiling (e.g. FRACTAL_NZ = 29): the logical shape and values are unchanged, so identity here."""
    return self
