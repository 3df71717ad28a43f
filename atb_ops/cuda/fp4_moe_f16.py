"""MoE decode over FP4 experts on float16 tensor cores: the e2m1 codes decoded to float16 (their E8M0 scales applied
to the MMAs' float32 sums, not to the codes), the activations scaled per 128 channels into float16.

Same op as :mod:`.fp4_moe_mma` (out[m, :] = x[m, :] @ W[e(m)]^T, bfloat16 x [M, K], FP4 experts int8 [E, N, K/2]
with element 2c in the low nibble of byte c, E8M0 scales uint8 [E, N, K/32]; rows whose id lies outside [0, E)
are zeros), written against what bounds that kernel: its instruction stream, 73 % of it the e2m1 -> bfloat16
decode with the scale multiplies (19 operations per 8 codes; 833 instructions per K step at its decode tile,
scripts/bench_results/h200_session23.txt). Here the K step of the (1, 2) tile is 639 instructions (SASS from NVRTC
12.9, the kept 2-step ring; 647 with 3 steps).

- **Weights.** An e2m1 code is the float16 whose high byte is ``sign << 7 | magnitude << 1``, times 2^14 exactly
  (that byte is the e5m2 code of e2m1 x 2^-14; e2m1 0.5 lands on float16's subnormal 2^-15), so a word of 8 codes
  becomes 4 registers of float16 pairs in 11 operations: the even codes' bytes ``(q << 1) & 0x0E0E0E0E | (q << 4)
  & 0x80808080``, the odd codes' ``(q >> 3) & 0x0E0E0E0E | q & 0x80808080``, each spread into two registers' high
  bytes (one byte permute, one mask): pairs (0, 4), (2, 6), (1, 5), (3, 7). The 2^(s - 127) of each 32-code group
  multiplies the float32 sum of the group's two MMAs (4 FFMA; the exponent byte moved into place, 2 operations), so
  every MMA's k slots lie in one group: lane c of a row's quad takes word c (bytes 4c..4c+3) of each 16-byte group.
  The block copies its rows' K step into shared memory (``cp.async``, whole 128-byte lines per 8 threads, the
  16-byte groups of row r at chunk j ^ (r & 7)) and each warp takes its words with ``ldmatrix`` (an 8 x 8 matrix
  of 16-bit elements gives lane l row l / 4, bytes 4 (l % 4)..: rows g / g + 8, word c of a group, for free).
  Loading the words with 4-byte global loads instead (8 a row and step) made the kernel 18-31 % slower than
  :mod:`.fp4_moe_mma`; e4m3 ``mma.sync`` (W4A8) is no shortcut on Hopper: ptxas lowers it to float16 MMAs plus
  conversions (912 instructions a step).
- **Activations.** A small Triton kernel (:func:`scale_act`) writes x / 2^(ceil(log2 amax) - 15) as float16 for
  each 128-channel block of a row (amax = the block's largest |x|; zero blocks: scale 1) with the scales times 2^14
  (the codes' factor) as float32 [M, K / 128], in the kernel's K order: lane column c's 128 bytes of a K step
  together, group j's 8 values in the MMA's order 0 4 1 5 2 6 3 7 of word c. The kernel copies them into the same
  ring and multiplies each 128-block's float32 sum by its token's scale (4 FFMA).
- A ring of :data:`STAGES` K steps (weights, their scale bytes, activations, their scales; dynamic shared memory,
  the ids kept in its first 4 KB before it fills); block scheduling, expert slots, passes of 8 x NT tokens, K split
  and epilogue are :mod:`.fp4_moe_mma`'s (shared source text).

Measured on a lent H200 against :mod:`.fp4_moe_mma` (CUDA-graph replays of both in one call, 8 draws of top-6
experts of 64; scripts/bench_results/h200_session24.txt): 1.04-1.06x as fast at 64 tokens (6 rows per expert, the
(2, 2) tile; two calls; 1.07-1.12x in bench_kernels' rows), 0.96-1.03x at 8-32 tokens (1.07-1.10x for w13 in
bench_kernels' rows), 7-18 % slower at one token; the FP8 + FP4 decode step's replay at batch 64 1.91 -> 1.86-1.87
ms, unchanged at 8 and 32. Three ring steps, 4 blocks per SM by a register bound, or the 128-code loop not unrolled
(66 registers) were slower. :mod:`.gemm` routes calls of more than :data:`.gemm.F16_MOE_MIN_ROWS_PER_EXPERT` rows
per expert here.

Numerics: weight codes and scales are exact; x / scale is exact in float16 for every |x| >= amax x 2^-31 of its
block (float16's 11-bit significand holds bfloat16's 8 and its exponent range covers [2^-17, 2^15] of the scaled
values; below that a value is rounded to float16's subnormal step, an error under 2^-33 of the block's largest
product -- far below the float32 accumulation's own rounding); products are exact in float32. In
``numerics="reference"`` the input was rounded to e4m3 x 2^k per 128 already (``fp8_act_round``), and those values
are all exact. Results differ from the reference op by summation order and that. Scale bytes must lie in 1 .. 254
(:func:`scales_ok`).

Built by NVRTC (:mod:`.nvrtc`, sm_80+: ``mma.sync`` f16, ``ldmatrix``, ``cp.async``); tiles (nt, mt) with nt in 1,
2, 4 and mt in 1, 2, 4 (``ATB_CUDA_FP4_MMA_CFG`` as for :mod:`.fp4_moe_mma`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp4_moe_mma as fm
from . import gemm_decode as gd
from . import nvrtc
from ._util import pdl, pdl_wait

ACT_BLOCK = 128  # channels per activation scale

_KERNEL = r"""
// four 8 x 8 matrices of 16-bit elements from shared memory (lanes 8 i .. 8 i + 7 give the row addresses of matrix
// i): v[i] = matrix i's row l / 4, bytes 4 (l % 4) .. + 3
__device__ __forceinline__ void ldsm_x4(const void* p, u32 (&v)[4]) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(a));
}

