"""FP8-block linears of 1-8 rows (a decode step's) by a CUDA C kernel (NVRTC) that splits K inside the block, not
over blocks: no float32 partials in global memory, no arrival counter, no last block adding them; the FP8 form of
``group_linear`` (every group's weight in one launch, up to 32 tokens); and BF16-weight linears with a float32 output
(the BF16 form, below).

Same op as the ``fp8_block`` case of :func:`.gemm.linear`: out[m, :] = x[m, :] @ W^T, bfloat16 x [M, K] (M <= 8),
W float8_e4m3fn [N, K] with one scale per 128 x 128 block (float32 or E8M0 bytes [ceil(N / 128), K / 128]),
W[n, k] = e4m3 * s[n // 128, k // 128]; bfloat16 out [M, N].

Why: the decode step's FP8 linears at 8 rows take 6.5-16 us for 6-34 MB of weights on an H200 (186 us a step
against ~70 us of weight bytes at the copy bandwidth), and with the weight already in L2 still 6.2-6.7 us for 6-8 MB
(scripts/bench_results/h200_session30.txt): fixed costs, not DRAM. Two kernels of different make (:mod:`.gemm_tc`,
session 34's ``mma.sync`` kernel) both split K over blocks on these shapes and land at the same times; the one shape
that needs no split (wq_b, 32768 x 1024) streams its 33.5 MB 3.6 us faster than wo_b (4096 x 8192), the same bytes
split 8 ways (scripts/bench_results/h200_session34.txt). Here a block of 8 warps owns 16 x R weight rows (R = 8 / S
row tiles) and each row tile's S warps take every S-th K step of 128 columns; the S partial tiles are added in
shared memory in warp order (deterministic) and the block writes bfloat16.

- a warp's tile is 16 rows: lane l = 4 g + c holds rows g and g + 8 (the A fragment rows of ``mma.m16n8k16``) and,
  per K step, the 32 bytes [32 c, 32 c + 32) of each: four 16-byte loads that skip L1, D steps in flight in
  registers;
- a 32-bit word j of 4 codes (columns 32 c + 4 j .. + 3) becomes two bfloat16 pairs by :data:`.gemm_tc`'s exact bit
  placement (byte permute, shift, mask, ``lop3``, one multiply by 2^120 a pair) and feeds one MMA: k slots (2c,
  2c + 1) hold columns 32 c + 4 j + (0, 1), slots (2c + 8, 2c + 9) columns + (2, 3). The B fragment is then
  x[token][32 c + 4 j .. + 3] in natural order: a lane loads 64 bytes of its token's row per step (16-byte loads
  through L1: every block reads the same x, so an SM fetches it from L2 once);
- each step's MMAs accumulate into a zeroed float32 tile that its block scale multiplies into the running sums
  (one FFMA a value): float32 and E8M0 scales alike, no range rule;
- up to 4 token tiles of 8 (NT8) share each decoded word; with 4 the x chunks are loaded one 16-byte chunk at a time
  (registers); :func:`group_linear` takes blockIdx.y as the group (x rows ``ldx`` apart, W, scales and out offset
  per group).

The block count is N / (16 R); S is the smallest of 1, 2, 4, 8 that gives at least 15/8 blocks an SM (else 8), at
most the K step count; 2 steps in flight at S = 8, else 3 (the fastest measured). Products are exact (bf16 x bf16 into
float32); results differ from the reference op (float32 dequantised weight) by summation order and the scale applied
per 128 columns.

The BF16 form (template ``BF``: :func:`linear_f32`) serves DeepSeek-V4's float32-compute projections stored in BF16
(``parallel.linear.compact_fp32_weights_``: the compressors' wkv + wgate) on a BF16 input of 1-8 rows: the same
blocks and split, the weight's bfloat16 pairs fed to the MMAs as they lie (words 2 j, 2 j + 1 of a lane's 64 bytes a
row and step), no block scale, float32 out, one step in flight at split 8 (faster than two there). On an H200
(scripts/bench_results/h200_session39.txt, weights rotated past L2) 1.20-1.43x cuBLAS's float32-output GEMM on the
compressor shapes (2048 / 1024 / 512 x 4096 at one row: 7.2 / 5.5 / 5.2 against 9.0 / 7.9 / 7.3 us), 0.91x on the
head's 129280 x 4096 (which :mod:`.gemm` keeps on cuBLAS: ``BF16_GEMV_MAX_N``).

Launched with programmatic dependent launch where it is on (:func:`.nvrtc.launch`): the block loads its first D
weight steps, then waits (``pdl_wait``: ``griddepcontrol.wait``) before it reads x, so the weights' first trip from
HBM overlaps the kernel before it. That is right only for weights no kernel writes just before (model parameters);
``ATB_CUDA_FP8_GEMV_PRE=0`` loads them after the wait.

Measured on a lent H200 (scripts/bench_results/h200_session38.txt; us a call, weights rotated past L2, gemm_tc /
this kernel at 1 and 8 rows): wq_a + wkv 1536 x 4096 6.9 / 4.6 and 7.1 / 5.4, wq_b 32768 x 1024 13.7 / 13.0 and
14.0 / 13.4, wo_b 4096 x 8192 15.7 / 11.9 and 16.0 / 13.2, w13 4096 x 4096 10.8 / 7.5 and 10.8 / 7.9, w2 4096 x 2048
6.6 / 4.4 and 6.8 / 5.0; without PDL 1.0-1.2 us slower a call, with the weights after the wait 0.5-0.9 us slower. The
FP8 + FP4 decode step's replay at batch 1 / 8: 0.78 / 1.04-1.05 -> 0.76 / 1.03 ms. Two token tiles (9-16 rows) ran
0.84-1.05x gemm_tc: linears are capped at 8 rows. ``group_linear`` over Flash's wo_a (8 x 1024 x 4096): 12.2 / 13.6 /
15.0 / 20.3 / 24.3 us at 1 / 8 / 16 / 24 / 32 tokens against cuBLAS BF16's 18.7-19.7.

Built at first use by NVRTC for the device's compute capability (sm_80+); a failed build leaves the other paths
serving (:func:`available`). ``ATB_CUDA_FP8_GEMV_CFG="s=4,d=3"`` overrides the K split and the steps in flight
(benchmarks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import fp4_moe_mma as fm
from . import gemm_tc as tc
from . import nvrtc
from ._util import env_choice, env_overrides, sm_count

K_STEP = 128  # columns per K step: one scale block
WARPS = 8
MAX_ROWS = 8  # tokens of a linear: one 8-token tile (two measured slower than gemm_tc at 9-16 rows)
GROUP_MAX_ROWS = 32  # tokens of a group_linear call: up to four 8-token tiles
SPLITS = (1, 2, 4, 8)  # warps of a row tile (K split inside the block)
DEPTHS = (2, 3, 4)  # K steps in flight per warp
BF16_DEPTHS = (1, 2)  # the same for BF16 weights (a step is twice the bytes, 32 registers: 3 would spill)

# e4m3 word (4 codes) -> two bfloat16 pairs (codes 0, 1) and (codes 2, 3), exact: gemm_tc's pair decoder twice
FP8X4_PTX = "{\n" + tc._FP8_HEAD + tc._e4m3_pair("$0", "$2", "0x1404") + tc._e4m3_pair("$1", "$2", "0x3424") + "}"

_SRC = r"""
__device__ __forceinline__ void decode4(u32 q, u32& lo, u32& hi) {
    asm(FP8X4 : "=r"(lo), "=r"(hi) : "r"(q));
}

