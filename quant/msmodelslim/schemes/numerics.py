"""Integer-range checks and the activation quantisers of the msModelSlim linears: the NPU's per-token dynamic
quantisation and msModelSlim's two simulations of it (``README.md`` §7)."""

from __future__ import annotations

import torch

from quant.errors import QuantFormatError

INT32_MAX = 2**31 - 1


def int32_accumulator_bound(k: int, quant_bias_absmax: int = 0) -> int:
    """Largest |partial sum| an int8 x int8 dot product of length ``k`` (plus ``quant_bias``) can reach.

    Each product is at most 128 * 128 in magnitude (int8 activations times int8 weights, or int4 weights minus an
    int4 zero point), so every prefix of the sum, in any order, is bounded by ``k * 16384 + |quant_bias|``. When this
    is ``<= 2^31 - 1`` no int32 intermediate can overflow. (Every accumulator the int path forms is also checked.)
    """
    return k * 128 * 128 + abs(int(quant_bias_absmax))


def check_int32(t: torch.Tensor, what: str) -> None:
    if t.numel() and int(t.abs().max()) > INT32_MAX:
        raise OverflowError(f"{what}: integer accumulator {int(t.abs().max())} exceeds the NPU's int32 range")


def round_clamp(v: torch.Tensor) -> torch.Tensor:
    return v.round().clamp(-128, 127)


def dynamic_quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_dynamic_quant``: float32 ``x [M,k]`` -> (int64 ``q [M,k]``, float32 ``s_t [M]``), ``s_t = max|x|/127``.

    Rows of zeros get ``s_t = 0`` and ``q = 0`` (the NPU golden divides by zero there).
    """
    s = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = round_clamp(x / safe.unsqueeze(-1)).to(torch.int64)
    return q, s


def fake_quant_asym_per_token(x: torch.Tensor) -> torch.Tensor:
    """msModelSlim v0 dynamic simulation: asymmetric per-token int8 (the calibration formula per token)."""
    lo = torch.clamp(x.amin(dim=-1, keepdim=True), max=0.0)
    hi = torch.clamp(x.amax(dim=-1, keepdim=True), min=0.0)
    s = (hi - lo) / 255.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    o = torch.round(-lo / s) - 128
    return (round_clamp(x / s + o) - o) * s


def fake_quant_sym_per_input_channel(x: torch.Tensor) -> torch.Tensor:
    """msModelSlim 26.1.0 v1 dynamic simulation: symmetric, statistics per input channel over tokens (dim 0)."""
    s = x.abs().amax(dim=0, keepdim=True) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return round_clamp(x / s) * s


def as_f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32)


def integral(t: torch.Tensor, what: str) -> torch.Tensor:
    r = t.round()
    if not torch.equal(r, t):
        raise QuantFormatError(f"{what}: expected integral zero points, found non-integer values")
    return r