// 8 bytes global -> shared, asynchronously
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
    unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(d), "l"(gmem) : "memory");
}

// 4 bytes global -> shared, asynchronously; ok = false: 4 zero bytes (nothing read)
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
    unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(d), "l"(gmem), "r"(ok ? 4 : 0) : "memory");
}

// p, with its provenance hidden from the compiler: kept in registers instead of being worked out again at every use
// (ptxas rematerialised the row and staging addresses in every K step: ~140 instructions a step)
template <typename T>
__device__ __forceinline__ T* opaque(T* p) {
    asm volatile("" : "+l"(p));
    return p;
}

// 8 e2m1 codes (nibbles 0..7 of q) -> float16 pairs of the codes x 2^-14: p04 = (code 0, code 4), p15, p26, p37
__device__ __forceinline__ void e2m1_to_f16(u32 q, u32& p04, u32& p15, u32& p26, u32& p37) {
    const u32 ev = ((q << 1) & 0x0E0E0E0Eu) | ((q << 4) & 0x80808080u);  // codes 0 2 4 6 as e5m2 bytes
    const u32 od = ((q >> 3) & 0x0E0E0E0Eu) | (q & 0x80808080u);  // codes 1 3 5 7
    p04 = __byte_perm(ev, 0u, 0x2404u);  // bytes (0, ev.b0, 0, ev.b2): float16 high bytes
    p15 = __byte_perm(od, 0u, 0x2404u);
    p26 = ev & 0xFF00FF00u;
    p37 = od & 0xFF00FF00u;
}

// float 2^(s - 127) for the E8M0 byte s = byte b of v, 1 <= s <= 254 (the byte masked in place and moved to the
// exponent field; the 2^14 the float16 codes lack is in the activation scales)
__device__ __forceinline__ float wscale(u32 v, int b) {
    return __uint_as_float(b == 3 ? (v >> 1) & 0x7F800000u : (v & (0xFFu << (8 * b))) << (23 - 8 * b));
}

