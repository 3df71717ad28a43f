"""The reductions of batch-invariant mode: row-blocked matmul, chunked batched matmul, chunked row sum.

Each primitive promises that one output row is a fixed function of that row's inputs alone:

- :func:`matmul` ``(a [M, K], b [N, K]) -> a @ b^T [M, N]``: row m does not depend on M or on the other rows;
- :func:`bmm` ``(a [B, M, K], b [B, N, K]) -> [B, M, N]`` (``a[i] @ b[i]^T``): entry (i, m, n) depends only on
  a[i, m] and b[i, n]: not on B, not on N, and not on zero columns appended to K (a ragged batch pads keys
  with zeros at the end); ``M`` must be a property of the op (heads), not of the batch;
- :func:`row_sum` ``(x [R, N]) -> [R]`` float32: not on R and not on zeros appended to N.

CPU (``reference`` backend): PyTorch calls whose shapes never depend on the batch, so the BLAS kernel,
its blocking and its thread split are always the same: :func:`matmul` pads M to whole blocks of
``BLOCK_M`` rows and runs one identical ``torch.mm`` per block (an [M, K] GEMM instead takes a different
kernel for M = 1, M < 4 and for the thread partition's tail rows; a batched call over the blocks changed rows
with the number of blocks on another machine's BLAS at 2 threads); products with fewer than ``SMALL_M`` rows
per matrix (GEMV kernels, whose order over K changed with K-padding there) multiply and reduce with
:func:`row_sum`; :func:`bmm` pads N to a multiple of ``BLOCK_N`` (narrower
products take other kernels: measured, N < 12 differs) and relies on the BLAS adding the trailing zeros of a
K-padded product exactly (no K split: a per-matrix GEMM of these sizes runs K in one pass); :func:`row_sum` sums
``SUM_CHUNK`` elements with one fixed-length reduction and adds the chunks in order. Invariance of these
shapes' kernels is checked on random inputs by ``tests/ops/test_batch_invariant.py`` (1, 2 and 4 threads):
these rest on the BLAS treating identical calls alike, which a test can confirm only for the machine it runs on.

CUDA: Triton kernels with fixed tiles, one program per output tile, a sequential K loop, no split-K
(:mod:`atb_ops.cuda.invariant_kernels`). Another device (or CUDA without triton) runs the CPU strategy on
that device, which is only as invariant as that device's kernels for fixed shapes: logged once.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from .._selection import selected_backend
from .kernel_table import KERNELS as _kernels, register_primitive  # noqa: F401  (re-exported)

BLOCK_M = 16
BLOCK_N = 16
SMALL_M = 4
SUM_CHUNK = 64

log = logging.getLogger("atb_ops")
_loaded = False
_warned: set[str] = set()


def _kernel(name: str, t: torch.Tensor) -> Callable | None:
    global _loaded
    backend = selected_backend(t)
    if backend == "reference":
        return None
    if backend == "cuda" and not _loaded:
        _loaded = True
        try:
            from ..cuda import invariant_kernels  # noqa: F401  (needs triton)
        except ImportError:
            pass
    fn = _kernels.get(backend, {}).get(name)
    if fn is None and backend not in _warned:
        _warned.add(backend)
        log.warning("atb_ops batch-invariant mode: no %s kernels for %s, using fixed-shape PyTorch calls on the "
                    "device (invariant only as far as that device's kernels are for fixed shapes)", backend, name)
    return fn


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    extra = -n % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T with a [M, K], b [N, K] of one dtype; the result in that dtype, accumulated in float32 (16-bit
    inputs: one rounding of the float32 result). Row m of the result depends only on a[m] and b."""
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: operands must share a dtype, got {a.dtype} and {b.dtype}")
    fn = _kernel("matmul", a)
    if fn is not None:
        return fn(a, b)
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros((m, n))
    out_dtype = a.dtype
    # 16-bit operands are widened (exactly) and multiplied in float32, then rounded once: one code path to check
    # (16-bit CPU GEMMs go through oneDNN kernels that differ by CPU), and on CPUs without bf16 units much faster
    a, b = a.float(), b.float()
    ap = _pad_to(a.contiguous(), 0, BLOCK_M)
    bt = b.t()
    # one identical [BLOCK_M, K] x [K, N] call per block: the same kernel, blocking and thread split every time
    # (a single batched call over the blocks is parallelised over the blocks or inside each GEMM depending on
    # their number, which changes the rows' results on some BLAS builds)
    out = torch.cat([torch.mm(ap[i:i + BLOCK_M], bt) for i in range(0, ap.shape[0], BLOCK_M)])
    return out[:m].to(out_dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[i] @ b[i]^T with a [B, M, K], b [B, N, K] float32 -> [B, M, N] float32 (see the module docstring).

    ``b`` may be a transposed view (values [B, K, N] passed as ``v.transpose(1, 2)``). Callers that pad N
    to a multiple of ``BLOCK_N`` themselves (ragged key lists, when they gather them) spare the CPU a copy.
    """
    a, b = a.float(), b.float()
    fn = _kernel("bmm", a)
    if fn is not None:
        return fn(a, b)
    bsz, m, k = a.shape
    n = b.shape[1]
    if bsz == 0 or m == 0 or n == 0 or k == 0:
        return a.new_zeros((bsz, m, n))
    if m < SMALL_M:
        # matrix-vector shapes take GEMV kernels whose order over K changes with K: multiply and reduce with
        # the chunked row sum instead (fixed order by construction)
        prod = a.unsqueeze(2) * b.unsqueeze(1)  # [B, M, N, K]
        return row_sum(prod.reshape(-1, k)).view(bsz, m, n)
    a = a.contiguous()
    b = _pad_to(b, 1, BLOCK_N)
    bt = b.transpose(1, 2)
    if not bt.is_contiguous():  # one layout per call site: [B, N, K] rows or a [B, K, N] values view
        b = b.contiguous()
        bt = b.transpose(1, 2)
    return torch.bmm(a, bt)[:, :, :n]


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of x [R, N] in float32 -> [R] (see the module docstring)."""
    x = x.float().contiguous()  # a strided view would take another reduction kernel
    fn = _kernel("row_sum", x)
    if fn is not None:
        return fn(x)
    r, n = x.shape
    if r == 0 or n == 0:
        return x.new_zeros((r,))
    xp = _pad_to(x, 1, SUM_CHUNK)
    parts = xp.view(r, -1, SUM_CHUNK).sum(-1)  # [R, chunks], one fixed-length reduction each
    acc = parts[:, 0]
    for c in range(1, parts.shape[1]):
        acc = acc + parts[:, c]
    return acc
