"""The non-linear tensors of an msModelSlim checkpoint: smoothed (anti-outlier) norms and C8 KV-cache quantisation."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from quant.errors import QuantFormatError, tensor_label
from quant.msmodelslim.schemes.numerics import as_f32, integral, round_clamp

class AntiOutlierNorm(nn.Module):
    """The smoothed norm of an anti-outlier / SmoothQuant checkpoint: ``y = norm(x) * weight + bias``.

    ``kind="rms"``: ``norm(x) = x * rsqrt(mean(x^2, -1) + eps)`` (vllm-ascend ``AscendRMSNorm``: ``npu_rms_norm``
    then ``x.add_(bias)``, README.md §4); ``kind="layer"``: ``(x - mean) * rsqrt(var + eps)``. Computed in float32,
    returned in ``x.dtype``. ``weight``/``bias`` ``[hidden]`` (fp16 weight with fp32 bias is normal for v0).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 kind: str = "rms", name: str = ""):
        super().__init__()
        if kind not in ("rms", "layer"):
            raise ValueError(f"kind must be 'rms' or 'layer', got {kind!r}")
        if bias is not None and bias.shape != weight.shape:
            raise QuantFormatError(
                f"{tensor_label(name + '.bias' if name else '')}: shape {list(bias.shape)} != weight {list(weight.shape)}"
            )
        self.name, self.eps, self.kind = name, eps, kind
        self.register_buffer("weight", as_f32(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else as_f32(bias), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        if self.kind == "rms":
            h = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            mu = x32.mean(-1, keepdim=True)
            h = (x32 - mu) * torch.rsqrt((x32 - mu).pow(2).mean(-1, keepdim=True) + self.eps)
        y = h * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


class KVCacheQuant(nn.Module):
    """C8 KV-cache quantisation of one projection (``<attn>.k_proj`` or ``<attn>.v_proj``), per channel.

    ``quantize(k) = clamp(round(k / scale + offset), -128, 127)`` int8; ``dequantize(q) = (q - offset) * scale``
    (README.md §4 "KV cache C8"); with ``reciprocal=True`` the quantiser multiplies by ``1/scale`` as vllm-ascend
    ``_quantize_kv_to_int8`` does. ``scale``/``offset`` ``[num_kv_heads * head_dim]`` broadcast over the last dim
    of ``k`` (post-RoPE K/V as they enter the cache). ``forward`` = dequantize(quantize(x)) in ``x.dtype``.
    """

    def __init__(self, scale: torch.Tensor, offset: Optional[torch.Tensor] = None, name: str = "",
                 reciprocal: bool = False):
        super().__init__()
        s = as_f32(scale).reshape(-1)
        if not bool((s > 0).all()):
            raise QuantFormatError(f"{tensor_label(name + '.kv_cache_scale' if name else '')}: scales must be > 0")
        o = torch.zeros_like(s) if offset is None else as_f32(offset).reshape(-1)
        if o.shape != s.shape:
            raise QuantFormatError(
                f"{tensor_label(name + '.kv_cache_offset' if name else '')}: shape {list(o.shape)} != scale {list(s.shape)}"
            )
        self.name, self.reciprocal = name, reciprocal
        self.register_buffer("scale", s, persistent=False)
        self.register_buffer("offset", integral(o, f"{name}.kv_cache_offset"), persistent=False)

    @property
    def symmetric(self) -> bool:
        return bool((self.offset == 0).all())

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        v = x32 * (1.0 / self.scale) if self.reciprocal else x32 / self.scale
        return round_clamp(v + self.offset).to(torch.int8)

    def dequantize(self, q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ((q.to(torch.float32) - self.offset) * self.scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(x), x.dtype)