// D = A x B + C, float16 A 16 x 16 (a0: row g, k 2c, 2c+1; a1: row g + 8; a2, a3: k + 8), B 16 x 8 (b0: k 2c, 2c+1,
// column g; b1: k + 8), float32 D rows g (d0, d1) and g + 8 (d2, d3), columns 2c, 2c + 1
__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int NT, int MT, bool SPLIT, bool IDS64>
__global__ void __launch_bounds__(128, MINB) fp4_moe_f16(
        const u16* __restrict__ x, const float* __restrict__ xsc, const u8* __restrict__ w, const u8* __restrict__ s,
        const void* __restrict__ ids, u16* __restrict__ out, float* __restrict__ part, int* __restrict__ ctr,
        int M, int N, int K, int E, int n_slots, int steps_per_split, int n_split, int max_pass, int pdl_early) {
    __shared__ int s_rows[1024];
    __shared__ u32 s_bits[32];
    __shared__ int s_e, s_cnt, s_nact, s_last;
    // the ring of STAGES K steps (dynamic): per slot the block's weights (64 MT rows x 128 bytes, the 16-byte groups
    // of row r at chunk j ^ (r & 7): ldmatrix reads 8 rows of one group without bank conflicts), their scales
    // (8 bytes a row), the pass's activations (float16, 8 NT tokens x XROW) and their scales [128-block][token]
    extern __shared__ __align__(128) u8 ring[];
    constexpr int W_BYTES = 64 * MT * 128, WS_BYTES = 64 * MT * 8, X_BYTES = NT * 8 * XROW, XS_BYTES = 2 * NT * 8 * 4;
    constexpr int SLOT = W_BYTES + WS_BYTES + X_BYTES + XS_BYTES;
    int* s_ids = reinterpret_cast<int*>(ring);  // the ids, read before the ring is first filled (4 KB of it)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int slot = blockIdx.y, split = blockIdx.z;
    const int words = (E + 31) >> 5;
""" + fm.SLOT_ROWS + r"""    const int K2 = K >> 1, KS = K >> 5, KB = K >> 7;
    const int steps = K / 256;
    const int k_lo = split * steps_per_split;
    const int k_hi = min(k_lo + steps_per_split, steps);
    // this thread's weight chunks: rows (tid >> 3) + 16 q of the block, 16-byte group tid & 7 (whole 128-byte lines
    // per 8 threads); its scale rows: tid + 128 q
    const int wr = tid >> 3, wj = tid & 7;
    const u8* wsrc = opaque(w + ((long long)e * N + row_block + wr) * K2 + wj * 16);
    const u8* ssrc_w = opaque(s + ((long long)e * N + row_block + tid) * KS);
    const int wdst = wr * 128 + ((wj ^ (wr & 7)) << 4);
    // ldmatrix row addresses of this lane: matrix l / 8 (0, 1: group j, rows 0-7 / 8-15 of a 16-row tile; 2, 3:
    // group j + 1), row l % 8; the group's chunk is (j + (l >> 4)) ^ (l & 7) = j ^ t for even j
    const int lrow = warp * 16 * MT + ((lane >> 3) & 1) * 8 + (lane & 7);
    const int lt = (lane >> 4) ^ (lane & 7);
    const int lds_w = lrow * 128;
    const int lds_s = (warp * 16 * MT + g) * 8;
    const int n0 = row_block + warp * 16 * MT;

    for (int pass = 0; pass < max_pass && pass * 8 * NT < cnt; ++pass) {
        const int t0 = pass * 8 * NT;
        // activations of a step: token j's 512 bytes (in the MMA's order already) as 4 segments (one per lane column
        // c) of 8 chunks of 16 bytes at j * XROW + c * XSEG + chunk * 16 (XSEG = 144: the 8 lanes of a 16-byte load
        // phase fall in 8 different bank groups); its two block scales; tokens past cnt: zeros. Sources and
        // destinations worked out once per pass
        const u16* xsrc[2 * NT];
        int xdst[2 * NT];
        bool xok[2 * NT];
#pragma unroll
        for (int r = 0; r < 2 * NT; ++r) {
            const int i = tid + 128 * r, j = i >> 5, ch = i & 31, t = t0 + j;
            xok[r] = t < cnt;
            xsrc[r] = opaque(x + (long long)(xok[r] ? s_rows[t] : 0) * K + ch * 8);
            xdst[r] = W_BYTES + WS_BYTES + j * XROW + (ch >> 3) * XSEG + (ch & 7) * 16;
        }
        const int sj = tid >> 1, sbk = tid & 1;
        const bool sok = tid < 16 * NT && t0 + sj < cnt;
        const float* ssrc = opaque(xsc + (long long)(sok ? s_rows[t0 + sj] : 0) * KB + sbk);
        const int sdst = W_BYTES + WS_BYTES + X_BYTES + (sbk * NT * 8 + sj) * 4;
        auto stage = [&](int ks, int st) {  // step ks -> slot st
            u8* base = ring + st * SLOT;
#pragma unroll
            for (int q = 0; q < 4 * MT; ++q)
                cp_async16(base + wdst + q * 2048, wsrc + (long long)q * 16 * K2 + ks * 128, true);
#pragma unroll
            for (int q = 0; q < (64 * MT + 127) / 128; ++q)
                if (tid + 128 * q < 64 * MT)
                    cp_async8(base + W_BYTES + (tid + 128 * q) * 8, ssrc_w + (long long)q * 128 * KS + ks * 8);
#pragma unroll
            for (int r = 0; r < 2 * NT; ++r) cp_async16(base + xdst[r], xsrc[r] + ks * 256, xok[r]);
            if (tid < 16 * NT) cp_async4(base + sdst, ssrc + ks * 2, sok);
        };
        __syncthreads();  // the previous pass's readers are done with the ring
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p) {
            if (k_lo + p < k_hi) stage(k_lo + p, p);
            cp_async_commit();
        }
        float acc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

        int st = 0;
        for (int ks = k_lo; ks < k_hi; ++ks) {
            cp_async_wait<STAGES - 2>();  // this thread's copies of step ks have landed ...
            __syncthreads();  // ... and everyone's; the slot of step ks - 1 is free again
            {
                const int nx = ks + STAGES - 1, ns = st == 0 ? STAGES - 1 : st - 1;
                if (nx < k_hi) stage(nx, ns);
                cp_async_commit();  // (an empty group past the end keeps the count per step uniform)
            }
            const u8* base = ring + st * SLOT;
            const u8* xst = base + W_BYTES + WS_BYTES + g * XROW + c * XSEG;
            const float* xss = reinterpret_cast<const float*>(base + W_BYTES + WS_BYTES + X_BYTES);
            uint2 sv[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    sv[mt][h] = *reinterpret_cast<const uint2*>(base + W_BYTES + lds_s + (mt * 16 + 8 * h) * 8);
#pragma unroll
            for (int blk = 0; blk < 2; ++blk) {  // 128 codes: one activation scale per token
                float ab[MT][NT][4];  // the block's sum, weight scales applied
#pragma unroll
                for (int jp = 0; jp < 2; ++jp) {  // two groups: one ldmatrix.x4 per 16-row tile
                    const int j0 = blk * 4 + jp * 2;
                    u32 wq[MT][4];  // (row g, j0), (row g + 8, j0), (g, j0 + 1), (g + 8, j0 + 1): word c of each
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        ldsm_x4(base + lds_w + mt * 16 * 128 + ((j0 ^ lt) << 4), wq[mt]);
#pragma unroll
                    for (int gi = 0; gi < 2; ++gi) {
                        const int j = j0 + gi;  // the 32-code group: one weight scale per row
                        U4 xb[NT];
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            xb[nt] = *reinterpret_cast<const U4*>(xst + nt * 8 * XROW + j * 16);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            u32 p0, p1, p2, p3, q0, q1, q2, q3;
                            e2m1_to_f16(wq[mt][2 * gi], p0, p1, p2, p3);
                            e2m1_to_f16(wq[mt][2 * gi + 1], q0, q1, q2, q3);
                            const float w0 = wscale(j < 4 ? sv[mt][0].x : sv[mt][0].y, j & 3);
                            const float w1 = wscale(j < 4 ? sv[mt][1].x : sv[mt][1].y, j & 3);
#pragma unroll
                            for (int nt = 0; nt < NT; ++nt) {
                                float d[4] = {0.f, 0.f, 0.f, 0.f};
                                mma_f16(d, p0, q0, p1, q1, xb[nt].x, xb[nt].y);
                                mma_f16(d, p2, q2, p3, q3, xb[nt].z, xb[nt].w);
                                float* o = ab[mt][nt];
                                if (jp == 0 && gi == 0) {
                                    o[0] = d[0] * w0; o[1] = d[1] * w0; o[2] = d[2] * w1; o[3] = d[3] * w1;
                                } else {
                                    o[0] = fmaf(d[0], w0, o[0]); o[1] = fmaf(d[1], w0, o[1]);
                                    o[2] = fmaf(d[2], w1, o[2]); o[3] = fmaf(d[3], w1, o[3]);
                                }
                            }
                        }
                    }
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {  // tokens 2c, 2c + 1: their scales of this block
                    const float2 sc = *reinterpret_cast<const float2*>(xss + blk * NT * 8 + nt * 8 + 2 * c);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        float* a = acc[mt][nt];
                        const float* o = ab[mt][nt];
                        a[0] = fmaf(o[0], sc.x, a[0]); a[1] = fmaf(o[1], sc.y, a[1]);
                        a[2] = fmaf(o[2], sc.x, a[2]); a[3] = fmaf(o[3], sc.y, a[3]);
                    }
                }
            }
            st = st == STAGES - 1 ? 0 : st + 1;
        }
        cp_async_wait<0>();  // (groups left empty past the end: nothing in flight into the ring after the pass)
""" + fm.EPILOGUE + r"""    }
}
"""


STAGES = 2  # K steps in the shared-memory ring (one copied while one is computed; 3 measured slower)
MIN_BLOCKS = 0  # __launch_bounds__ minimum blocks per SM (0: no register bound)


def _source() -> str:
    return (fm.fill(fm.HELPERS + nvrtc.PDL_DEVICE + _KERNEL).replace("XROW", str(fm.X_ROW))
            .replace("XSEG", str(fm.X_SEG))
            .replace("STAGES", str(STAGES)).replace("MINB", str(MIN_BLOCKS)))


def smem_bytes(nt: int, mt: int) -> int:
    """The ring's size (dynamic shared memory) of tile (nt, mt): STAGES x (weights, their scales, activations,
    their scales)."""
    return STAGES * (64 * mt * 128 + 64 * mt * 8 + nt * 8 * fm.X_ROW + 2 * nt * 8 * 4)


VARIANTS = [(nt, mt, split, ids64) for nt in (1, 2, 4) for mt in (1, 2, 4) for split in (False, True)
            for ids64 in (False, True)]


def _name(nt: int, mt: int, split: bool, ids64: bool) -> str:
    return f"fp4_moe_f16<{nt}, {mt}, {str(split).lower()}, {str(ids64).lower()}>"


PROGRAM = nvrtc.Program(_source(), "fp4_moe_f16.cu", [_name(*v) for v in VARIANTS])


_CONFIGURED: set = set()


def _kernel(device: torch.device, nt: int, mt: int, split: bool, ids64: bool):
    """The instance, allowed its ring's shared memory (over 48 KB needs the opt-in, once per kernel)."""
    kern = PROGRAM.kernels(device)[_name(nt, mt, split, ids64)]
    key = (str(device), nt, mt, split, ids64)
    if key not in _CONFIGURED:
        # static + dynamic over 48 KB needs the attribute even for a smaller dynamic part (torch sets it only from
        # 48 KB of dynamic memory up): ask for at least that
        kern.set_shared_memory_config(max(smem_bytes(nt, mt), 48 * 1024))
        _CONFIGURED.add(key)
    return kern


