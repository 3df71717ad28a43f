"""MoE decode over FP4 experts by a hand-written CUDA kernel (NVRTC): weights loaded straight into the registers
that feed ``mma.sync`` (no shared memory for them, no wgmma bookkeeping), the activations staged in shared memory.

Same op as :mod:`.gemm_fp4_moe` -- out[m, :] = x[m, :] @ W[e(m)]^T, bfloat16 x [M, K], FP4 experts W int8
[E, N, K/2] (element 2c in the low nibble of byte c, e2m1) with E8M0 scales uint8 [E, N, K/32], W[n, k] =
e2m1(code) * 2^(s[n, k // 32] - 127) (``quant.fp4.dequant_fp4``); rows whose id lies outside [0, E) come out as
zeros -- written for what held that Triton kernel at ~60 % of HBM: its instruction stream (~300 instructions per
thread per 4 KB of weights, of which only 144 decode; scripts/bench_results/fp4_moe_h100_session4.txt). Here the
weights need no layout change at load; the *K order* inside each MMA is chosen to fit the bytes as they lie:

- a warp owns 16 x MT weight rows; lane l = 4 g + c holds rows g and g + 8 of each 16-row tile (the A fragment
  rows of ``mma.m16n8k16``) and, per K step of 256 codes, the 64 codes [64 c, 64 c + 64) of those rows: two
  16-byte loads per row, a whole 128-byte line per row across the 4 lanes of a row;
- a 32-bit word of 8 codes is decoded into 4 bfloat16 pairs P_j = (code j, code j + 4) (:mod:`.ptx_fp4`: 10
  ALU-pipe operations, 5 shifts ptxas puts on the FMA pipe and 4 bf16x2 multiplies per word; E8M0 scale bytes
  <= 128 only: one multiply by 2^(s - 1)), and the word feeds two MMAs: A = (P0 row g, P0 row g+8, P1 row g,
  P1 row g+8), then P2 / P3. The MMA's k slots (2c, 2c+1, 2c+8, 2c+9) then hold codes (0, 4, 1, 5), resp.
  (2, 6, 3, 7), of the word;
- the activations are permuted to that order (within each 8 columns: 0 4 1 5 2 6 3 7), so one 16-byte load gives
  the B fragments (token = lane / 4) of both MMAs of a word. The block's 4 warps share the pass's 8 x NT tokens:
  the block puts each K step's activations in shared memory one step ahead of use (zeros past the last row; one
  barrier per step), and the warps read them from there. (Each warp had loaded its own from global memory just
  before use. Nsight Compute then showed a fifth of the stall samples on the first MMA of each step, waiting for
  that load: scripts/bench_results/h200_session17.txt.) With one 8-token tile (NT = 1, the decode step's) each
  thread loads its 2 chunks of 16 bytes of a step into registers two steps ahead, permutes them (4 ``prmt``) and
  stores them; larger tiles copy them unchanged (``cp.async``) from a permuted copy made before the launch (their
  extra 16-32 registers would cost the NT = 2 / 4 instances a block per SM: 128 -> 160, 162 -> 196 registers).
  Session 23 moved the permutation of the NT = 1 case into the kernel: 6 launches less a decode step, as fast
  within noise (scripts/bench_results/h200_session23.txt);
- each 32-code group has one scale, and a lane's 64 codes are two whole groups: one 2-byte scale load per row
  and K step.

A block (4 warps, 64 x MT rows) serves one (row tile, expert slot, K split): slot j takes the j-th active expert
(increasing id, found in the block from ``expert_ids``) and its rows in increasing order, 8 x NT of them per pass
(more rows: further passes over the same weights); the slot after the last active expert writes the zero rows.
K splits (while the blocks would not fill ``ctas`` per SM) store float32 partials; the block that arrives last
at a tile (arrival counter, :func:`.gemm_tc._counters`) adds them in split order (deterministic) and writes the
bfloat16 output. Products are exact (bf16 x bf16 into float32); results differ from the reference op only in the
order of summation.

Built at first use with NVRTC (``torch.cuda._utils``: the CUDA runtime compiler torch loads; no CUDA toolkit
needed) for the device's compute capability (sm_80+: ``mma.sync`` bf16; ``fma.rn.bf16x2``); unavailable builds
fall back to :mod:`.gemm_fp4_moe` (``available``). :mod:`.gemm` routes fp4 MoE calls of up to 3 rows per expert
here by default (since session 15: the decode step measured faster with it and its graph-vs-eager tests passed; since
session 24, calls of more rows per expert go to :mod:`.fp4_moe_f16`, 1.04-1.06x as fast there);
``ATB_CUDA_FP4_MOE=bf16`` sends every call here, ``=new`` keeps the Triton kernel.

The K loop is unrolled twice (``#pragma unroll 2``; ptxas then spills nothing at the (1, 2) tile's 128-register
bound). Session 17 made three changes: the activations in shared memory, the unrolled loop and the :mod:`.ptx_fp4`
decoder. On a lent H200, with all three, the kernel ran 1.10-1.16x as fast as session 16's at 8-64 tokens x top-6
(w13 at 8 / 32 tokens: 62 -> 68 / 65 -> 71 % of the copy bandwidth). At one token it was 4-6 % slower for w13 and as
fast for w2 (scripts/bench_results/h200_session17.txt). Session 23: the (1, 2) tile's K loop is written once per step
parity (two register sets of weights that swap roles: the 36 register copies a step are gone) and every tile makes
a scale pair with one ``prmt`` and one multiply-add; the loop then issues 833 instead of 893 instructions a step
(SASS of the (1, 2) tile from NVRTC 12.9; 608 of them the decode). On an H200, against the previous code in the same
call: 1.02-1.06x at 8-32 tokens, 1.03-1.04x at one, 1.01x at 64. The parity loop in every tile (an earlier
form, built by NVRTC 12.9) made the one-token tile (1, 1) 10-12 % slower for w13 / w2 and the (2, 2) tile at 64
tokens 1-2 % slower, so only (1, 2) has it (scripts/bench_results/h200_session23.txt).

The CUDA source and the launcher that sizes its grid stay one module of about 620 lines, most of them the kernel
(the launch arguments follow the kernel's template parameters line by line); its helpers, slot prologue and epilogue
are named pieces of the source (``HELPERS``, ``SLOT_ROWS``, ``EPILOGUE``) that :mod:`.fp4_moe_f16` shares, as it
shares :func:`launch_plan`; the NVRTC build and its disk cache are :mod:`.nvrtc`'s. The decoder PTX lives apart
(:mod:`.ptx_fp4`) because it is tested apart, on the CPU.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import gemm_decode as gd
from . import gemm_tc as tc
from . import nvrtc
from ._util import sm_count
from .ptx_fp4 import FP4X8_PTX

K_STEP = 256  # codes per row per K step (4 lanes x 64)
ROWS_PER_WARP_TILE = 16
WARPS = 4
MAX_ROWS = 1024  # rows of one call (the block keeps the ids and its expert's rows in shared memory)
MAX_EXPERTS = 1024  # one bit per expert in a 32-word bitmap
# K steps of activations in shared memory, copied one step ahead (3 stages measured no faster on an H200, session 17;
# the K loop's body is written per step parity since session 23, so the count is fixed)
X_STAGES = 2
X_SEG = 144  # bytes per (token, lane column) segment: 128 + 16 padding (bank spread)
X_ROW = 4 * X_SEG  # bytes per token and K step

_DECODE = gd.one_multiply(FP4X8_PTX).replace("$", "%")

HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 ldg_stream(const void* p) {
    U4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ U4 ldg_nc(const void* p) {
    U4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 ldg_u16(const void* p) {
    u16 r;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return (u32)r;
}

// 8 e2m1 codes (nibbles 0..7 of q) -> bfloat16 pairs P_j = (code j, code j + 4) * sc (sc: bf16x2 2^(s - 1))
__device__ __forceinline__ void decode8(u32 q, u32 sc, u32& p0, u32& p1, u32& p2, u32& p3) {
    asm(DECODE_PTX : "=r"(p0), "=r"(p1), "=r"(p2), "=r"(p3) : "r"(q), "r"(sc));
}

__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; ok = false: 16 zero bytes (nothing read)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
    unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ float ld_cg(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ u16 to_bf16(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// bf16x2 of 2^(s - 1) for E8M0 byte s = byte `half` of sv, s <= 128: bits (s + 126) << 7 in both halves (a byte
// permute puts s in both halves' low bytes, one multiply-add shifts and rebiases both: no carry, s + 126 < 512)
__device__ __forceinline__ u32 scale2b(u32 sv, int half) {
    return __byte_perm(sv, 0u, half ? 0x4141u : 0x4040u) * 128u + 0x3F003F00u;
}

"""

