"""Triton linears over FP8-block and packed-FP4 weights, and the grouped (per-expert) matmul over sorted rows.

``_gemm_kernel`` computes out[rows] = x[rows] @ W^T with the weight dequantised in the kernel:

- ``dense``: W tile loaded in its dtype;
- ``fp8_block``: e4m3 tile converted exactly to the compute dtype; the 128x128 block scale (float32, or E8M0
  decoded in the kernel) multiplies the tile's partial product (BN and BK divide 128, so one scale per tile);
- ``fp4``: bytes split into low (element 2c) and high (element 2c+1) e2m1 codes, each decoded with its
  E8M0 scale folded into the exponent bits (exact in bfloat16), multiplied with the even / odd columns of x.

Accumulation is float32. For the grouped op, rows are sorted by expert (stable argsort) and cut into tiles
of BM rows that never cross an expert; the tile table (expert, first row, end row) is built on the device
with a static size ``ceil(M / BM) + min(E, M)`` (no host synchronisation; tiles past the end do nothing).
Dense ``linear`` stays on cuBLAS (torch.matmul), which is the ceiling for that case.

Decode-sized calls (bfloat16 activations, few rows per weight) over fp4 / fp8_block weights go to
:mod:`.gemm_decode` (one pass over the weight bytes, decoded with PTX bit operations, mma.sync on [rows, columns]
tiles) or :mod:`.gemm_tc` (swap-AB wgmma: weight rows as the MMA's M side, decoded in the A-operand registers)
instead, fp4 grouped (MoE) calls of up to :data:`FP4_MOE_MAX_ROWS` rows to the CUDA C kernels where they build and
apply (:mod:`.fp4_moe_f16` above :data:`F16_MOE_MIN_ROWS_PER_EXPERT` rows per expert, :mod:`.fp4_moe_mma` otherwise;
``ATB_CUDA_FP4_MOE=f16`` / ``=bf16``: one of them wherever it applies), else to the Triton kernel of
:mod:`.gemm_fp4_moe` (``=new``: that one only; ``=old``: the previous rules; the CUDA C kernel ran 1.14-1.36x as fast
at 8-64 tokens on a lent H200, scripts/bench_results/nccl_h200x4_session15.txt), and large grouped calls to
:mod:`.gemm_tc_large` (the same swap-AB MMA over rows sorted by expert, any row count). fp8_block linears with E8M0
scales of at least :data:`DQ_LINEAR_ROWS` rows that would go to the tiled kernel dequantise the weight to bfloat16
(exact, :mod:`.dequant_bf16`) and call cuBLAS. fp8_block linears of up to :data:`FP8_GEMV_MAX_ROWS` rows go to
:mod:`.fp8_gemv` (CUDA C: K split inside the block) where it builds. ``ATB_CUDA_GEMM`` = ``gemv`` / ``decode`` /
``tc`` / ``tcl`` / ``fp4moe`` /
``fp4mma`` / ``fp4f16`` / ``dq`` / ``tiled`` forces one path where it applies (benchmarks), ``auto`` (default)
selects by shape (:data:`TCL_GROUPED_MIN_ROWS`, :data:`TCL_LINEAR_ROWS`, :data:`TC_LINEAR_ROWS`,
:data:`TC_GROUPED_MIN_ROWS` / ``_MAX_ROWS``, :data:`DECODE_ROWS`, :data:`FP8_GEMV_MAX_ROWS`).

BF16-weight linears with a float32 output (``linear_float32_from_16bit``: DeepSeek-V4's compressor projections) of up to
:data:`FP8_GEMV_MAX_ROWS` rows and :data:`BF16_GEMV_MAX_N` columns go to :mod:`.fp8_gemv`'s BF16 form
(``ATB_CUDA_BF16_GEMV=0``: cuBLAS).

One module of about 550 lines: the routing of every fp8_block / fp4 linear and grouped matmul to its kernel module
(each rule beside the measurement that set it, so that one file shows the whole dispatch) and the tiled Triton
kernel that serves the rest; the kernels themselves live in their own modules.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._registry import register
from . import dequant_bf16, fp4_moe_f16, fp4_moe_mma, fp8_gemv, gemm_decode, gemm_fp4_moe, gemm_tc, gemm_tc_large
from .group_rows import tile_table
from .routing import stable_order
from ._util import INTERPRET, dot_precision, env_choice, mma, pow2, tl_dtype, pdl_wait, pdl

_FMT = {"dense": 0, "fp8_block": 1, "fp4": 2}

# rows per weight up to which the decode kernel is preferred to the tiled one (measured: kernels_fp4_h100.txt)
DECODE_ROWS = {"fp4": 64, "fp8_block": 16}

# where the swap-AB tensor-core kernel (gemm_tc.py) is preferred, checked before DECODE_ROWS (measured on the
# H100: scripts/bench_results/gemm_tc_h100.txt): linears of up to 64 rows (faster than the decode and tiled
# kernels at 1, 32 and 64 rows, fp8 and fp4); grouped calls of 17..384 rows with <= 16 rows per active expert
# (T = 8..64 tokens x 6 of 64 experts: faster than the decode kernel on both expert shapes; at one token decode is
# as fast or faster and stays; beyond that range the tc kernel was not measured)
TC_LINEAR_ROWS = 64
TC_GROUPED_MIN_ROWS = 17
TC_GROUPED_MAX_ROWS = 384

# where the sorted-rows tensor-core kernel (gemm_tc_large.py, path "tcl") is preferred, checked first (H100:
# gemm_h100_session4.txt): grouped calls of at least TCL_GROUPED_MIN_ROWS rows (T = 512 x 6 experts: 1.02-1.47x
# torch._grouped_mm bf16, 1.4-4.4x the tiled kernel; 385..1024 rows not measured: the old rules), and linears of up
# to TCL_LINEAR_ROWS[fmt] rows (fp4 at 1 / 32 / 64 rows: 5-9 % faster than tc in both runs; fp8 stays on tc)
TCL_GROUPED_MIN_ROWS = 1025
TCL_LINEAR_ROWS = {"fp4": 64}

# fp8_block linears (E8M0 scales, bfloat16 activations) of at least this many rows: the weight dequantised to bf16
# in one pass, then cuBLAS (H200: h200_session20.txt; ATB_CUDA_DQ_ROWS overrides, read at each call)
DQ_LINEAR_ROWS = 256

# fp4 MoE calls of more rows per expert go to fp4_moe_f16.py, the others to fp4_moe_mma.py (H200: 1.04-1.06x at 64
# tokens x top-6, 0.96-1.03x at 8-32, 7-18 % slower at one; scripts/bench_results/h200_session24.txt)
F16_MOE_MIN_ROWS_PER_EXPERT = 3

# fp4 MoE calls of up to this many rows go to the MoE kernels unless ATB_CUDA_FP4_MOE=old (fp4_moe_h100_session4.txt)
FP4_MOE_MAX_ROWS = 384
# fp8_block linears (bfloat16 activations) of up to this many rows go to fp8_gemv.py (K split inside the block; H200:
# 1.1-1.3x gemm_tc at 1-8 rows on the decode step's shapes, 0.84-1.05x at 16 with two token tiles, since dropped;
# scripts/bench_results/h200_session38.txt)
FP8_GEMV_MAX_ROWS = 8
GEMM_MODES = ("auto", "gemv", "decode", "tc", "tcl", "fp4moe", "fp4mma", "fp4f16", "dq", "tiled")  # ATB_CUDA_GEMM
FP4_MOE_IMPLS = ("mma", "f16", "bf16", "new", "old")  # ATB_CUDA_FP4_MOE


def _mode() -> str:
    """ATB_CUDA_GEMM (see the module docstring; another value is a ValueError naming it)."""
    return env_choice("ATB_CUDA_GEMM", "auto", GEMM_MODES)


def dq_rows() -> int:
    """Rows from which auto sends fp8_block linears to dequantise + cuBLAS: ATB_CUDA_DQ_ROWS (an integer >= 1),
    else :data:`DQ_LINEAR_ROWS`; a bad value is a ValueError naming the variable."""
    v = os.environ.get("ATB_CUDA_DQ_ROWS")
    if v is None:
        return DQ_LINEAR_ROWS
    if not v.strip().isdigit() or int(v) < 1:
        raise ValueError(f"ATB_CUDA_DQ_ROWS={v!r}: expected an integer >= 1 (rows)")
    return int(v)


def _path(x: torch.Tensor, fmt: str, w_scale, rows: int, rows_per_weight: float, grouped: bool = True) -> str:
    """Which kernel serves this fp4 / fp8_block call: "tcl" | "fp4moe" | "tc" | "decode" | "tiled" (ATB_CUDA_GEMM =
    auto | tcl | fp4moe | tc | decode | tiled; ``dq`` is decided in :func:`linear`; a forced path that does not apply
    to the call falls back to the tiled kernel)."""
    mode = _mode()
    if mode == "tiled" or rows == 0 or not gemm_tc_large.eligible(x, fmt, w_scale):
        return "tiled"
    if mode == "tcl":
        return mode
    moe = grouped and gemm_fp4_moe.eligible(x, fmt, w_scale, rows)
    if mode == "fp4moe":
        return "fp4moe" if moe else "tiled"
    if mode == "fp4mma":
        return "fp4mma" if moe and _mma_ok(x, w_scale, rows) else "tiled"
    if mode == "fp4f16":
        return "fp4f16" if moe and _f16_ok(x, w_scale, rows) else "tiled"
    small = gemm_decode.eligible(x, fmt, w_scale, rows)  # the decode / tc kernels' row limit
    if mode in ("tc", "decode"):
        return mode if small else "tiled"
    moe_impl = env_choice("ATB_CUDA_FP4_MOE", "mma", FP4_MOE_IMPLS)
    if moe and rows <= FP4_MOE_MAX_ROWS and moe_impl != "old":
        f16 = moe_impl == "f16" or (moe_impl == "mma" and rows_per_weight > F16_MOE_MIN_ROWS_PER_EXPERT)
        if f16 and _f16_ok(x, w_scale, rows):
            return "fp4f16"
        return "fp4mma" if moe_impl in ("mma", "f16", "bf16") and _mma_ok(x, w_scale, rows) else "fp4moe"
    if grouped:
        if rows >= TCL_GROUPED_MIN_ROWS:
            return "tcl"
        if TC_GROUPED_MIN_ROWS <= rows <= TC_GROUPED_MAX_ROWS and rows_per_weight <= 16:
            return "tc"
    elif rows <= TCL_LINEAR_ROWS.get(fmt, 0):
        return "tcl"
    elif rows <= TC_LINEAR_ROWS:
        return "tc"
    return "decode" if small and rows_per_weight <= DECODE_ROWS.get(fmt, 0) else "tiled"


def _gemv_ok(x: torch.Tensor, w: torch.Tensor, w_scale, rows: int) -> bool:
    """Whether fp8_gemv.py (CUDA C, NVRTC) serves an fp8_block linear: up to :data:`FP8_GEMV_MAX_ROWS` rows under
    ``auto`` (:func:`gemv_rows`; up to 8 under ``ATB_CUDA_GEMM=gemv``), eligible and built."""
    mode = _mode()
    limit = gemv_rows() if mode == "auto" else fp8_gemv.MAX_ROWS if mode == "gemv" else 0
    return 0 < rows <= limit and fp8_gemv.eligible(x, w, w_scale) and fp8_gemv.available(x.device)


def gemv_rows() -> int:
    """Rows up to which auto sends fp8_block linears to fp8_gemv.py: ATB_CUDA_FP8_GEMV_ROWS (0..8; 0: never),
    else :data:`FP8_GEMV_MAX_ROWS`; a bad value is a ValueError naming the variable."""
    v = os.environ.get("ATB_CUDA_FP8_GEMV_ROWS")
    if v is None:
        return FP8_GEMV_MAX_ROWS
    if not v.strip().isdigit() or int(v) > fp8_gemv.MAX_ROWS:
        raise ValueError(f"ATB_CUDA_FP8_GEMV_ROWS={v!r}: expected an integer 0..{fp8_gemv.MAX_ROWS} (rows)")
    return int(v)


def _mma_ok(x: torch.Tensor, w_scale, rows: int) -> bool:
    """Whether fp4_moe_mma.py (the CUDA C kernel built by NVRTC) serves an fp4 MoE call: eligible and built."""
    return fp4_moe_mma.eligible(x, w_scale, rows) and fp4_moe_mma.available(x.device)


def _f16_ok(x: torch.Tensor, w_scale, rows: int) -> bool:
    """Whether fp4_moe_f16.py (the float16-MMA CUDA C kernel) serves an fp4 MoE call: eligible and built."""
    return fp4_moe_f16.eligible(x, w_scale, rows) and fp4_moe_f16.available(x.device)


def _use_decode(x: torch.Tensor, fmt: str, w_scale, rows: int, rows_per_weight: float, grouped: bool = True) -> bool:
    """Whether this fp4 / fp8_block call goes to the decode kernel (gemm_decode.py)."""
    return _path(x, fmt, w_scale, rows, rows_per_weight, grouped) == "decode"


def _fp4_split() -> bool:
    """FP4 kernel variant: ATB_CUDA_FP4=split (two dots over even / odd columns) or join (default)."""
    return env_choice("ATB_CUDA_FP4", "join", ("join", "split")) == "split"


@triton.jit
def _e8m0(b):
    """float32 2^(b - 127) of E8M0 bytes (b = 0 is the subnormal 2^-127)."""
    b = b.to(tl.int32) & 0xFF
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_scaled(c, sc):
    """float32 e2m1(c) * 2^(sc - 127) built from bits: sign << 31 | (e - 1 + sc) << 23 | m << 22 for exponent
    bits e > 0, 2^(sc - 128) for code 1 (0.5), 0 for code 0 (sc in [2, 253], as real scales are)."""
    e = (c >> 1) & 3
    m = c & 1
    sign = (c & 8) << 28
    bits = tl.where(e > 0, ((e - 1 + sc) << 23) | (m << 22), tl.where(m != 0, (sc - 1) << 23, 0))
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                 M, N, K, NE, stride_we, stride_se,
                 FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, GROUPED: tl.constexpr, FP4_SPLIT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CT: tl.constexpr, PREC: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
        rr = r0 + tl.arange(0, BM)
        rm = rr < r1
        rows = tl.load(order_ptr + rr, mask=rm, other=0).to(tl.int64)
    else:
        e = 0
        rr = pid_m * BM + tl.arange(0, BM)
        rm = rr < M
        rows = rr.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc = tl.zeros((BM, BN), tl.float32)
    if tl.max((rm & (e < NE)).to(tl.int32), 0) > 0:  # a tile of bucket NE (ids = E, no expert): zero rows
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            if FMT != 2:
                a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(CT)
            if FMT == 0:
                wt = tl.load(w_base + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :],
                             other=0.0).to(CT)
                acc += mma(a, tl.trans(wt), PREC)
            elif FMT == 1:
                wt = tl.load(w_base + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :],
                             other=0.0).to(CT)
                ks = tl.cdiv(K, 128)
                sv = tl.load(s_base + (pid_n * BN // 128) * ks + k0 // 128)
                if SCALE_E8M0:
                    sv = _e8m0(sv)
                acc += mma(a, tl.trans(wt), PREC) * sv.to(tl.float32)
            else:
                # FP4: element 2c is the low nibble of byte c, 2c+1 the high one; codes decoded with the E8M0
                # scale of their group of 32 folded into the exponent bits, then interleaved back in K order
                c = tl.arange(0, BK // 2)
                kh = k0 // 2 + c
                cm = nm[:, None] & (kh < K // 2)[None, :]
                b = tl.load(w_base + n[:, None].to(tl.int64) * (K // 2) + kh[None, :], mask=cm, other=0)
                b = tl.reshape(b.to(tl.int32) & 0xFF, (BN, BK // 32, 16))
                kb = k0 // 32 + tl.arange(0, BK // 32)
                sc = tl.load(s_base + n[:, None].to(tl.int64) * (K // 32) + kb[None, :],
                             mask=nm[:, None] & (kb < K // 32)[None, :], other=127).to(tl.int32) & 0xFF
                lo = _fp4_scaled(b & 0xF, sc[:, :, None])
                hi = _fp4_scaled(b >> 4, sc[:, :, None])
                a = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(CT)
                if FP4_SPLIT:  # even / odd activation columns against the low / high codes: two dots
                    a_lo, a_hi = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
                    acc += mma(a_lo, tl.trans(tl.reshape(lo, (BN, BK // 2)).to(CT)), PREC)
                    acc += mma(a_hi, tl.trans(tl.reshape(hi, (BN, BK // 2)).to(CT)), PREC)
                else:  # codes interleaved back into K order: one dot
                    wv = tl.reshape(tl.join(lo, hi), (BN, BK)).to(CT)
                    acc += mma(a, tl.trans(wv), PREC)
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


def _compute_dtype(x: torch.Tensor, fmt: str, w: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.float32 or (fmt == "dense" and w.dtype != x.dtype):
        return torch.float32
    return x.dtype


def _check(fmt: str, k: int) -> None:
    if fmt not in _FMT:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {tuple(_FMT)}")
    if fmt == "fp4" and k % 32:
        raise ValueError(f"fp4 weights need an input size that is a multiple of 32, got {k}")


def _scale_arg(w_scale: torch.Tensor | None, w: torch.Tensor):
    if w_scale is None:
        return w, False
    if w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype):
        return w_scale.contiguous().view(torch.uint8), True
    return w_scale.float().contiguous(), False


def _tiles(m: int, n: int, k: int, fmt: str, compute: torch.dtype) -> tuple[int, int, int]:
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bk = 128 if fmt != "dense" else 64
    bn = 64 if m <= 64 else 128
    if triton.cdiv(m, bm) * triton.cdiv(n, bn) < 264:  # a decode GEMV: more, narrower column tiles
        bn = 32
    if compute == torch.float32:
        bk, bn = min(bk, 64), min(bn, 64)
    return bm, bn, bk


@register("linear", "cuda")
def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
    """y = x @ W^T, x [..., K]; dense weights on cuBLAS (float32 skinny ones in tf32x3 passes), fp8_block / fp4
    through ``_gemm_kernel``."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), w, w_scale, fmt).view(*x.shape[:-1], w.shape[0])
    m, k = x.shape
    if fmt == "dense":
        if (x.dtype == torch.float32 and w.dtype == torch.bfloat16 and m > 0 and not INTERPRET
                and _f32_path(m) == "bf16x3" and _mm_f32()):
            # a float32-compute layer stored in BF16 (parallel.linear.compact_fp32_weights_): the head and the
            # compressor projections, at every batch size
            return _bf16x3(x, w)
        if x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16) and 0 < m <= 256 and not INTERPRET:
            return _fp32_gemv(x, w)
        if w.dtype == x.dtype:
            return x @ w.t()
        return (x.float() @ w.float().t()).to(x.dtype)
    _check(fmt, k)
    if fmt == "fp8_block" and _gemv_ok(x, w, w_scale, m):
        return fp8_gemv.linear(x, w, w_scale)
    path = _path(x, fmt, w_scale, m, m, grouped=False)
    if fmt == "fp8_block" and x.dtype == torch.bfloat16 and dequant_bf16.eligible(w, w_scale) and (
            _mode() == "dq" or (_mode() == "auto" and path == "tiled" and m >= dq_rows())):
        return x @ dequant_bf16.dequant_fp8_bf16(w, w_scale).t()
    if path == "tcl":
        return gemm_tc_large.linear(x, w, w_scale, fmt)
    if path == "tc":
        return gemm_tc.linear(x, w, w_scale, fmt)
    if path == "decode":
        return gemm_decode.linear(x, w, w_scale, fmt)
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    ct = _compute_dtype(x, fmt, w)
    bm, bn, bk = _tiles(m, n, k, fmt, ct)
    s, e8 = _scale_arg(w_scale, w)
    xc = x.contiguous()
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        xc, w.contiguous(), s, out, xc, xc, xc, xc, m, n, k, 1, 0, 0, FMT=_FMT[fmt], SCALE_E8M0=e8, GROUPED=False, FP4_SPLIT=_fp4_split(),
        BM=bm, BN=bn, BK=bk, CT=tl_dtype(ct), PREC=dot_precision(ct), num_warps=4, num_stages=3, **pdl())
    return out