__device__ __forceinline__ u32 word_of(const U4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// NT8 token tiles of 8, S warps a row tile (R = 8 / S row tiles of 16 a block), D K steps in flight a warp, SF32:
// float32 block scales (else E8M0 bytes), PRE: the first D steps' weights loaded before the PDL wait (the weights
// are not written by the kernels before this one: model parameters); pdl_early: let the next kernel launch after the
// wait; BF: BF16 weights without scales and a float32 output (the float32-compute projections), else e4m3 + scales
// and a bfloat16 output
template <int NT8, int S, int D, bool SF32, bool PRE, bool BF>
__global__ void __launch_bounds__(256, 2) fp8_gemv(
        const u16* __restrict__ x, const u8* __restrict__ w, const void* __restrict__ s, void* __restrict__ out,
        int M, int N, int K, int ldx, int ldo, int pdl_early) {
    constexpr int R = 8 / S;
    constexpr int EB = BF ? 2 : 1;  // weight bytes an element
    constexpr int WL = BF ? 4 : 2;  // 16-byte loads a row and K step (128 columns)
    __shared__ float4 red[S > 1 ? 8 : 1][NT8][32];  // each warp's float32 tile (fragment order) for the sum
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int rt = warp / S, kw = warp % S;  // this warp's row tile and its place in the tile's K split
    const int n0 = (blockIdx.x * R + rt) * 16;
    const bool live = n0 < N;
    const int KS = K >> 7;
    const int n_my = live ? (KS - kw + S - 1) / S : 0;  // this warp's K steps: kw, kw + S, ...
    // group blockIdx.y (group_linear: x [M, G, K] rows ldx apart, W [G, N, K], scales [G, N / 128, K / 128],
    // out [M, G, N] rows ldo apart; one group for a linear)
    const int grp = blockIdx.y;
    x += (long long)grp * K;
    w += (long long)grp * N * K * EB;
    const long long o0 = (long long)grp * N;  // out's offset (elements)
    const u8* w0 = w + (long long)(live ? n0 + g : 0) * K * EB + c * 32 * EB;
    const u8* w1 = w0 + 8LL * K * EB;
    const int srow = (grp * ((N + 127) >> 7) + (n0 >> 7)) * KS;
    const u16* xr[NT8];
    bool xok[NT8];
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
        const int t = g + 8 * nt;
        xok[nt] = t < M;
        xr[nt] = x + (long long)(xok[nt] ? t : 0) * ldx + c * 32;
    }
    U4 wr[D][2 * WL];  // rows g (loads 0 .. WL - 1), g + 8 (WL ..)
    u32 sr[D];
    auto load = [&](int i, U4 (&wd)[2 * WL], u32& sd) {
        const int ks = kw + S * i;
#pragma unroll
        for (int j = 0; j < WL; ++j) {
            wd[j] = ldg_stream(w0 + ks * 128 * EB + 16 * j);
            wd[WL + j] = ldg_stream(w1 + ks * 128 * EB + 16 * j);
        }
        if (BF) sd = 0u;
        else if (SF32) sd = __float_as_uint(__ldg((const float*)s + srow + ks));
        else sd = __ldg((const u8*)s + srow + ks);
    };
    if (PRE) {
#pragma unroll
        for (int d = 0; d < D; ++d)
            if (d < n_my) load(d, wr[d], sr[d]);
    }
    pdl_wait(pdl_early);  // x (the previous kernel's output) only after the previous kernel has completed
    if (!PRE) {
#pragma unroll
        for (int d = 0; d < D; ++d)
            if (d < n_my) load(d, wr[d], sr[d]);
    }

    float acc[NT8][4];
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;

    for (int i0 = 0; i0 < n_my; i0 += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {  // d: a constant in each copy, so every ring index is one
            const int i = i0 + d;
            if (i < n_my) {
                const int ks = kw + S * i;
                // x: 16-byte chunk j (columns 32 c + 8 j .. + 7) of each token tile; all 4 at the step's start, or
                // (4 tiles: registers) each just before its two words
                constexpr int XC = NT8 >= 4 ? 1 : 4;
                U4 xb[NT8][XC];
                auto load_x = [&](int j) {
#pragma unroll
                    for (int nt = 0; nt < NT8; ++nt) {
                        xb[nt][j % XC] = U4{0u, 0u, 0u, 0u};
                        if (xok[nt]) xb[nt][j % XC] = ldg_nc(xr[nt] + ks * 128 + j * 8);
                    }
                };
                if (XC == 4) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) load_x(j);
                }
                float tmp[NT8][4];
#pragma unroll
                for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) tmp[nt][q] = 0.f;
#pragma unroll
                for (int jw = 0; jw < 8; ++jw) {  // columns 32 c + 4 jw .. + 3 of rows g, g + 8: one MMA
                    if (XC == 1 && (jw & 1) == 0) load_x(jw >> 1);
                    u32 a0, a1, a2, a3;
                    if (BF) {  // bfloat16 pairs as they lie: words 2 jw, 2 jw + 1 of each row's 64 bytes
                        a0 = word_of(wr[d][jw >> 1], (2 * jw) & 3);
                        a2 = word_of(wr[d][jw >> 1], (2 * jw + 1) & 3);
                        a1 = word_of(wr[d][WL + (jw >> 1)], (2 * jw) & 3);
                        a3 = word_of(wr[d][WL + (jw >> 1)], (2 * jw + 1) & 3);
                    } else {  // word jw of 4 e4m3 codes -> two bfloat16 pairs
                        decode4(word_of(wr[d][jw >> 2], jw & 3), a0, a2);
                        decode4(word_of(wr[d][WL + (jw >> 2)], jw & 3), a1, a3);
                    }
#pragma unroll
                    for (int nt = 0; nt < NT8; ++nt) {
                        const U4& xv = xb[nt][(jw >> 1) % XC];
                        // BF: no block scale, straight into the running sums
                        mma16816(BF ? acc[nt] : tmp[nt], a0, a1, a2, a3, (jw & 1) ? xv.z : xv.x,
                                 (jw & 1) ? xv.w : xv.y);
                    }
                }
                const u32 sv = sr[d];
                const float sc = SF32 ? __uint_as_float(sv) : __uint_as_float(sv ? sv << 23 : 1u << 22);
                if (i + D < n_my) load(i + D, wr[d], sr[d]);  // the slot's next step, in flight for D steps
                if (!BF) {
#pragma unroll
                    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
                        for (int q = 0; q < 4; ++q) acc[nt][q] = fmaf(tmp[nt][q], sc, acc[nt][q]);
                }
            }
        }
    }

    if (S > 1) {  // the tile's S partial sums, added in warp order by its first warp
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt)
            red[warp][nt][lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
        __syncthreads();
        if (kw != 0) return;
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt) {
            float4 v = red[warp][nt][lane];
#pragma unroll
            for (int j = 1; j < S; ++j) {
                const float4 u = red[warp + j][nt][lane];
                v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w;
            }
            acc[nt][0] = v.x; acc[nt][1] = v.y; acc[nt][2] = v.z; acc[nt][3] = v.w;
        }
    }
    if (!live) return;
    // C fragment: rows g / g + 8, tokens 2c, 2c + 1 of each 8-token tile
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int t = nt * 8 + 2 * c + (q & 1);
            const int n = n0 + g + 8 * (q >> 1);
            if (t >= M) continue;
            if (BF) ((float*)out)[o0 + (long long)t * ldo + n] = acc[nt][q];
            else ((u16*)out)[o0 + (long long)t * ldo + n] = to_bf16(acc[nt][q]);
        }
}
"""


def _source() -> str:
    body = "\\n\"\n\"".join(line.strip() for line in FP8X4_PTX.replace("$", "%").strip().splitlines())
    return fm.fill(fm.HELPERS) + nvrtc.PDL_DEVICE + _SRC.replace("FP8X4", '"' + body + '\\n"', 1)


VARIANTS = ([(nt8, s, d, sf32, pre, False) for nt8 in (1, 2, 4) for s in SPLITS for d in DEPTHS
             for sf32 in (False, True) for pre in (False, True)]
            + [(1, s, d, False, pre, True) for s in SPLITS for d in BF16_DEPTHS for pre in (False, True)])


def _name(nt8: int, s: int, d: int, sf32: bool, pre: bool, bf: bool) -> str:
    return f"fp8_gemv<{nt8}, {s}, {d}, {str(sf32).lower()}, {str(pre).lower()}, {str(bf).lower()}>"


PROGRAM = nvrtc.Program(_source(), "fp8_gemv.cu", [_name(*v) for v in VARIANTS])


def _kernels(device: torch.device) -> dict:
    return PROGRAM.by_variant(device, VARIANTS, _name)


def available(device: torch.device) -> bool:
    """Whether the kernels are loaded on ``device`` (compute capability 8.0+, NVRTC present; built at the first ask
    outside CUDA-graph capture; a failure is kept in ``PROGRAM.error`` and the other paths serve)."""
    return PROGRAM.available(device)


def _dtypes_ok(w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """An e4m3 weight (or its bytes) and float32 or E8M0 scales."""
    return (w.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8)
            and (w_scale.dtype in (torch.float32, torch.uint8) or "e8m0" in str(w_scale.dtype)))


def eligible(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    """bfloat16 x [M, K] on a CUDA device with 1 <= M <= 8, an e4m3 weight [N, K] with N a multiple of 16 and K of
    128, block scales [ceil(N / 128), K / 128] (float32 or E8M0), x and W on 16-byte boundaries (the loads)."""
    if w_scale is None or w.dim() != 2 or w_scale.dim() != 2 or x.dim() != 2 or not _dtypes_ok(w, w_scale):
        return False
    n, k = w.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == k
            and n % 16 == 0 and k % K_STEP == 0 and n > 0
            and tuple(w_scale.shape) == (-(-n // 128), k // K_STEP)
            and x.is_contiguous() and w.is_contiguous() and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


class LaunchPlan(NamedTuple):
    s: int  # warps a row tile (K split inside the block)
    d: int  # K steps in flight per warp
    blocks: int  # per group


def launch_plan(n: int, k: int, device: torch.device, groups: int = 1, nt8: int = 1,
                bf16: bool = False) -> LaunchPlan:
    """K split and depth of an [m, k] x [n, k]^T call (of each of ``groups`` weights, ``nt8`` token tiles): the
    smallest split that gives at least 15/8 blocks an SM (else 8), at most the K step count; 2 steps in flight at
    split 8 or with more than one token tile (registers), else 3 (BF16 weights: 1 at split 8, else 2);
    ``ATB_CUDA_FP8_GEMV_CFG`` overrides (s, d)."""
    steps = k // K_STEP
    want = sm_count(device) * 15 // 8
    s = next((v for v in SPLITS if groups * -(-n // (16 * (WARPS // v))) >= want), SPLITS[-1])
    s = max(v for v in SPLITS if v <= max(1, min(s, steps)))
    d = (1 if s == 8 else 2) if bf16 else 2 if s == 8 or nt8 > 1 else 3
    cfg = env_overrides("ATB_CUDA_FP8_GEMV_CFG", {"s": s, "d": d}, {"s": SPLITS, "d": BF16_DEPTHS if bf16 else DEPTHS})
    return LaunchPlan(cfg["s"], cfg["d"], -(-n // (16 * (WARPS // cfg["s"]))))


def weights_first() -> bool:
    """Whether a PDL launch loads its first weight steps before waiting on the previous kernel
    (``ATB_CUDA_FP8_GEMV_PRE``, default 1): right for weights no kernel writes (model parameters)."""
    return env_choice("ATB_CUDA_FP8_GEMV_PRE", "1", ("0", "1")) == "1"


def _launch(x, w, w_scale, out, m: int, n: int, k: int, groups: int) -> None:
    """One launch over ``groups`` weights: x rows ``groups * k`` elements apart, out rows ``groups * n`` apart
    (``w_scale`` None: BF16 weights, a float32 out)."""
    nt8 = 1 if m <= 8 else 2 if m <= 16 else 4
    bf = w_scale is None
    p = launch_plan(n, k, x.device, groups, nt8, bf)
    sf32 = not bf and w_scale.dtype == torch.float32
    on = nvrtc.pdl_on()
    kern = _kernels(x.device)[(nt8, p.s, p.d, sf32, on and weights_first(), bf)]
    s = w if bf else w_scale.contiguous().view(torch.float32 if sf32 else torch.uint8)
    nvrtc.launch(kern, (p.blocks, groups, 1), (WARPS * 32, 1, 1),
                 [x, w.view(torch.uint8), s, out, m, n, k, groups * k, groups * n], pdl=on)


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """out = x @ W^T for bfloat16 x [M, K] (M <= 8) over an e4m3 weight [N, K] with 128 x 128 block scales
    (callers check :func:`eligible`); bfloat16 [M, N]. Launched with programmatic dependent launch where it is on
    (:func:`.nvrtc.pdl_on`)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(x, w, w_scale, out, m, n, k, 1)
    return out