# the block's expert slot and its rows (s_ids, s_rows, s_bits, s_e, s_cnt, s_nact: shared; e, cnt, row_block);
# the slot past the last active expert writes the zero rows and returns
SLOT_ROWS = r"""
    // ---- this slot's expert and its rows (the ids and x: the previous kernels' outputs)
    pdl_wait(pdl_early);
    if (tid < 32) s_bits[tid] = 0u;
    __syncthreads();
    for (int m = tid; m < M; m += 128) {
        int id = IDS64 ? (int)((const long long*)ids)[m] : ((const int*)ids)[m];
        if (id < 0 || id >= E) id = -1;
        s_ids[m] = id;
        if (id >= 0) atomicOr(&s_bits[id >> 5], 1u << (id & 31));
    }
    __syncthreads();
    if (warp == 0) {
        u32 word = lane < words ? s_bits[lane] : 0u;
        int pc = __popc(word), incl = pc;
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        int n_act = __shfl_sync(0xffffffffu, incl, 31);
        int excl = incl - pc;
        if (slot < n_act && excl <= slot && slot < incl) {
            for (int j = 0; j < slot - excl; ++j) word &= word - 1u;
            s_e = lane * 32 + __ffs(word) - 1;
        }
        if (lane == 0) s_nact = n_act;
    }
    __syncthreads();
    const int n_act = s_nact;
    if (slot > n_act) return;
    const int e = slot < n_act ? s_e : -1;  // -1: the rows whose id lies outside [0, E)
    if (warp == 0) {
        int cnt = 0;
        for (int base = 0; base < M; base += 32) {
            int m = base + lane;
            bool sel = m < M && s_ids[m] == e;
            u32 bal = __ballot_sync(0xffffffffu, sel);
            if (sel) s_rows[cnt + __popc(bal & ((1u << lane) - 1u))] = m;
            cnt += __popc(bal);
        }
        if (lane == 0) s_cnt = cnt;
    }
    __syncthreads();
    const int cnt = s_cnt;
    const int row_block = blockIdx.x * (WARPS_ * 16 * MT);
    if (e < 0) {  // zero rows: written once (split 0)
        if (split == 0)
            for (int i = tid; i < cnt * WARPS_ * 16 * MT; i += 128) {
                int r = i / (WARPS_ * 16 * MT), n = row_block + i % (WARPS_ * 16 * MT);
                if (n < N) out[(long long)s_rows[r] * N + n] = 0;
            }
        return;
    }

"""