_MM_F32: list = []  # [bool] once probed


def _f32_path(m: int) -> str:
    """How a float32 x times a BF16 weight runs: "bf16x3" (:func:`_bf16x3`, three launches around cuBLAS) or
    "gemv" (:func:`_fp32_gemv`, one launch, M <= 256 only). ATB_CUDA_F32_LINEAR=bf16x3 / gemv / auto (default:
    bf16x3). The one-launch kernel loops over all of K in one program per 32 output columns: at the compressor
    projections' shapes (N = 256-1024, K = 4096) it took 99 us a call at every batch size on an H100 (6 calls
    a Flash decode step: 0.6 ms of 3.3; scripts/bench_results/decode_h100_session5.txt)."""
    p = os.environ.get("ATB_CUDA_F32_LINEAR", "auto")
    if p not in ("auto", "bf16x3", "gemv"):
        raise ValueError(f"ATB_CUDA_F32_LINEAR={p!r}: expected auto, bf16x3 or gemv")
    return "gemv" if p == "gemv" and m <= 256 else "bf16x3"


def _mm_f32() -> bool:
    """Whether this torch has ``torch.mm(..., out_dtype=torch.float32)`` for BF16 operands on CUDA (cuBLAS BF16
    GEMM with the float32 accumulator written out, not rounded to BF16); probed on first use, not at import."""
    if not _MM_F32:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device="cuda")
            _MM_F32.append(torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_F32.append(False)
    return _MM_F32[0]


@triton.jit
def _split3_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out [3, numel] BF16: x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2) (x1 + x2 + x3 = x exactly for
    float32 x away from the subnormal range: 3 x 8 significant bits)."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < numel
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    x1 = x.to(tl.bfloat16)
    r = x - x1.to(tl.float32)
    x2 = r.to(tl.bfloat16)
    x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + i, x1, mask=m)
    tl.store(out_ptr + numel + i, x2, mask=m)
    tl.store(out_ptr + 2 * numel + i, x3, mask=m)


