"""Small helpers shared by the Triton kernel modules."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def tl_dtype(dtype: torch.dtype):
    """The triton element type of a torch float dtype (for in-kernel casts)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dot_precision(*dtypes: torch.dtype) -> str:
    """``ieee`` when any operand is float32 (exact float32 products, matching the reference numerics),
    else ``tf32`` (ignored for 16-bit operands, which multiply exactly into the float32 accumulator)."""
    return "ieee" if torch.float32 in dtypes else "tf32"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed 8 on the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# Triton's CPU interpreter multiplies 16-bit dot operands wrongly (seen with triton 3.6 and 3.9): there,
# dots run on float32 copies of the operands (exact for bf16/fp16 inputs, so the results are unchanged).
DOT_F32 = tl.constexpr(INTERPRET)


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """tl.dot(a, b) with float32 accumulation (float32 operands under the interpreter)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)
