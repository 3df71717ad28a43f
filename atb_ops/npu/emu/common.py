"""Helpers shared by the emulated torch_npu ops."""

from __future__ import annotations

import torch


class NotEmulated(NotImplementedError):
    """An argument or mode of a torch_npu op that the CPU emulation does not implement."""


def refuse(op: str, what: str) -> None:
    raise NotEmulated(f"torch_npu emulation: {op}: {what} is not emulated")


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """torch.round (half to even), as the op-plugin goldens round."""
    return torch.round(x)


# torch dtype <-> the int enum the torch_npu ``*_dtype`` keyword arguments take (torch ScalarType numbering)
DTYPE_ENUM = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
              torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}
ENUM_DTYPE = {v: k for k, v in DTYPE_ENUM.items()}


def enum_to_dtype(v, op: str, what: str) -> torch.dtype:
    if isinstance(v, torch.dtype):
        return v
    if v not in ENUM_DTYPE:
        refuse(op, f"{what}={v!r}")
    return ENUM_DTYPE[v]