# per pass: acc[MT][NT][4] (rows n0 + mt * 16 + g (+ 8), tokens t0 + nt * 8 + 2 c (+ 1)) to out, or to the split
# partials and the last arriving block adds them
EPILOGUE = r"""
        // ---- epilogue: C fragment (row g / g + 8, tokens 2c, 2c + 1)
        const int tile = (slot * gridDim.x + blockIdx.x) * max_pass + pass;
        if (SPLIT) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        int t = t0 + nt * 8 + 2 * c + (i & 1);
                        int n = n0 + mt * 16 + g + 8 * (i >> 1);
                        if (t < cnt) part[((long long)split * M + s_rows[t]) * N + n] = acc[mt][nt][i];
                    }
            __threadfence();
            __syncthreads();
            if (tid == 0) s_last = atomicAdd(ctr + tile, 1) == n_split - 1;
            __syncthreads();
            if (!s_last) continue;
            __threadfence();
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        int t = t0 + nt * 8 + 2 * c + (i & 1);
                        int n = n0 + mt * 16 + g + 8 * (i >> 1);
                        if (t < cnt) {
                            long long o = (long long)s_rows[t] * N + n;
                            float v = 0.f;
                            for (int sp = 0; sp < n_split; ++sp) v += ld_cg(part + (long long)sp * M * N + o);
                            out[o] = to_bf16(v);
                        }
                    }
            if (tid == 0) ctr[tile] = 0;
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        int t = t0 + nt * 8 + 2 * c + (i & 1);
                        int n = n0 + mt * 16 + g + 8 * (i >> 1);
                        if (t < cnt) out[(long long)s_rows[t] * N + n] = to_bf16(acc[mt][nt][i]);
                    }
        }
"""

