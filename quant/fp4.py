"""FP4-e2m1 weights with one E8M0 scale per 32 inputs (DeepSeek-V4 routed experts,
ascend_dsv4/models/deepseek_v4/README.md §3.2).

Code ``n`` (0..15) of a 4-bit element::

    magnitude = [0, 0.5, 1, 1.5, 2, 3, 4, 6][n & 7]
    value     = -magnitude if n & 8 else magnitude      (code 8 is -0.0)

Packing: a checkpoint stores ``int8 [..., out, in/2]``; byte ``c`` of a row holds logical element
``2c`` in its LOW nibble and element ``2c+1`` in its HIGH nibble (the byte order of torch's
``float4_e2m1fn_x2``).

Dequantisation, with ``S`` an E8M0 tensor ``[..., out, ceil(in/32)]``::

    W[i, j] = fp4(code[i, j]) * 2^(S[i, j // 32] - 127)

Leading dimensions (stacked experts ``[E, out, in/2]``) are carried through everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quant.e8m0 import check_e8m0, e8m0_to_float
from quant.errors import QuantFormatError, tensor_label

FP4_BLOCK = 32
FP4_MAX = 6.0
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_TABLE = torch.tensor(list(FP4_MAGNITUDES) + [-v for v in FP4_MAGNITUDES], dtype=torch.float32)
_FP4_GRID = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def _packed_bytes(packed: torch.Tensor, name: str) -> torch.Tensor:
    """int8 / uint8 / float4_e2m1fn_x2 -> uint8 view (no copy)."""
    if packed.dtype == torch.uint8:
        return packed
    if packed.dtype == torch.int8 or (_FP4_X2 is not None and packed.dtype == _FP4_X2):
        return packed.view(torch.uint8)
    raise QuantFormatError(
        f"{tensor_label(name)}: expected packed FP4 as int8 / uint8 (two codes per byte), found {packed.dtype}"
    )


def pack_fp4(codes: torch.Tensor, name: str = "") -> torch.Tensor:
    """Pack FP4 codes two per byte.

    Args:
        codes: integer tensor ``[..., in]`` (``in`` even) with entries in 0..15.

    Returns:
        ``int8 [..., in/2]``: ``byte[c] = codes[2c] | codes[2c+1] << 4`` (element 2c in the low nibble).

    Raises:
        QuantFormatError: non-integer dtype, odd last dim, or a code outside 0..15.
    """
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool or codes.dim() < 1:
        raise QuantFormatError(f"{tensor_label(name)}: expected integer FP4 codes [..., in], found {codes.dtype}")
    if codes.shape[-1] % 2:
        raise QuantFormatError(f"{tensor_label(name)}: FP4 packing needs an even last dim, found {tuple(codes.shape)}")
    c = codes.to(torch.int32)
    if bool(((c < 0) | (c > 15)).any()):
        raise QuantFormatError(f"{tensor_label(name)}: FP4 codes must lie in 0..15")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)


def unpack_fp4(packed: torch.Tensor, name: str = "") -> torch.Tensor:
    """Unpack two FP4 codes per byte.

    Args:
        packed: ``int8`` / ``uint8`` (or ``float4_e2m1fn_x2``) ``[..., n]``.

    Returns:
        ``uint8 [..., 2n]`` codes: ``codes[2c] = byte[c] & 0xF``, ``codes[2c+1] = byte[c] >> 4``.
    """
    b = _packed_bytes(packed, name)
    if b.dim() < 1:
        raise QuantFormatError(f"{tensor_label(name)}: packed FP4 must have at least one dim")
    lo = b & 0x0F
    hi = b >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode FP4 codes (integers 0..15, any shape) to float32 via the e2m1 table (code 8 -> -0.0)."""
    return _FP4_TABLE.to(codes.device)[codes.to(torch.int64)]


