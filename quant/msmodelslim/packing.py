"""int4 packing: msModelSlim's byte packing along the output dim, and the NPU's 8-per-int32 packing.

**msModelSlim (W4A8_DYNAMIC / W4A16 ascendV1 output)** -- ``w4a8_pack_int4`` (``modelslim_v1/save/utils/pack.py``;
README.md §4 "W4A8_DYNAMIC", verified there by unpacking real output)::

    packed[i, j] = (q[2i+1, j] << 4) | (q[2i, j] & 0xF)          # q: int4 values [n, k] -> packed int8 [n/2, k]

Two consecutive **output rows** share a byte: the even row in the low nibble, the odd row in the high nibble.
Nibbles are two's complement (-8..7). Works on ``[n, k]`` and on stacked experts ``[E, n, k]``.

**NPU int4 (``npu_grouped_matmul`` / ``npu_quant_matmul`` int4 weights)** -- per the torch_npu documentation: 8 signed
nibbles per int32, **LSB first** (element 0 in bits 0-3), along the last dim::

    word[..., j] = sum_{i<8} (q[..., 8j+i] & 0xF) << 4i        # q [..., N] -> int32 [..., N/8]

With the NPU weight layout ``[K, N]`` the packed dim is N, i.e. the same output dim as msModelSlim's bytes, so
``msm_packed.transpose(-1, -2).contiguous().view(torch.int32)`` (what vllm-ascend ``w4a8.py`` does on a
little-endian host) equals ``pack_int4_to_int32(unpack_int4_rows(msm_packed).transpose(-1, -2))``; the tests
prove this identity.
"""

from __future__ import annotations

import torch

from quant.errors import QuantFormatError, tensor_label


def _sign_extend4(v: torch.Tensor) -> torch.Tensor:
    """Low nibble of each value as a signed int4 (-8..7), same dtype as ``v``."""
    return ((v & 0xF) ^ 8) - 8


def unpack_int4_rows(packed: torch.Tensor, name: str = "") -> torch.Tensor:
    """msModelSlim packed int8 ``[..., n/2, k]`` -> int4 values as int8 ``[..., n, k]`` (inverse of :func:`pack_int4_rows`)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise QuantFormatError(f"{tensor_label(name)}: packed int4 weight must be int8, found {packed.dtype}")
    if packed.dim() < 2:
        raise QuantFormatError(f"{tensor_label(name)}: packed int4 weight must be [n/2, k], found {list(packed.shape)}")
    p = packed.to(torch.int16)
    lo = _sign_extend4(p)
    hi = _sign_extend4(p >> 4)
    out = torch.stack([lo, hi], dim=-2)  # [..., n/2, 2, k]
    shape = list(packed.shape)
    shape[-2] *= 2
    return out.reshape(shape).to(torch.int8)


def pack_int4_rows(q: torch.Tensor, name: str = "") -> torch.Tensor:
    """int4 values ``[..., n, k]`` (any int dtype, each in -8..7) -> msModelSlim packed int8 ``[..., n/2, k]``."""
    if q.dim() < 2 or q.shape[-2] % 2:
        raise QuantFormatError(f"{tensor_label(name)}: int4 rows must be [n, k] with n even, found {list(q.shape)}")
    qi = q.to(torch.int16)
    if bool(((qi < -8) | (qi > 7)).any()):
        raise QuantFormatError(f"{tensor_label(name)}: values outside the int4 range -8..7")
    even = qi[..., 0::2, :]
    odd = qi[..., 1::2, :]
    byte = ((odd & 0xF) << 4) | (even & 0xF)  # 0..255
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def pack_int4_to_int32(q: torch.Tensor, name: str = "") -> torch.Tensor:
    """int4 values ``[..., N]`` (N % 8 == 0) -> int32 ``[..., N/8]``, LSB first (the NPU int4 container)."""
    if q.dim() < 1 or q.shape[-1] % 8:
        raise QuantFormatError(f"{tensor_label(name)}: last dim must be a multiple of 8, found {list(q.shape)}")
    qi = q.to(torch.int64)
    if bool(((qi < -8) | (qi > 7)).any()):
        raise QuantFormatError(f"{tensor_label(name)}: values outside the int4 range -8..7")
    nib = (qi & 0xF).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (nib << shifts).sum(-1)  # 0 .. 2^32-1 (disjoint bit fields, so sum == or)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int32_to_int4(p: torch.Tensor, name: str = "") -> torch.Tensor:
    """int32 ``[..., M]`` -> int4 values as int8 ``[..., 8M]`` (inverse of :func:`pack_int4_to_int32`)."""
    if p.dtype != torch.int32:
        raise QuantFormatError(f"{tensor_label(name)}: packed int4 container must be int32, found {p.dtype}")
    w = p.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = _sign_extend4(w.unsqueeze(-1) >> shifts)  # [..., M, 8]
    return nib.reshape(*p.shape[:-1], p.shape[-1] * 8).to(torch.int8)


__all__ = ["pack_int4_rows", "pack_int4_to_int32", "unpack_int32_to_int4", "unpack_int4_rows"]