_SRC = HELPERS + (
    r"""// (NT, MT) = (1, 2), the decode step's tile at <= 3 rows per expert, is held to 128 registers: 4 blocks per SM
// instead of 3 (session 16: ptxas spilled ~120 bytes under it; since session 17's shared-memory activations and
// unrolled loop, nothing). On an H200 (scripts/bench_results/h200_session16.txt) that tile then ran
// 2-4 % faster at 8 tokens x top-6 and 6-8 % at 32; the same bound on the other tiles made them slower (1 token:
// 12-14 %), so they keep theirs (a minimum of 0 blocks: no bound, as before)
template <int NT, int MT, bool SPLIT, bool IDS64>
__global__ void __launch_bounds__(128, (NT == 1 && MT == 2) ? 4 : 0) fp4_moe_mma(
        const u16* __restrict__ x, const u8* __restrict__ w, const u8* __restrict__ s, const void* __restrict__ ids,
        u16* __restrict__ out, float* __restrict__ part, int* __restrict__ ctr,
        int M, int N, int K, int E, int n_slots, int steps_per_split, int n_split, int max_pass, int pdl_early) {
    __shared__ int s_ids[1024];
    __shared__ int s_rows[1024];
    __shared__ u32 s_bits[32];
    __shared__ int s_e, s_cnt, s_nact, s_last;
    __shared__ __align__(16) u8 s_x[XSTAGES * NT * 8 * XROW];  // the pass's activations, XSTAGES K steps
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int slot = blockIdx.y, split = blockIdx.z;
    constexpr bool XNAT = NT == 1;  // x in natural K order, permuted here (else by a copy before the launch)
    // the K loop written per step parity (no register copies between steps): faster for the (1, 2) tile, the decode
    // step's at 8-32 tokens x top-6; slower for (1, 1) at one token and for (2, 2) (H200, session 23)
    constexpr bool PARITY = NT == 1 && MT == 2;
    const int words = (E + 31) >> 5;
""" + SLOT_ROWS + r"""    const int K2 = K >> 1, KS = K >> 5;
    const int steps = K / 256;
    const int k_lo = split * steps_per_split;
    const int k_hi = min(k_lo + steps_per_split, steps);
    const u8* wb = w + (long long)e * N * K2;
    const u8* sb = s + (long long)e * N * KS;
    const int n0 = row_block + warp * 16 * MT;
    const u8* wrow[MT][2];
    const u8* srow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = n0 + mt * 16 + g + 8 * h;
            wrow[mt][h] = wb + (long long)r * K2 + c * 32;
            srow[mt][h] = sb + (long long)r * KS + c * 2;
        }

    for (int pass = 0; pass < max_pass && pass * 8 * NT < cnt; ++pass) {
        const int t0 = pass * 8 * NT;
        // activations of step ks -> stage st: token j's 256 codes as 4 segments (one per lane column c) of 8 chunks
        // of 16 bytes, at j * XROW + c * XSEG + chunk * 16 (XSEG = 144, XROW = 576: the 8 lanes of a 16-byte load
        // phase -- tokens g, g + 1, columns c = 0..3 -- fall in 8 different bank groups); tokens past cnt: zeros
        auto stage_x = [&](int ks, int st) {
#pragma unroll
            for (int r = 0; r < 2 * NT; ++r) {
                const int i = tid + 128 * r, j = i >> 5, ch = i & 31, t = t0 + j;
                const bool ok = t < cnt;
                cp_async16(s_x + (st * NT * 8 + j) * XROW + (ch >> 3) * XSEG + (ch & 7) * 16,
                           x + (long long)(ok ? s_rows[t] : 0) * K + ks * 256 + ch * 8, ok);
            }
        };
        // XNAT (x in natural K order): each thread's 2 NT chunks of a step are loaded into registers two steps
        // ahead, put in the MMA's K order (4 byte permutes a chunk) and stored to the stage one step ahead
        U4 xr[2 * NT];
        auto load_x = [&](int ks) {
#pragma unroll
            for (int r = 0; r < 2 * NT; ++r) {
                const int i = tid + 128 * r, j = i >> 5, ch = i & 31, t = t0 + j;
                if (t < cnt) xr[r] = ldg_nc(x + (long long)s_rows[t] * K + ks * 256 + ch * 8);
                else xr[r].x = xr[r].y = xr[r].z = xr[r].w = 0u;
            }
        };
        auto store_x = [&](int st) {
#pragma unroll
            for (int r = 0; r < 2 * NT; ++r) {
                const int i = tid + 128 * r, j = i >> 5, ch = i & 31;
                U4 v = xr[r], q;  // (x0 x1)(x2 x3)(x4 x5)(x6 x7) -> (x0 x4)(x1 x5)(x2 x6)(x3 x7)
                q.x = __byte_perm(v.x, v.z, 0x5410);
                q.y = __byte_perm(v.x, v.z, 0x7632);
                q.z = __byte_perm(v.y, v.w, 0x5410);
                q.w = __byte_perm(v.y, v.w, 0x7632);
                *reinterpret_cast<U4*>(s_x + (st * NT * 8 + j) * XROW + (ch >> 3) * XSEG + (ch & 7) * 16) = q;
            }
        };
        __syncthreads();  // the previous pass's readers are done with the stages
        if (XNAT) {
            if (k_lo < k_hi) {
                load_x(k_lo);
                store_x(0);
            }
            if (k_lo + 1 < k_hi) load_x(k_lo + 1);
        } else {
#pragma unroll
            for (int p = 0; p < XSTAGES - 1; ++p) {
                if (k_lo + p < k_hi) stage_x(k_lo + p, p);
                cp_async_commit();
            }
        }
        const u8* xs = s_x + g * XROW + c * XSEG;  // this lane's token g, column c (+ nt * 8 tokens, + stage)
        float acc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

        // one K step: the weights wv and scales sv of each row, the activations of stage xst
        auto compute = [&](const U4 (&wv)[MT][2][2], const u32 (&sv)[MT][2], const u8* xst) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // 32 codes = one scale group per row
                u32 sc[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) sc[mt][h] = scale2b(sv[mt][h], half);
#pragma unroll
                for (int wd = 0; wd < 4; ++wd) {  // word: 8 codes of each row -> 2 MMAs per row tile
                    U4 xb[NT];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        xb[nt] = *reinterpret_cast<const U4*>(xst + nt * 8 * XROW + half * 64 + wd * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        u32 q0 = wd == 0 ? wv[mt][0][half].x : wd == 1 ? wv[mt][0][half].y
                               : wd == 2 ? wv[mt][0][half].z : wv[mt][0][half].w;
                        u32 q1 = wd == 0 ? wv[mt][1][half].x : wd == 1 ? wv[mt][1][half].y
                               : wd == 2 ? wv[mt][1][half].z : wv[mt][1][half].w;
                        u32 a0, a1, a2, a3, b0, b1, b2, b3;
                        decode8(q0, sc[mt][0], a0, a1, a2, a3);
                        decode8(q1, sc[mt][1], b0, b1, b2, b3);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            mma16816(acc[mt][nt], a0, b0, a1, b1, xb[nt].x, xb[nt].y);
                            mma16816(acc[mt][nt], a2, b2, a3, b3, xb[nt].z, xb[nt].w);
                        }
                    }
                }
            }
        };
        auto load_w = [&](int ks, U4 (&wd)[MT][2][2], u32 (&sd)[MT][2]) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    wd[mt][h][0] = ldg_stream(wrow[mt][h] + ks * 128);
                    wd[mt][h][1] = ldg_stream(wrow[mt][h] + ks * 128 + 16);
                    sd[mt][h] = ldg_u16(srow[mt][h] + ks * 8);
                }
        };
        // the step's barrier, then the activations of step ks + 1 staged (stage st ^ 1) while step ks is computed
        auto stage_next = [&](int ks, int st) {
            if (!XNAT) cp_async_wait<XSTAGES - 2>();  // this thread's copies of step ks have landed ...
            __syncthreads();  // ... and everyone's (XNAT: stored); stage (st - 1) is free again
            if (XNAT) {
                if (ks + 1 < k_hi) store_x(st ^ 1);
                if (ks + 2 < k_hi) load_x(ks + 2);
            } else {
                if (ks + 1 < k_hi) stage_x(ks + 1, st ^ 1);
                cp_async_commit();  // (an empty group past the end keeps the count per step uniform)
            }
        };
        if constexpr (PARITY) {
            // weights and scales of two K steps (the one decoded, the next in flight) by step parity: the loop body
            // is inlined once per parity, so the buffers swap roles without register copies and the stage is a
            // constant offset
            U4 wb[2][MT][2][2];
            u32 sb2[2][MT][2];
            if (k_lo < k_hi) load_w(k_lo, wb[0], sb2[0]);
            auto kstep = [&](int ks, const int st) {  // st: 0 / 1, a literal at both calls (inlined)
                stage_next(ks, st);
                if (ks + 1 < k_hi) load_w(ks + 1, wb[st ^ 1], sb2[st ^ 1]);  // in flight while this one is decoded
                compute(wb[st], sb2[st], xs + st * NT * 8 * XROW);
            };
            for (int ks = k_lo; ks < k_hi; ks += 2) {
                kstep(ks, 0);
                if (ks + 1 < k_hi) kstep(ks + 1, 1);
            }
        } else {
            U4 wv[MT][2][2], wn[MT][2][2];
            u32 sv[MT][2], sn[MT][2];
            if (k_lo < k_hi) load_w(k_lo, wn, sn);
#pragma unroll 2
            for (int ks = k_lo; ks < k_hi; ++ks) {
                const int st = (ks - k_lo) & 1;
                stage_next(ks, st);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        wv[mt][h][0] = wn[mt][h][0];
                        wv[mt][h][1] = wn[mt][h][1];
                        sv[mt][h] = sn[mt][h];
                    }
                if (ks + 1 < k_hi) load_w(ks + 1, wn, sn);  // in flight while this step is decoded
                compute(wv, sv, xs + st * NT * 8 * XROW);
            }
        }
""" + EPILOGUE + r"""    }
}
""")