@triton.jit
def _sum3_kernel(y_ptr, out_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = (y[2] + y[1]) + y[0] over y [3, numel] float32 (the small parts first)."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < numel
    a = tl.load(y_ptr + i, mask=m, other=0.0)
    b = tl.load(y_ptr + numel + i, mask=m, other=0.0)
    c = tl.load(y_ptr + 2 * numel + i, mask=m, other=0.0)
    tl.store(out_ptr + i, (c + b) + a, mask=m)


def split3(x: torch.Tensor) -> torch.Tensor:
    """BF16 [3, *x.shape]: the three-part split of float32 ``x`` (:func:`_split3_kernel`), one launch."""
    xc = x.contiguous()
    out = torch.empty((3,) + tuple(x.shape), dtype=torch.bfloat16, device=x.device)
    n = xc.numel()
    if n:
        _split3_kernel[(triton.cdiv(n, 1024),)](xc, out, n, BLOCK=1024, **pdl())
    return out


def linear_float32_from_16bit(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                              fmt: str = "dense") -> torch.Tensor:
    """``atb_ops.linear(x, ..., out_dtype=torch.float32)`` for a BF16 x: x.float() @ W^T. With a BF16 dense weight
    (the head and the compressor projections, stored so by parallel.linear.compact_fp32_weights_) one cuBLAS BF16
    GEMM writing its float32 accumulator: every product of two BF16 values is exact in float32, so this is the
    float32 GEMM of the upcast input -- what :func:`_bf16x3` computes for a float32 x, whose second and third BF16
    parts are zero here -- in one launch instead of four (the upcast, the split, the GEMM, the sum). Other
    inputs: the upcast, then :func:`linear`."""
    if fmt == "dense" and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.numel() and not INTERPRET:
        x2 = x.reshape(-1, x.shape[-1])
        if _bf16_gemv_ok(x2, w):
            return fp8_gemv.linear_f32(x2, w).view(*x.shape[:-1], w.shape[0])
        if _mm_f32():
            return torch.mm(x2, w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
    return linear(x.float(), w, w_scale, fmt)


# BF16-weight float32-output linears (DeepSeek-V4's compressor projections on a BF16 input) of up to
# FP8_GEMV_MAX_ROWS rows and this many output columns go to fp8_gemv.py's BF16 form instead of cuBLAS (H200, us at 1 /
# 8 rows, weights rotated past L2, h200_session39.txt call 6: 2048 x 4096 9.0 / 9.6 -> 7.2 / 8.0, 1024 x 4096 7.9 /
# 7.9 -> 5.5 / 6.1, 512 x 4096 7.3 / 7.5 -> 5.2 / 5.5); the head (129280 x 4096) stays on cuBLAS: 240 / 244 against
# 261 / 269
BF16_GEMV_MAX_N = 8192


def _bf16_gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether fp8_gemv.py's BF16 form serves a float32-output BF16 linear: ``ATB_CUDA_BF16_GEMV`` unset or 1
    (``0``: cuBLAS, as before), up to :func:`gemv_rows` rows and :data:`BF16_GEMV_MAX_N` columns, eligible, built."""
    if env_choice("ATB_CUDA_BF16_GEMV", "1", ("0", "1")) == "0" or w.shape[0] > BF16_GEMV_MAX_N:
        return False
    return x.shape[0] <= gemv_rows() and fp8_gemv.bf16_eligible(x, w) and fp8_gemv.available(x.device)


linear.float32_from_16bit = linear_float32_from_16bit  # atb_ops.linear(..., out_dtype=torch.float32)


def _bf16x3(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 x [M, K] @ W^T for a BF16 weight W [N, K], at float32 accuracy on the BF16 tensor cores.

    x = x1 + x2 + x3 exactly (to 2^-24 relative: three BF16 parts of 8 significant bits each, x1 = bf16(x),
    x2 = bf16(x - x1), x3 = bf16(x - x1 - x2)); every product xi * w is exact in float32 and accumulates in float32
    (one cuBLAS GEMM of the 3M stacked rows, float32 output); y = (x3 W^T + x2 W^T) + x1 W^T. Reads W once, in
    BF16: the model's head and compressor projections keep their checkpoint BF16 values and compute in float32.
    Three launches: split, GEMM, sum."""
    m, k = x.shape
    y = torch.mm(split3(x).view(3 * m, k), w.t(), out_dtype=torch.float32)
    out = torch.empty(m, w.shape[0], dtype=torch.float32, device=x.device)
    _sum3_kernel[(triton.cdiv(out.numel(), 1024),)](y, out, out.numel(), BLOCK=1024, **pdl())
    return out


def _fp32_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 x [M <= 256, K] @ W^T (W float32, or BF16 upcast exactly in registers: the same result as its
    float32 copy) through the tensor cores in three TF32 passes ("tf32x3": about
    float32 accuracy); cuBLAS's float32 path for these skinny shapes (the model's float32 head and compressor
    projections) runs on FMA units at about half the HBM rate."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 64 if triton.cdiv(m, bm) * triton.cdiv(n, 64) >= 264 else 32
    xc = x.contiguous()
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        xc, w.contiguous(), xc, out, xc, xc, xc, xc, m, n, k, 1, 0, 0, FMT=0, SCALE_E8M0=False, GROUPED=False,
        FP4_SPLIT=False, BM=bm, BN=bn, BK=32, CT=tl.float32, PREC="tf32x3", num_warps=4, num_stages=4, **pdl())
    return out


