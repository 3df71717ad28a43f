"""E8M0 (unsigned exponent-only) scale codec.

Format (ascend_dsv4/models/deepseek_v4/README.md §3.2): one byte ``b`` holds the power of two ``2^(b-127)``;
``b = 255`` is NaN and is rejected here. There is no sign, no mantissa and no
zero: the smallest value is ``2^-127`` (byte 0), the largest ``2^127`` (byte 254).

On disk these are ``F8_E8M0`` tensors; torch loads them as ``torch.float8_e8m0fnu``.
This module accepts either that dtype or the raw bytes as ``torch.uint8`` and
converts between the two with zero-copy ``.view`` calls.

All conversions are exact: ``2^(b-127)`` is representable in float32 for every
``b`` in 0..254 (``2^-127`` as a float32 subnormal), and it is built from its bit
pattern rather than through ``exp2``.
"""

from __future__ import annotations

import torch

from quant.errors import QuantFormatError, tensor_label

E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def is_e8m0(t: torch.Tensor) -> bool:
    """True when ``t`` is an E8M0 tensor: dtype ``torch.float8_e8m0fnu`` or ``torch.uint8``."""
    return t.dtype == torch.uint8 or (E8M0_DTYPE is not None and t.dtype == E8M0_DTYPE)


def as_uint8(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """View an E8M0 tensor as its raw bytes.

    ``float8_e8m0fnu [...]`` -> ``uint8 [...]`` via ``.view`` (no copy); a ``uint8``
    tensor is returned as is. Any other dtype raises :class:`QuantFormatError`.
    """
    if t.dtype == torch.uint8:
        return t
    if E8M0_DTYPE is not None and t.dtype == E8M0_DTYPE:
        return t.view(torch.uint8)
    raise QuantFormatError(
        f"{tensor_label(name)}: expected an E8M0 scale (torch.float8_e8m0fnu or uint8), found {t.dtype}"
    )


def as_e8m0(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """View raw ``uint8`` E8M0 bytes as ``torch.float8_e8m0fnu`` (no copy); the inverse of :func:`as_uint8`."""
    if E8M0_DTYPE is None:  # pragma: no cover - torch always has it in the supported range
        raise QuantFormatError(f"{tensor_label(name)}: this torch has no float8_e8m0fnu dtype")
    return as_uint8(t, name).view(E8M0_DTYPE)


def check_e8m0(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """Return the ``uint8`` view of ``t`` after rejecting NaN bytes (255) with :class:`QuantFormatError`."""
    b = as_uint8(t, name)
    bad = b == E8M0_NAN
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0]) if b.dim() else ()
        raise QuantFormatError(
            f"{tensor_label(name)}: E8M0 scale byte 255 (NaN) at index {idx} "
            f"({int(bad.sum())} of {b.numel()} entries); validators reject NaN scales"
        )
    return b


def e8m0_to_float(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """Decode E8M0 scales to float32.

    Args:
        t: ``uint8`` or ``torch.float8_e8m0fnu`` tensor, any shape.
        name: tensor / checkpoint key, used in error messages.

    Returns:
        float32 tensor of the same shape, ``out = 2^(b - 127)`` exactly.

    Raises:
        QuantFormatError: wrong dtype, or any byte equals 255 (NaN).
    """
    b = check_e8m0(t, name).to(torch.int32)
    # float32 bit pattern of 2^(b-127): exponent field b for b >= 1; 2^-127 is the subnormal 0x00400000.
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    return bits.view(torch.float32)


def float_to_e8m0(x, name: str = "") -> torch.Tensor:
    """Encode exact positive powers of two as E8M0 bytes.

    Args:
        x: tensor (any float dtype, or already E8M0) or Python number(s); every entry must be
            exactly ``2^k`` with ``-127 <= k <= 127``.
        name: tensor / checkpoint key, used in error messages.

    Returns:
        ``uint8`` tensor of the same shape, ``b = k + 127``.

    Raises:
        QuantFormatError: an entry is not positive, not finite, not a power of two or out of range.
    """
    if isinstance(x, torch.Tensor) and is_e8m0(x):
        return check_e8m0(x, name).clone()
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    x = x.to(torch.float64)  # every float32/bf16/fp16 value is exact in float64
    mant, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    k = exp.to(torch.int64) - 1
    ok = torch.isfinite(x) & (x > 0) & (mant == 0.5) & (k >= -E8M0_BIAS) & (k <= E8M0_BIAS)
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        idx = tuple(int(i) for i in bad[0]) if x.dim() else ()
        val = float(x[idx]) if x.dim() else float(x)
        raise QuantFormatError(
            f"{tensor_label(name)}: value {val!r} at index {idx} is not a power of two in [2^-127, 2^127] "
            f"({bad.shape[0]} of {x.numel()} entries); E8M0 holds only such values"
        )
    return (k + E8M0_BIAS).to(torch.uint8)


__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "as_e8m0",
    "as_uint8",
    "check_e8m0",
    "e8m0_to_float",
    "float_to_e8m0",
    "is_e8m0",
]