def fill(src: str) -> str:
    """``src`` with the decoder PTX and the block size filled in (also :mod:`.fp4_moe_w4a8`'s, which shares the
    helpers, the slot prologue and the epilogue)."""
    ptx = _DECODE.strip()
    body = "\\n\"\n\"".join(line.strip() for line in ptx.splitlines())
    return src.replace("DECODE_PTX", '"' + body + '\\n"').replace("WARPS_", str(WARPS))


def _source() -> str:
    return (fill(nvrtc.PDL_DEVICE + _SRC).replace("XSTAGES", str(X_STAGES)).replace("XROW", str(X_ROW))
            .replace("XSEG", str(X_SEG)))


# ---- build (NVRTC, :mod:`.nvrtc`) ----------------------------------------------------------------------------

VARIANTS = [(nt, mt, split, ids64) for nt in (1, 2, 4) for mt in (1, 2, 4) for split in (False, True)
            for ids64 in (False, True)]  # template instances, built together


def _name(nt: int, mt: int, split: bool, ids64: bool) -> str:
    return f"fp4_moe_mma<{nt}, {mt}, {str(split).lower()}, {str(ids64).lower()}>"


PROGRAM = nvrtc.Program(_source(), "fp4_moe_mma.cu", [_name(*v) for v in VARIANTS])
_KERNELS: dict = {}


