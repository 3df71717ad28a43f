"""FP8-e4m3 weights with one scale per 128x128 block (DeepSeek-V3 / V4 ``weight_block_size`` [128, 128]).

Layout (ascend_dsv4/models/deepseek_v4/README.md §3.2, DeepSeek-V3 weight format notes)::

    Wq    : torch.float8_e4m3fn  [..., out, in]
    S     : float32 ("weight_scale_inv")  or  E8M0 (uint8 / torch.float8_e8m0fnu, V4 ".scale")
            [..., ceil(out/b), ceil(in/b)]
    W[i, j] = float(Wq[i, j]) * S[i // b, j // b]        (b = block, default 128)

Blocks at the right / bottom edge that are not full are the zero-padded remainder of a
128x128 block: they use the scale of the block they start, and the padding is not stored.

The decoding multiplies in float32 (an e4m3 value times a float32 scale, correctly rounded)
and then casts to the requested dtype, so ``dtype=torch.float32`` gives the exact products
whenever the scale is a power of two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quant.e8m0 import e8m0_to_float, is_e8m0
from quant.errors import QuantFormatError, tensor_label

FP8_BLOCK = 128
E4M3_MAX = 448.0


def fp8_block_scale_shape(out: int, in_: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the scale grid of an ``[out, in_]`` weight: ``(ceil(out/block), ceil(in_/block))``."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    return (-(-int(out) // block), -(-int(in_) // block))


def scale_to_float(scale: torch.Tensor, name: str = "") -> torch.Tensor:
    """Decode a block scale tensor to float32.

    E8M0 (``uint8`` / ``float8_e8m0fnu``) -> ``2^(b-127)`` (byte 255 rejected); floating dtypes
    -> float32, rejecting NaN, +-inf and negative entries. Other dtypes raise :class:`QuantFormatError`.
    """
    if is_e8m0(scale):
        return e8m0_to_float(scale, name)
    if not scale.is_floating_point():
        raise QuantFormatError(
            f"{tensor_label(name)}: scale dtype {scale.dtype} is neither float nor E8M0 (uint8 / float8_e8m0fnu)"
        )
    s = scale.to(torch.float32)
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if s.dim() else ()
        val = float(s[idx]) if s.dim() else float(s)
        raise QuantFormatError(
            f"{tensor_label(name)}: scale {val!r} at index {idx} is not a finite non-negative number "
            f"({int(bad.sum())} bad of {s.numel()})"
        )
    return s


def _expand_blocks(s: torch.Tensor, out: int, in_: int, block: int) -> torch.Tensor:
    """[..., ceil(out/b), ceil(in/b)] -> [..., out, in] by repeating each entry over its block and cropping."""
    return s.repeat_interleave(block, dim=-2)[..., :out, :].repeat_interleave(block, dim=-1)[..., :in_]


def dequant_fp8_block(
    w: torch.Tensor,
    scale: torch.Tensor,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "",
) -> torch.Tensor:
    """Dequantise a block-scaled FP8 weight.

    Args:
        w: ``torch.float8_e4m3fn [..., out, in]`` (leading dims, e.g. stacked experts, allowed).
        scale: float32 (any float dtype) or E8M0 (``uint8`` / ``torch.float8_e8m0fnu``),
            ``[..., ceil(out/block), ceil(in/block)]`` with the same leading dims as ``w``.
        block: block edge (128 for DeepSeek checkpoints).
        dtype: output dtype.
        name: checkpoint key of the weight, used in error messages.

    Returns:
        ``[..., out, in]`` tensor of ``dtype``: ``W[i, j] = float(Wq[i, j]) * S[i // block, j // block]``
        computed in float32, then cast.

    Raises:
        QuantFormatError: ``w`` is not e4m3 or not at least 2-D, the scale grid shape does not match
        (message names the tensor, expected and found shapes), or a scale is NaN / inf / negative
        (E8M0 byte 255).
    """
    if w.dtype != torch.float8_e4m3fn:
        raise QuantFormatError(f"{tensor_label(name)}: expected torch.float8_e4m3fn weight, found {w.dtype}")
    if w.dim() < 2:
        raise QuantFormatError(f"{tensor_label(name)}: expected a [..., out, in] weight, found shape {tuple(w.shape)}")
    out, in_ = w.shape[-2], w.shape[-1]
    expected = tuple(w.shape[:-2]) + fp8_block_scale_shape(out, in_, block)
    if tuple(scale.shape) != expected:
        raise QuantFormatError(
            f"{tensor_label(name)}: scale grid shape mismatch for weight {tuple(w.shape)} with block {block}: "
            f"expected {expected}, found {tuple(scale.shape)}"
        )
    s = scale_to_float(scale, name)
    return (w.to(torch.float32) * _expand_blocks(s, out, in_, block)).to(dtype)


def _ceil_log2_over_448(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with 448 * 2^e >= amax (amax > 0), computed exactly from the binary exponent.

    With amax = m * 2^E (m in [0.5, 1)) and 448 = 0.875 * 2^9: e = E - 9 if m <= 0.875 else E - 8.
    This equals ceil(log2(amax / 448)) in exact arithmetic, avoiding the rounding of the division.
    """
    m, e = torch.frexp(amax.to(torch.float32))
    e = e.to(torch.int32)
    return torch.where(m <= 0.875, e - 9, e - 8)


def quant_fp8_block(
    w: torch.Tensor,
    block: int = FP8_BLOCK,
    scale_fmt: str | None = "ue8m0",
    name: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight to FP8-e4m3 with one scale per ``block x block`` block.

    Args:
        w: float tensor ``[..., out, in]`` (any float dtype; math in float32).
        block: block edge (default 128).
        scale_fmt: ``"ue8m0"`` -> power-of-two scales returned as E8M0 ``uint8``;
            ``None`` -> float32 scales (the DeepSeek-V3 ``weight_scale_inv`` style).
        name: tensor name for error messages.

    Returns:
        ``(w_fp8, scale)``: ``torch.float8_e4m3fn [..., out, in]`` and the scale grid
        ``[..., ceil(out/block), ceil(in/block)]`` (``uint8`` E8M0 or float32).

    Rule, per block (a partial edge block is zero-padded conceptually, so its amax is the amax of
    its real elements):

    * ``amax = max |w|`` over the block.
    * ``amax == 0``: scale = 1.0 (E8M0 byte 127); the block quantises to zeros.
    * ``"ue8m0"``: scale = 2^e with e the smallest integer such that 448 * 2^e >= amax
      (= ceil(log2(amax / 448)), computed exactly), clamped to e >= -127 (the E8M0 minimum).
    * ``None``: scale = amax / 448 in float32, floored at 2^-126 (the smallest normal float32) so that
      the division stays accurate for tiny blocks.
    * ``w_fp8 = e4m3(clamp(w / scale, -448, 448))`` (round-to-nearest-even cast).

    Guarantees: per element, ``|dequant - w| <= 2^-4 * amax_block`` (e4m3 has 3 mantissa bits; the
    subnormal step 2^-9 * scale is below that as amax/scale > 224 for ue8m0). If ``w`` is already
    ``fp8 * 2^k`` per block (with k >= -127 and the product a normal float32), ``"ue8m0"`` reproduces it
    exactly: the new scale is 2^k / 2^m with ``q * 2^m <= 448`` still an e4m3 value.

    Raises:
        QuantFormatError: ``w`` is not floating point, not at least 2-D, or holds NaN / inf.
    """
    if scale_fmt not in ("ue8m0", None):
        raise ValueError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    if not w.is_floating_point() or w.dim() < 2:
        raise QuantFormatError(
            f"{tensor_label(name)}: expected a floating [..., out, in] weight, found {w.dtype} {tuple(w.shape)}"
        )
    wf = w.to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise QuantFormatError(f"{tensor_label(name)}: weight holds NaN or inf; cannot quantise")
    out, in_ = wf.shape[-2], wf.shape[-1]
    ob, ib = fp8_block_scale_shape(out, in_, block)
    lead = tuple(wf.shape[:-2])
    padded = F.pad(wf.abs(), (0, ib * block - in_, 0, ob * block - out))
    amax = padded.reshape(*lead, ob, block, ib, block).amax(dim=(-3, -1))  # [..., ob, ib]
    zero = amax == 0
    if scale_fmt == "ue8m0":
        e = _ceil_log2_over_448(torch.where(zero, torch.ones_like(amax), amax)).clamp(min=-127, max=127)
        e = torch.where(zero, torch.zeros_like(e), e)
        scale_bytes = (e + 127).to(torch.uint8)
        s = e8m0_to_float(scale_bytes, name)
        scale_out = scale_bytes
    else:
        s = torch.where(zero, torch.ones_like(amax), (amax / E4M3_MAX).clamp(min=math.ldexp(1.0, -126)))
        scale_out = s
    q = (wf / _expand_blocks(s, out, in_, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale_out


__all__ = [
    "E4M3_MAX",
    "FP8_BLOCK",
    "dequant_fp8_block",
    "fp8_block_scale_shape",
    "quant_fp8_block",
    "scale_to_float",
]
