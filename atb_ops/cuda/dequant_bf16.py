"""FP8-block weights with E8M0 scales dequantised to bfloat16 in one pass, for prefill-sized linears on cuBLAS.

W[n, k] = e4m3[n, k] * 2^(s[n // 128, k // 128] - 127), w float8_e4m3fn [N, K], s uint8 (E8M0)
[ceil(N / 128), ceil(K / 128)] -> bfloat16 [N, K]. An e4m3 value (4 significant bits) times a power of two is a
bfloat16 value, so the result is exact wherever it lies in bfloat16's range (scale bytes >= 3; the quantiser
derives them from block maxima, ~127 + log2(amax / 448)). One read of the FP8 bytes and one write of the bfloat16
ones: 4096 x 4096 moves 50 MB, ~13 us at the H200's copy bandwidth.

Why (session 20, H200, scripts/bench_results/h200_session20.txt): a 4096 x 4096 FP8 linear of 512 rows took
98.3 us in the tiled kernel against 27.2 us for cuBLAS BF16 on the same shape; dequantising first and calling
cuBLAS (``gemm.linear``, rows >= :data:`.gemm.DQ_LINEAR_ROWS`) took 37.3 us (256 / 2048 rows: 65.1 / 265.6 ->
27.3 / 106.0 us; at 128 rows no faster than the tiled kernel). Float32 scales (not powers of two) keep the fused
kernels: their products in bfloat16 would round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm_decode as gd
from ._util import pdl_wait, pdl


def eligible(w: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    """float8_e4m3fn weights [N, K] with E8M0 block scales (uint8 or float8_e8m0fnu)."""
    return (w.dtype == torch.float8_e4m3fn and w.dim() == 2 and w_scale is not None
            and (w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype)))


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, KB, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, j): rows [i BN, (i + 1) BN) x columns [j BK, (j + 1) BK) (BN, BK divide 128: one scale)."""
    pdl_wait(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (n < N)[:, None] & (k < K)[None, :]
    off = n.to(tl.int64)[:, None] * K + k[None, :]
    w = tl.load(w_ptr + off, mask=m, other=0.0).to(tl.float32)
    sc = gd._e8m0_f32(tl.load(s_ptr + (tl.program_id(0) * BN // 128) * KB + tl.program_id(1) * BK // 128))
    tl.store(out_ptr + off, (w * sc).to(tl.bfloat16), mask=m)


def dequant_fp8_bf16(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] of an fp8_block weight with E8M0 scales (:func:`eligible`)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    if n == 0 or k == 0:
        return out
    s = w_scale.contiguous().view(torch.uint8)
    bn, bk = 64, 128
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](w.contiguous(), s, out, n, k, s.shape[-1], BN=bn, BK=bk,
                                                              num_warps=4, **pdl())
    return out