def _kernels(device: torch.device) -> dict:
    """{(nt, mt, split, ids64): kernel} on ``device``, built (or read from the cache) and loaded once per device."""
    key = str(device)
    if key not in _KERNELS:
        loaded = PROGRAM.kernels(device)
        _KERNELS[key] = {v: loaded[_name(*v)] for v in VARIANTS}
    return _KERNELS[key]


def available(device: torch.device) -> bool:
    """Whether the kernels are loaded on ``device`` (compute capability 8.0+, NVRTC present). They are built at the
    first ask outside CUDA-graph capture (under capture: not available until then, the Triton kernel serves); the
    first failure is kept in ``PROGRAM.error`` and the Triton kernel serves from then on."""
    return PROGRAM.available(device)


def shape_ok(x: torch.Tensor, w_scale: torch.Tensor | None, rows: int) -> bool:
    """bfloat16 x on a CUDA device, fp4 weights with E8M0 scales [E, N, K/32]: N a multiple of 256 (the largest
    block: 64 x 4 rows), K of 256, 1..MAX_ROWS rows, at most MAX_EXPERTS experts (also :mod:`.fp4_moe_f16`'s)."""
    if w_scale is None or w_scale.dim() != 3 or not (w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype)):
        return False
    return (x.is_cuda and x.dtype == torch.bfloat16 and 0 < rows <= MAX_ROWS and x.shape[-1] % K_STEP == 0
            and w_scale.shape[0] <= MAX_EXPERTS and w_scale.shape[1] % (WARPS * ROWS_PER_WARP_TILE * 4) == 0)


