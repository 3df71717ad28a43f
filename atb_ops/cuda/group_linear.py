"""CUDA ``group_linear``: one cuBLAS strided-batched GEMM that writes the token-major output in place.

out[t, g] = x[t, g] @ w[g]^T for x [T, G, K], w [G, N, K] of one 16-bit dtype. The reference's einsum computes
the same batched GEMM over the groups but returns a group-major result viewed token-major (strides [N, T*N, 1]),
which the next consumer copies to flatten it (DeepSeek-V4's ``wo_b(z.flatten(1))``: a copy kernel per layer).
Here the GEMM's output of group g is written as columns [g*N, (g+1)*N) of the rows of a contiguous [T, G, N]
tensor (leading dimension G*N, batch stride N): no copy. Same operands and float32 accumulation as the
reference's bmm; mixed dtypes and float32 go to the reference.

FP8 weights (``fmt="fp8_block"``, DeepSeek-V4's ``wo_a`` stored back in FP8 with ``ASCEND_DSV4_WO_A_FP8=1``): up to
32 tokens and E8M0 scales in one launch of :mod:`.fp8_gemv` over all groups (half the bytes of the BF16 weight; the
same products, E8M0 block scales being powers of two; H200, Flash's 8 x 1024 x 4096 at 1 / 8 / 16 / 24 / 32 tokens:
12.2 / 13.6 / 15.0 / 20.3 / 24.3 us against cuBLAS BF16's 18.7-19.7, scripts/bench_results/h200_session38.txt); more
tokens: the weight dequantised to BF16 in one exact pass (:mod:`.dequant_bf16`, E8M0 scales) and the GEMM above
(48.8 us at 64 tokens against 21.1: why the FP8 storage is not the default); otherwise the reference's dequantised
matrix and the GEMM.
"""

from __future__ import annotations

import torch

from .._registry import register
from ..reference.linear import group_linear as _reference, group_weight
from . import dequant_bf16, fp8_gemv


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t_count, g, _ = x.shape
    out = torch.empty(t_count, g, w.shape[1], dtype=x.dtype, device=x.device)
    if out.numel():
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


@register("group_linear", "cuda")
def group_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                 fmt: str = "dense") -> torch.Tensor:
    """x [T, G, K], w [G, N, K] (any strides; e4m3 with w_scale [G, N/128, K/128] for ``fp8_block``) -> x.dtype
    [T, G, N], contiguous."""
    if fmt == "fp8_block":
        # (E8M0 scales only: a float32-scaled weight stands for its BF16-rounded dequantised matrix, which the
        # kernel's float32 products of the unrounded values would not give)
        if (x.dtype == torch.bfloat16 and w_scale is not None and w_scale.dtype != torch.float32
                and fp8_gemv.group_eligible(x, w, w_scale) and fp8_gemv.available(x.device)):
            return fp8_gemv.group_linear(x, w, w_scale)
        if (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] and w.shape[0] and w.shape[1] % 128 == 0
                and dequant_bf16.eligible(w[0], w_scale[0])):
            g, n, k = w.shape
            wd = dequant_bf16.dequant_fp8_bf16(w.reshape(g * n, k), w_scale.reshape(-1, w_scale.shape[-1]))
            return _bmm(x, wd.view(g, n, k))
        w = group_weight(w, w_scale, fmt, x.dtype)  # the reference's dense matrix, then the dense path
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return _reference(x, w)
    return _bmm(x, w)
