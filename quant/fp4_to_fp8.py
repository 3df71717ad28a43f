"""Lossless FP4 -> FP8 expert conversion (ascend_dsv4/models/deepseek_v4/README.md §3.2, ``convert.py --expert-dtype
fp8``).

For hardware without FP4 support, FP4 experts (``int8 [..., out, in/2]`` packed e2m1 plus E8M0
scales ``[..., out, in/32]``) are rewritten as FP8-e4m3 ``[..., out, in]`` with one E8M0 scale per
128x128 block ``[..., out/128, in/128]``.

Per 128x128 block (512 per-32 scales, 128 rows x 4 column groups), with scale bytes ``s``::

    blk = max(s) - 6                         (S_blk = max scale / 2^6, as an E8M0 byte)
    q[i, j] = fp4(code[i, j]) * 2^(s[i, j//32] - blk)      stored as e4m3

Since ``s - blk <= 6`` and ``|fp4| <= 6``, ``|q| <= 6 * 64 = 384 < 448``: no overflow, and for
every code ``q`` has at most 2 significant bits, so it is an e4m3 value whenever it is not below the
e4m3 subnormal grid (multiples of 2^-9). Hence ``q * S_blk == fp4 * S`` exactly, i.e.
``dequant_fp8_block(*fp4_to_fp8(p, s)) == dequant_fp4(p, s)`` bit for bit in float32.

Edge cases (decisions):

* **Spread** ``d = max(s) - s`` of a group within its block. ``s - blk = 6 - d``. Exactness is
  guaranteed for ``d <= 14`` (smallest product 0.5 * 2^-8 = 2^-9). For ``d >= 15`` some codes fall
  off the subnormal grid (a product is exact iff it is a multiple of 2^-9): ``d = 15`` loses +-0.5 and
  +-1.5, ``d = 16`` also +-1 and +-3, ``d = 17`` keeps only +-4, ``d >= 18`` keeps only zeros. The conversion checks every element: by default (``strict=True``) an inexact element raises
  :class:`QuantFormatError` naming the tensor, the block and the spread; with ``strict=False`` such
  elements are rounded to nearest-even onto the e4m3 grid (possibly to zero), which is lossy.
  Zero codes (and codes that happen to be representable) never trigger the error.
* **Tiny scales**: if ``max(s) < 6`` the block byte would be negative; it is clamped to 0 (2^-127).
  Then ``s - blk = s >= 0`` and every value stays exact and <= 6 * 2^5 < 448.
* Dimensions ``out`` and ``in`` must be multiples of 128 (else :class:`QuantFormatError`); scale
  bytes of 255 are rejected.
"""

from __future__ import annotations

import torch

from quant.errors import QuantFormatError, tensor_label
from quant.fp4 import FP4_BLOCK, _check_fp4_scale, fp4_codes_to_float
from quant.fp8_block import FP8_BLOCK

# Exponent headroom: 2^6 * 6 = 384 <= 448 (e4m3 max).
FP4_TO_FP8_HEADROOM = 6


def fp4_to_fp8(
    packed: torch.Tensor,
    scale: torch.Tensor,
    name: str = "",
    strict: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert packed FP4 weights to block-scaled FP8 without changing any value.

    Args:
        packed: ``int8`` / ``uint8`` ``[..., out, in/2]`` FP4 codes (element 2c in the low nibble).
        scale: E8M0 (``uint8`` or ``torch.float8_e8m0fnu``) ``[..., out, in/32]``.
        name: checkpoint key for error messages.
        strict: raise if any element cannot be represented exactly (see module docstring); if False,
            such elements are rounded to nearest-even in e4m3.

    Returns:
        ``(w_fp8, scale_blk)``: ``torch.float8_e4m3fn [..., out, in]`` and ``uint8`` E8M0
        ``[..., out/128, in/128]`` with ``scale_blk = max(max of the block's per-32 bytes - 6, 0)``.

    Raises:
        QuantFormatError: bad dtype / shape, ``out`` or ``in`` not a multiple of 128, a 255 scale byte,
        or (``strict``) an element that would underflow the e4m3 grid.
    """
    codes, sb = _check_fp4_scale(packed, scale, FP4_BLOCK, name)
    out, in_ = (codes.shape[-2], codes.shape[-1]) if codes.dim() >= 2 else (None, None)
    if out is None or out % FP8_BLOCK or in_ % FP8_BLOCK:
        raise QuantFormatError(
            f"{tensor_label(name)}: FP4->FP8 conversion needs [..., out, in] with out and in multiples of "
            f"{FP8_BLOCK}, found logical shape {tuple(codes.shape)}"
        )
    lead = tuple(codes.shape[:-2])
    ob, ib = out // FP8_BLOCK, in_ // FP8_BLOCK
    groups = FP8_BLOCK // FP4_BLOCK  # per-32 scales across one block row
    s = sb.to(torch.int32)  # [..., out, in/32]
    smax = s.reshape(*lead, ob, FP8_BLOCK, ib, groups).amax(dim=(-3, -1))  # [..., ob, ib]
    blk = (smax - FP4_TO_FP8_HEADROOM).clamp(min=0)
    blk_full = blk.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(groups, dim=-1)  # [..., out, in/32]
    k = (s - blk_full).repeat_interleave(FP4_BLOCK, dim=-1)  # [..., out, in], k <= 6
    # float64 keeps fp4 * 2^k exact for every k >= -254 - 6.
    v = fp4_codes_to_float(codes).to(torch.float64) * torch.exp2(k.to(torch.float64))
    q = v.to(torch.float8_e4m3fn)
    if strict:
        bad = q.to(torch.float64) != v
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            bi = first[:-2] + (first[-2] // FP8_BLOCK, first[-1] // FP8_BLOCK)
            spread = int(smax[bi]) - int(s[first[:-1] + (first[-1] // FP4_BLOCK,)])
            raise QuantFormatError(
                f"{tensor_label(name)}: FP4->FP8 conversion is not lossless: {int(bad.sum())} element(s) fall "
                f"below the e4m3 subnormal grid (2^-9); first at {first} in 128x128 block {bi}, where the "
                f"per-32 scale spread is 2^{spread} (exact only up to 2^14). Pass strict=False to round."
            )
    return q, blk.to(torch.uint8)


__all__ = ["FP4_TO_FP8_HEADROOM", "fp4_to_fp8"]