def _check_fp4_scale(packed: torch.Tensor, scale: torch.Tensor, block: int, name: str):
    """Validate shapes; return (codes uint8 [..., in], scale bytes uint8 [..., ceil(in/block)])."""
    codes = unpack_fp4(packed, name)
    in_ = codes.shape[-1]
    expected = tuple(codes.shape[:-1]) + (-(-in_ // block),)
    if tuple(scale.shape) != expected:
        raise QuantFormatError(
            f"{tensor_label(name)}: FP4 scale shape mismatch for packed weight {tuple(packed.shape)} "
            f"(logical {tuple(codes.shape)}, one scale per {block} inputs): expected {expected}, "
            f"found {tuple(scale.shape)}"
        )
    return codes, check_e8m0(scale, name)


def dequant_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: int = FP4_BLOCK,
    name: str = "",
) -> torch.Tensor:
    """Dequantise packed FP4 weights.

    Args:
        packed: ``int8`` / ``uint8`` ``[..., out, in/2]`` (leading dims such as experts allowed).
        scale: E8M0 (``uint8`` or ``torch.float8_e8m0fnu``) ``[..., out, ceil(in/block)]``.
        dtype: output dtype.
        block: inputs per scale (32).
        name: checkpoint key, used in error messages.

    Returns:
        ``[..., out, in]`` of ``dtype``: ``W[i, j] = fp4(code[i, j]) * 2^(S[i, j // block] - 127)``,
        multiplied in float32 (exactly rounded) then cast.

    Raises:
        QuantFormatError: wrong dtypes, scale shape mismatch (names the tensor and both shapes), or a
        scale byte of 255 (NaN).
    """
    codes, sb = _check_fp4_scale(packed, scale, block, name)
    in_ = codes.shape[-1]
    s = e8m0_to_float(sb, name).repeat_interleave(block, dim=-1)[..., :in_]
    return (fp4_codes_to_float(codes) * s).to(dtype)


def _ceil_log2_over_6(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with 6 * 2^e >= amax (amax > 0), exact: amax = m*2^E, 6 = 0.75*2^3."""
    m, e = torch.frexp(amax.to(torch.float32))
    e = e.to(torch.int32)
    return torch.where(m <= 0.75, e - 3, e - 2)


def round_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale, |x| <= 6 expected) to FP4 codes.

    Round-to-nearest onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}; an exact tie goes to the EVEN code
    (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), which is IEEE
    round-half-to-even on the e2m1 mantissa. Magnitudes above 6 saturate to 6. The sign bit is the
    sign bit of ``x`` (so -0.0 and small negatives that round to zero give code 8, i.e. -0.0).
    Returns ``uint8`` codes of the same shape.
    """
    xf = x.to(torch.float32)
    grid = _FP4_GRID.to(xf.device)
    m = xf.abs().clamp(max=FP4_MAX)
    lo = (torch.searchsorted(grid, m.contiguous(), right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    d_lo = m - grid[lo]
    d_hi = grid[hi] - m
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = torch.where(take_hi, hi, lo)
    sign = torch.signbit(xf).to(torch.int64) << 3
    return (idx | sign).to(torch.uint8)


def quant_fp4(w: torch.Tensor, block: int = FP4_BLOCK, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 with one E8M0 scale per ``block`` inputs.

    Args:
        w: float tensor ``[..., in]`` (``in`` even; math in float32).
        block: inputs per scale (32).

    Returns:
        ``(packed int8 [..., in/2], scale uint8 E8M0 [..., ceil(in/block)])``.

    Rule (same as the reference ``fp4_act_quant``, ascend_dsv4/models/deepseek_v4/README.md §2.0), per block of
    ``block`` inputs
    (a partial last block uses its real elements only):

    * ``amax = max(max |w|, 6 * 2^-126)`` - the floor keeps zero blocks valid: they get scale
      2^-126 (byte 1) and all-zero codes.
    * ``scale = 2^e``, e the smallest integer with ``6 * 2^e >= amax`` (= ceil(log2(amax/6)), exact).
    * ``code = round_to_fp4_codes(w / scale)`` - nearest grid value, ties to the even code.

    Raises:
        QuantFormatError: non-float input, odd last dim, or NaN / inf entries.
    """
    if not w.is_floating_point() or w.dim() < 1:
        raise QuantFormatError(f"{tensor_label(name)}: expected a floating [..., in] tensor, found {w.dtype}")
    if w.shape[-1] % 2:
        raise QuantFormatError(f"{tensor_label(name)}: FP4 needs an even last dim, found {tuple(w.shape)}")
    wf = w.to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise QuantFormatError(f"{tensor_label(name)}: weight holds NaN or inf; cannot quantise")
    in_ = wf.shape[-1]
    nb = -(-in_ // block)
    amax = F.pad(wf.abs(), (0, nb * block - in_)).reshape(*wf.shape[:-1], nb, block).amax(dim=-1)
    amax = amax.clamp(min=FP4_MAX * 2.0**-126)
    e = _ceil_log2_over_6(amax).clamp(-127, 127)
    sbytes = (e + 127).to(torch.uint8)
    s = e8m0_to_float(sbytes, name).repeat_interleave(block, dim=-1)[..., :in_]
    codes = round_to_fp4_codes(wf / s)
    return pack_fp4(codes, name), sbytes


__all__ = [
    "FP4_BLOCK",
    "FP4_MAGNITUDES",
    "FP4_MAX",
    "dequant_fp4",
    "fp4_codes_to_float",
    "pack_fp4",
    "quant_fp4",
    "round_to_fp4_codes",
    "unpack_fp4",
]
