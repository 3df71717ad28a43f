"""C8 KV-cache quantisation (msModelSlim ``kv_cache_scale`` / ``kv_cache_offset``, per channel)."""

from __future__ import annotations

import torch

from .._registry import register


@register("kv_quant", "reference")
def kv_quant(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() * inv_scale.float()
    if offset is not None:
        y = y + offset.float()
    return torch.round(y).clamp(-128, 127).to(torch.int8)