def scales_ok(w_scale: torch.Tensor) -> bool:
    """Every E8M0 byte in 1 .. 254 (:func:`.gemm_decode.scale_range`, cached): the kernel makes 2^(s - 127) from the
    exponent bits alone (byte 0, 2^-127, would come out as 0; 255 is E8M0's NaN)."""
    rng = gd.scale_range(w_scale)
    return rng is not None and rng[0] >= 1 and rng[1] <= 254


def eligible(x: torch.Tensor, w_scale: torch.Tensor | None, rows: int) -> bool:
    """The shapes :mod:`.fp4_moe_mma` takes (:func:`.fp4_moe_mma.shape_ok`) and :func:`scales_ok`."""
    return fm.shape_ok(x, w_scale, rows) and scales_ok(w_scale)


def available(device: torch.device) -> bool:
    """Whether the kernels are loaded on ``device`` (compute capability 8.0+, NVRTC present); built at the first ask
    outside CUDA-graph capture, a failure kept in ``PROGRAM.error``."""
    return PROGRAM.available(device)


# ---- the activations: float16 per 128-channel block, in the kernel's K order (Triton) -------------------------

@triton.jit
def _scale_kernel(x_ptr, y_ptr, s_ptr, K, PDL: tl.constexpr = False):
    """One program per (row, K step of 256): each 128-block's scale 2^(ceil(log2 amax) - 15) from amax's exponent
    and mantissa bits (1 for a zero block), x / scale as float16 at the kernel's position of code
    k = 32 j + 8 c + r: c * 64 + j * 8 + 2 (r % 4) + r // 4."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    step = tl.program_id(1)
    kk = tl.arange(0, 2)[:, None] * 128 + tl.arange(0, 128)[None, :]  # code within the step
    v = tl.load(x_ptr + row * K + step * 256 + kk).to(tl.float32)
    bits = tl.max(tl.abs(v), 1).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32) - 15  # biased exponent of the scale
    e = tl.where(bits == 0, 127, tl.minimum(tl.maximum(e, 1), 254))
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / s, exact (a power of two in range)
    r = kk & 7
    pos = ((kk >> 3) & 3) * 64 + (kk >> 5) * 8 + 2 * (r & 3) + (r >> 2)
    tl.store(y_ptr + row * K + step * 256 + pos, (v * inv[:, None]).to(tl.float16))
    tl.store(s_ptr + row * (K // 128) + step * 2 + tl.arange(0, 2), s * 16384.0)  # x 2^14: see wscale


def scale_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 256) -> (float16 [M, K] in the kernel's K order, float32 scales [M, K / 128]):
    x[m, 128 b + i] ~= y[m, position(i)] * scale[m, b] (exact for |x| >= amax x 2^-31 of the block)."""
    m, k = x.shape
    if k % 256:
        raise ValueError(f"scale_act: K = {k} is not a multiple of 256")
    y = torch.empty(m, k, dtype=torch.float16, device=x.device)
    s = torch.empty(m, k // ACT_BLOCK, dtype=torch.float32, device=x.device)
    if m:
        _scale_kernel[(m, k // 256)](x.contiguous(), y, s, k, num_warps=2, **pdl())
    return y, s


def natural_order(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`scale_act`'s K order: [M, K] in natural order (tests)."""
    m, k = y.shape
    kk = torch.arange(256, device=y.device)
    r = kk & 7
    pos = ((kk >> 3) & 3) * 64 + (kk >> 5) * 8 + 2 * (r & 3) + (r >> 2)
    return y.view(m, k // 256, 256)[:, :, pos].reshape(m, k)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T for bfloat16 x [M, K] over fp4 experts w [E, N, K/2] with E8M0 scales
    [E, N, K/32] (callers check :func:`eligible` and :func:`available`); bfloat16 [M, N]; rows with an
    id outside [0, E) are zeros."""
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    p = fm.launch_plan(x, w, expert_ids)
    xh, xs = scale_act(x)
    part = torch.empty(p.split, m, n, dtype=torch.float32, device=x.device) if p.split > 1 else out
    kern = _kernel(x.device, p.nt, p.mt, p.split > 1, p.ids64)
    nvrtc.launch(kern, p.grid, (fm.WARPS * 32, 1, 1),
                 [xh, xs, w.view(torch.uint8), w_scale.view(torch.uint8), p.ids, out, part,
                  p.ctr if p.ctr is not None else out, m, n, k, w.shape[0], p.n_slots, p.sps, p.split, p.max_pass],
                 shared_mem=smem_bytes(p.nt, p.mt), early=False)  # (as fp4_moe_mma's: nvrtc.launch)
    return out