def bf16_eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """:func:`linear_f32`'s operands: bfloat16 x [M, K] on a CUDA device with 1 <= M <= 8, a bfloat16 weight [N, K]
    with N a multiple of 16 and K of 128, both contiguous on 16-byte boundaries."""
    return (x.dim() == 2 and w.dim() == 2 and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and w.shape[0] % 16 == 0 and w.shape[0] > 0
            and w.shape[1] % K_STEP == 0 and x.is_contiguous() and w.is_contiguous()
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out = x @ W^T in float32 for bfloat16 x [M, K] (M <= 8) and a bfloat16 weight [N, K] (callers check
    :func:`bf16_eligible`): every product exact in float32, float32 sums -- DeepSeek-V4's float32-compute
    projections stored in BF16 (``parallel.linear.compact_fp32_weights_``) on a BF16 input; float32 [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    _launch(x, w, None, out, m, n, k, 1)
    return out


def group_eligible(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    """``group_linear``'s operands as :func:`group_linear` takes them: bfloat16 x [T, G, K] (1 <= T <= 32) on a CUDA
    device, an e4m3 weight [G, N, K] with N a multiple of 128 and K of 128, scales [G, N / 128, K / 128] (float32
    or E8M0); x and W contiguous on 16-byte boundaries."""
    if w_scale is None or x.dim() != 3 or w.dim() != 3 or w_scale.dim() != 3 or not _dtypes_ok(w, w_scale):
        return False
    t, g, k = x.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and 0 < t <= GROUP_MAX_ROWS and w.shape[0] == g and w.shape[2] == k
            and w.shape[1] % 128 == 0 and k % K_STEP == 0 and g > 0
            and tuple(w_scale.shape) == (g, w.shape[1] // 128, k // K_STEP)
            and x.is_contiguous() and w.is_contiguous() and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def group_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """out[t, g] = x[t, g] @ W[g]^T for bfloat16 x [T, G, K] (T <= 32), e4m3 W [G, N, K] with 128 x 128 block scales
    [G, N / 128, K / 128] (callers check :func:`group_eligible`): one launch, blockIdx.y the group; bfloat16
    [T, G, N], contiguous."""
    t, g, k = x.shape
    n = w.shape[1]
    out = torch.empty(t, g, n, dtype=x.dtype, device=x.device)
    _launch(x, w, w_scale, out, t, n, k, g)
    return out