def expert_tiles(expert_ids: torch.Tensor, n_experts: int, bm: int):
    """Device-side tile table of rows grouped by expert (no host synchronisation).

    ``expert_ids`` [M] in [0, E]; id E (no expert here, ``grouped_matmul``'s contract) is one more bucket, sorted
    last. Returns (order [M] rows sorted by id (stable), tile_e, tile_r0, tile_r1 [ceil(M/bm) + min(E + 1, M)]):
    tile i covers sorted rows tile_r0[i] .. tile_r1[i] - 1 of bucket tile_e[i] (E: rows the GEMM writes as zeros);
    unused tiles have r0 = r1.
    """
    m = expert_ids.shape[0]
    dev = expert_ids.device
    ids = expert_ids.long()
    nb = n_experts + 1
    # stable counting sort at decode sizes (routing.py; an outer-dimension cumsum over a one-hot [M, E] took
    # ~35 us a call on the H100), a radix sort above
    order = stable_order(ids, nb)
    n_tiles = triton.cdiv(m, bm) + min(nb, m)
    if ids.is_cuda or INTERPRET:  # the table below in one launch (group_rows.py)
        te, r0, r1 = tile_table(ids, nb, bm, n_tiles)
        return order, te, r0, r1
    counts = torch.zeros(nb, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    row_start = torch.cumsum(counts, 0) - counts
    t = torch.arange(n_tiles, device=dev)
    e = torch.searchsorted(tile_end, t, right=True)
    valid = e < nb
    ec = e.clamp(max=nb - 1)
    r0 = row_start[ec] + (t - tile_start[ec]) * bm
    r1 = torch.minimum(row_start[ec] + counts[ec], r0 + bm)
    r1 = torch.where(valid, r1, r0)
    return order, ec, r0, r1


@register("grouped_matmul", "cuda")
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor | None = None,
                   fmt: str = "dense") -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T; x [M, K], w [E, N, K] (fp4: [E, N, K/2]); float32 accumulation.
    Rows of id E (no expert here) come out as zeros, on every path."""
    m, k = x.shape
    _check(fmt, k)
    n_exp, n = w.shape[0], w.shape[1]
    path = _path(x, fmt, w_scale, m, m / max(1, min(n_exp, m)))
    if path == "tcl":
        return gemm_tc_large.grouped_matmul(x, w, expert_ids, w_scale, fmt)
    if path == "fp4moe":
        return gemm_fp4_moe.grouped_matmul(x, w, expert_ids, w_scale, fmt)
    if path == "fp4mma":
        return fp4_moe_mma.grouped_matmul(x, w, expert_ids, w_scale)
    if path == "fp4f16":
        return fp4_moe_f16.grouped_matmul(x, w, expert_ids, w_scale)
    if path == "tc":
        return gemm_tc.grouped_matmul(x, w, expert_ids, w_scale, fmt)
    if path == "decode":
        return gemm_decode.grouped_matmul(x, w, expert_ids, w_scale, fmt)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    ct = _compute_dtype(x, fmt, w)
    rows_per_expert = m / max(1, min(n_exp, m))
    bm = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 48 else 64)
    _, bn, bk = _tiles(m if bm > 16 else 1, n, k, fmt, ct)
    order, te, r0, r1 = expert_tiles(expert_ids, n_exp, bm)
    s, e8 = _scale_arg(w_scale, w)
    wc = w.contiguous()
    _gemm_kernel[(te.shape[0], triton.cdiv(n, bn))](
        x.contiguous(), wc, s, out, order, te, r0, r1, m, n, k, n_exp, wc.stride(0), s.stride(0) if w_scale is not None else 0,
        FMT=_FMT[fmt], SCALE_E8M0=e8, GROUPED=True, FP4_SPLIT=_fp4_split(), BM=bm, BN=bn, BK=bk, CT=tl_dtype(ct), PREC=dot_precision(ct),
        num_warps=4, num_stages=3, **pdl())
    return out