def eligible(x: torch.Tensor, w_scale: torch.Tensor | None, rows: int) -> bool:
    """:func:`shape_ok` and every scale byte <= 128 (one multiply decodes a pair: :func:`.gemm_decode.small_scales`)."""
    return shape_ok(x, w_scale, rows) and gd.small_scales(w_scale)


def _cfg(m: int, n: int, n_slots: int, device: torch.device) -> dict:
    """Tunables: mt (16-row tiles per warp: 1, 2, 4), nt (8-token tiles per pass: 1, 2, 4), ctas (blocks per SM
    the K split aims at). Defaults: nt = 1 up to 3 rows per expert slot (m / slots), 2 up to 8 (DeepSeek's
    routing puts up to ~2x the mean on one expert; an expert past 8 x nt rows costs another pass over its
    weights), else 4; mt = 2, or 1 while the mt = 2 grid would start fewer than ctas blocks per SM before K splits
    (one token: more, shorter warps). Measured against nt = 2, mt = 1 and mt = 4 forced, on a lent H200
    (scripts/bench_results/fp4_moe_mma_h200_session14.txt): the defaults are the fastest or within 4 % of it in
    every case there but w2 at 8 tokens (mt = 1: 0.0626 against 0.0651 ms).
    ATB_CUDA_FP4_MMA_CFG="mt=2,nt=1,ctas=4" overrides (benchmarks)."""
    per = m / n_slots
    cfg = dict(mt=2, nt=1 if per <= 3 else 2 if per <= 8 else 4, ctas=4)
    if (n // (WARPS * ROWS_PER_WARP_TILE * 2)) * n_slots < cfg["ctas"] * sm_count(device):
        cfg["mt"] = 1
    cfg.update(_overrides())
    return cfg


_ALLOWED = {"mt": (1, 2, 4), "nt": (1, 2, 4)}  # the built template instances (VARIANTS)


def _overrides() -> dict:
    """``ATB_CUDA_FP4_MMA_CFG="mt=2,nt=1,ctas=4"`` as a dict; a malformed entry, an unknown key or a tile that was
    not built is a ValueError naming the variable and what it takes."""
    out = {}
    for kv in filter(None, (t.strip() for t in os.environ.get("ATB_CUDA_FP4_MMA_CFG", "").split(","))):
        key, _, val = kv.partition("=")
        key = key.strip()
        ok = val.strip().isdigit() and key in ("mt", "nt", "ctas")
        if ok:
            v = int(val)
            ok = v in _ALLOWED[key] if key in _ALLOWED else v > 0
        if not ok:
            raise ValueError(f"ATB_CUDA_FP4_MMA_CFG: {kv!r} is not one of mt=1|2|4, nt=1|2|4, ctas=<positive integer>")
        out[key] = v
    return out


class LaunchPlan(NamedTuple):
    """How a call is cut: tile (nt, mt), passes, grid (row blocks, expert slots + 1, K splits), K steps per split,
    the arrival counters (None: no split) and the expert ids as the kernel reads them (int32 or int64)."""
    nt: int
    mt: int
    n_slots: int
    max_pass: int
    split: int
    sps: int
    grid: tuple
    ctr: torch.Tensor | None
    ids: torch.Tensor
    ids64: bool


def launch_plan(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, max_mt: int = 4) -> LaunchPlan:
    """The launch of x [M, K] over experts w [E, N, ...] (:func:`_cfg`, mt at most ``max_mt``: the built tiles):
    K split while the blocks would not fill ``ctas`` per SM (at least 2 steps a split; only where the counters
    cover every tile)."""
    m, k = x.shape
    n_exp, n = w.shape[0], w.shape[1]
    n_slots = max(1, min(n_exp, m))
    cfg = _cfg(m, n, n_slots, x.device)
    mt, nt = min(cfg["mt"], max_mt), cfg["nt"]
    max_pass = -(-m // (8 * nt))
    n_bx = n // (WARPS * ROWS_PER_WARP_TILE * mt)
    steps = k // K_STEP
    ctr = tc._counters(x.device) if n_bx * (n_slots + 1) * max_pass <= tc.CTR_SIZE else None
    want = -(-cfg["ctas"] * sm_count(x.device) // (n_bx * n_slots))
    split = max(1, min(want, steps // 2)) if ctr is not None else 1
    sps = -(-steps // split)
    split = -(-steps // sps)
    ids = expert_ids.contiguous()
    ids64 = ids.dtype == torch.int64
    if not ids64 and ids.dtype != torch.int32:
        ids, ids64 = ids.to(torch.int32), False
    return LaunchPlan(nt, mt, n_slots, max_pass, split, sps, (n_bx, n_slots + 1, split), ctr, ids, ids64)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T for bfloat16 x [M, K] over fp4 experts w [E, N, K/2] with E8M0 scales
    [E, N, K/32] (callers check :func:`eligible`); bfloat16 [M, N]; rows with an id outside [0, E) are zeros."""
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    p = launch_plan(x, w, expert_ids)
    # activations in the MMA's K order (within each 8 columns 0 4 1 5 2 6 3 7): permuted by the nt = 1 kernels as they
    # stage them, else by a copy here
    xp = x.contiguous() if p.nt == 1 else x.contiguous().view(m, k // 8, 2, 4).transpose(2, 3).contiguous()
    part = torch.empty(p.split, m, n, dtype=torch.float32, device=x.device) if p.split > 1 else out
    kern = _kernels(x.device)[(p.nt, p.mt, p.split > 1, p.ids64)]
    nvrtc.launch(kern, p.grid, (WARPS * 32, 1, 1),
                 [xp, w.view(torch.uint8), w_scale.view(torch.uint8), p.ids, out, part,
                  p.ctr if p.ctr is not None else out, m, n, k, w.shape[0], p.n_slots, p.sps, p.split, p.max_pass],
                 early=False)  # (the next kernel launched early: the decode step 0.5-1 % slower at batch 32-64)
    return out
