"""Triton kernels of the batch-invariant primitives (:mod:`atb_ops.invariant.primitives`) for CUDA.

One program computes one fixed ``BLOCK_M x BLOCK_N`` output tile with a sequential loop over K in
``BLOCK_K`` steps accumulating in float32 (no split-K, no autotuning, no stream-K): every output element is
reduced in the same order whatever the batch size M, the number of columns N, or how far K was padded with
zeros at its end (trailing zero tiles add exact zeros). The row sum keeps one float32 accumulator vector of
``SUM_BLOCK`` lanes per row, adds the row's blocks in order and reduces the vector once with a fixed tree.
Integer shape and stride arguments are never specialised (``do_not_specialize``), so one compiled kernel
serves every batch size: Triton otherwise compiles a separate variant for arguments equal to 1 or divisible
by 16, which may differ in code generation.

Float32 operands multiply in IEEE float32 (``input_precision="ieee"``, no TF32), 16-bit operands on the
tensor cores with float32 accumulation. These kernels favour a fixed order over speed: the cost is measured
by ``scripts/batch_invariance.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..invariant.kernel_table import register_primitive
from ._util import pdl, pdl_wait

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
SUM_BLOCK = 256
# Triton's interpreter multiplies 16-bit tiles wrongly: there the dots take float32 copies (exact widening)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTS = ["M", "N", "K", "n_m", "n_n", "sab", "sam", "sak", "sbb", "sbn", "sbk", "scb", "scm", "scn"]


@triton.jit(do_not_specialize=_INTS)
def _bmm_kernel(a, b, c, M, N, K, n_m, n_n, sab, sam, sak, sbb, sbn, sbk, scb, scm, scn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid = tl.program_id(0).to(tl.int64)
    bid = pid // (n_m * n_n)
    rest = pid % (n_m * n_n)
    rm = (rest // n_n) * BM + tl.arange(0, BM)
    rn = (rest % n_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = a + bid * sab + rm[:, None] * sam + rk[None, :] * sak
    b_ptr = b + bid * sbb + rn[None, :] * sbn + rk[:, None] * sbk  # a [BK, BN] tile of b^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kin = (k0 + rk) < K
        at = tl.load(a_ptr, mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        bt = tl.load(b_ptr, mask=kin[:, None] & (rn[None, :] < N), other=0.0)
        if F32DOT:
            acc += tl.dot(at.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(at, bt)
        a_ptr += BK * sak
        b_ptr += BK * sbk
    c_ptr = c + bid * scb + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c_ptr, acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["N", "stride"])
def _row_sum_kernel(x, out, N, stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        acc += tl.load(x + row * stride + start + cols, mask=(start + cols) < N, other=0.0).to(tl.float32)
    tl.store(out + row, tl.sum(acc, axis=0))


def _launch_bmm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, batch_strides: tuple[int, int, int]) -> None:
    """c[i] = a[i] @ b[i]^T for 3-d views a [B, M, K], b [B, N, K], c [B, M, N] (any strides)."""
    bsz, m, k = a.shape
    n = b.shape[1]
    if bsz == 0 or m == 0 or n == 0:
        return
    n_m, n_n = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    f32dot = torch.float32 in (a.dtype, b.dtype) or _INTERPRET
    sab, sbb, scb = batch_strides
    _bmm_kernel[(bsz * n_m * n_n,)](
        a, b, c, m, n, k, n_m, n_n, sab, a.stride(1), a.stride(2), sbb, b.stride(1), b.stride(2),
        scb, c.stride(1), c.stride(2), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, F32DOT=f32dot, num_warps=4, **pdl())


@register_primitive("matmul", "cuda")
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if k == 0:
        return c.zero_()
    _launch_bmm(a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0), (0, 0, 0))
    return c


@register_primitive("bmm", "cuda")
def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bsz, m, k = a.shape
    n = b.shape[1]
    c = torch.empty((bsz, m, n), dtype=out_dtype, device=a.device)
    if k == 0:
        return c.zero_()
    _launch_bmm(a, b, c, (a.stride(0), b.stride(0), c.stride(0)))
    return c


@register_primitive("row_sum", "cuda")
def row_sum(x: torch.Tensor) -> torch.Tensor:
    r, n = x.shape
    out = torch.zeros((r,), dtype=torch.float32, device=x.device)
    if r == 0 or n == 0:
        return out
    x = x.contiguous()
    _row_sum_kernel[(r,)](x, out, n, x.stride(0), BLOCK=SUM_BLOCK, num_warps=4, **pdl())
    return out
