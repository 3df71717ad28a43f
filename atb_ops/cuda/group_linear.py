"""CUDA ``group_linear``: one cuBLAS strided-batched GEMM that writes the token-major output in place.

out[t, g] = x[t, g] @ w[g]^T for x [T, G, K], w [G, N, K] of one 16-bit dtype. The reference's einsum computes
the same batched GEMM over the groups but returns a group-major result viewed token-major (strides [N, T*N, 1]),
which the next consumer copies to flatten it (DeepSeek-V4's ``wo_b(z.flatten(1))``: a copy kernel per layer).
Here the GEMM's output of group g is written as columns [g*N, (g+1)*N) of the rows of a contiguous [T, G, N]
tensor (leading dimension G*N, batch stride N): no copy. Same operands and float32 accumulation as the
reference's bmm; mixed dtypes and float32 go to the reference.
"""

from __future__ import annotations

import torch

from .._registry import register
from ..reference.linear import group_linear as _reference


@register("group_linear", "cuda")
def group_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, G, K], w [G, N, K] (any strides) -> x.dtype [T, G, N], contiguous."""
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return _reference(x, w)
    t_count, g, _ = x.shape
    out = torch.empty(t_count, g, w.shape[1], dtype=x.dtype, device=x.device)
    if out.numel():
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out
