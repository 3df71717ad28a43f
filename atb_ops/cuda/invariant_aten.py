"""Batch-invariant ``aten::mm`` / ``aten::bmm`` / ``aten::addmm`` on CUDA, for matmuls outside atb_ops.

cuBLAS picks its kernel (tile shape, split-K, stream-K) from the problem size, so a row's result changes
with the number of rows. Inside atb_ops, batch-invariant mode routes every product through the fixed-tile
Triton kernels of :mod:`.invariant_kernels`; the few products that model code computes with plain PyTorch
(e.g. DeepSeek-V4's grouped output projection ``einsum("tgk,grk->tgr")``, V3's absorbed-MLA einsums) reach
cuBLAS through these aten ops. :func:`enable` overrides them for the CUDA dispatch key of the whole process
(what ``LLM(batch_invariant=True)`` does on a CUDA device, as Thinking Machines' batch_invariant_ops library
does); :func:`disable` restores cuBLAS.
"""

from __future__ import annotations

import logging
import warnings

import torch

from . import invariant_kernels as K

log = logging.getLogger("atb_ops")
_lib: torch.library.Library | None = None


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a [M, K] @ b [K, N]: the kernel takes b as [N, K] (a transposed view; any strides)
    if a.dtype != b.dtype:
        raise RuntimeError(f"mm: expected operands of one dtype, got {a.dtype} and {b.dtype}")
    return K.matmul(a, b.t())


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != b.dtype:
        raise RuntimeError(f"bmm: expected operands of one dtype, got {a.dtype} and {b.dtype}")
    return K.bmm(a, b.transpose(1, 2), out_dtype=a.dtype)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = _mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias * beta if beta != 1 else bias) if beta != 0 else out


def enable(dispatch_key: str = "CUDA") -> None:
    """Route ``mm``, ``bmm`` and ``addmm`` of this process's CUDA tensors through the batch-invariant kernels
    (``dispatch_key="CPU"``: CPU tensors, for tests under Triton's interpreter)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("mm", _mm, dispatch_key)
        lib.impl("bmm", _bmm, dispatch_key)
        lib.impl("addmm", _addmm, dispatch_key)
    _lib = lib
    log.info("batch-invariant mode: CUDA mm/bmm/addmm run the fixed-tile Triton kernels")


def disable() -> None:
    """Give ``mm``, ``bmm`` and ``addmm`` back to cuBLAS."""
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None


def enabled() -> bool:
    return _lib is not None
