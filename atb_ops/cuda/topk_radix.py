"""indexer_topk's selection as one CUDA C block per token (NVRTC, :mod:`.nvrtc`): an exact radix select of the
threshold bin (and, when too many keys sit at or above it, of the threshold key), then a bitonic sort of the keys taken.

Same contract as the selections of :mod:`.indexer_select`. Inputs: ``keys`` [T, N] int32 order keys (larger key =
larger score; ``ORD_NEG_INF`` = absent candidate / -inf score), optionally ``hist`` [T, >= 2^HB] int32, the count
of finite keys per top-HB-bit bin (the score kernel's histogram; without it the block counts them itself), and
``cand`` [T, N] int64. Output [T, KW] int64: the cand rows of the KW largest finite keys of each row, descending,
equal keys in candidate order (the reference's stable descending sort), -1 past the finite keys.

Why: the Triton selections after the score kernel cost 16-17 us at T = 32, N = 16384 on an H200 (compaction ~5, the
``tl.sort`` of |S| ~ 600-900 composites ~11; scripts/bench_results/h200_session19.txt), a quarter of the op.

One block of 1024 threads per token; thread i holds the keys of candidates [KPT i, KPT i + KPT) in registers (KPT =
N / 1024 rounded up to a power of two, at most 16: N <= 16384), as unsigned images u = key + 2^31 (same order):

1. the threshold bin b* of the top HB bits: the largest bin whose keys and those of the bins above number >= KW
   (the histogram's suffix sums, one block scan; the block's own histogram by shared-memory atomics when none is
   given). Fewer than KW finite keys: every finite key is taken;
2. the keys taken, S: every finite key in bins >= b* when they number at most 2048 (the usual case: |S| ~ 600-900
   at N = 16384, top-512); else exactly KW keys, found by further digits of at most 12 bits counting only the keys
   that match the prefix fixed so far, until the matching keys are exactly the ones still needed or the prefix is
   the whole key, then every key above the prefix and the first ``need`` matching it in candidate order (a block
   scan; thread-major order is candidate order). Slots by block scans of per-thread counts (no atomics). Stored as
   64-bit composites (u << 32) | (2^32 - 1 - n), all distinct, whose descending order is the reference's;
3. bitonic sort of P = next power of two >= max(|S|, 128) composites, descending, by P / 128 warps of 4 per thread:
   partners 1, 2 apart in registers, 4 .. 64 apart by warp shuffles, farther through shared memory (two buffers in
   turn, a named barrier of the sorting warps); zeros pad (no finite key has u = 0);
4. out[t, j] = cand[t, n_j] for the first min(KW, |S|) keys, else -1.

No host synchronisation, static shapes, no scratch memory: CUDA-graph safe. Every key distribution is exact (many
equal keys only add digits); there is no capacity fallback. Larger N (or KW > 2048) take the Triton paths.

Measured on a lent H200 (scripts/bench_results/h200_session22.txt; clock64 stamps of one block per phase): the
selection alone takes 15.5-16.5 us at T = 32, N = 16384 against the split path's 17.4, and the whole op 57.7 us
against 58.3 (39.1 against 40.4 at N = 8192; at N = 2048 the bits path stays faster), so it is opt-in
(``ATB_CUDA_INDEXER=radix``). Its sort is the limit: 1024 64-bit composites take ~17,000 cycles, issue-bound (~100
instructions per compare step and warp; the first form, one element per thread on all 32 warps, took 19,600 cycles
for 512). Loading the keys takes ~2,000, the block's own histogram ~6,500 (one atomic per warp and distinct bin by
``__match_any_sync``: ~31,000), the compaction ~3,300; sorting exactly KW = 512 after the extra digits (5,300
cycles) took as long in all.
"""

from __future__ import annotations

import torch

from . import nvrtc
from ._util import pow2

THREADS = 1024
MAX_KPT = 16  # keys per thread held in registers: N <= 16384
MAX_P = 2048  # sort size: KW <= 2048

_SRC = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define NT 1024
#define NWARP 32
#define MAXP 2048
#define ORD_NEG_INF_U 0x007FFFFFu  /* the unsigned image of ORD_NEG_INF: -2139095041 + 2^31 */

__device__ __forceinline__ int warp_incl(int v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// exclusive prefix over threads (tid order) of v, and the block total; two barriers (s_w reusable after)
__device__ __forceinline__ int block_excl(int v, int* s_w, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int incl = warp_incl(v, lane);
    if (lane == 31) s_w[warp] = incl;
    __syncthreads();
    const int wv = s_w[lane];
    const int wincl = warp_incl(wv, lane);
    const int before = __shfl_sync(0xffffffffu, wincl - wv, warp);
    total = __shfl_sync(0xffffffffu, wincl, 31);
    __syncthreads();
    return before + incl - v;
}

// largest digit d of the histogram h[0, nb) with (keys in digits >= d) >= need: s_r = {d, keys in digits > d,
// keys in d, keys in all digits}; d = -1 when all digits together hold fewer than need keys
__device__ __forceinline__ void find_digit(const int* h, int nb, int need, int* s_w, int* s_r) {
    const int tid = threadIdx.x;
    const int bpt = nb > NT ? nb / NT : 1;
    const int active = nb / bpt;
    int s = 0;
    if (tid < active)
        for (int i = 0; i < bpt; ++i) s += h[tid * bpt + i];
    if (tid == 0) s_r[0] = -1;
    int total;
    const int before = block_excl(s, s_w, total);
    if (tid == 0) s_r[3] = total;
    if (tid < active) {
        int run = total - before - s;  // keys in the digits above this thread's
        for (int i = bpt - 1; i >= 0; --i) {
            const int b = tid * bpt + i, c = h[b];
            if (run < need && run + c >= need) {
                s_r[0] = b;
                s_r[1] = run;
                s_r[2] = c;
            }
            run += c;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ u64 shfl_xor64(u64 v, int m) {
    u32 lo = __shfl_xor_sync(0xffffffffu, (u32)v, m), hi = __shfl_xor_sync(0xffffffffu, (u32)(v >> 32), m);
    return ((u64)hi << 32) | lo;
}

__device__ __forceinline__ void bar_named(int threads) { asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory"); }

template <int KPT, bool VEC, bool HIST>
__global__ void __launch_bounds__(NT) topk_radix(const int* __restrict__ keys, const int* __restrict__ hist, int hs,
                                                  const long long* __restrict__ cand, long long* __restrict__ out,
                                                  int N, int KW, int HB) {
    __shared__ int s_h[4096];  // histograms; the sort's second buffer
    __shared__ u64 s_v[MAXP];  // the keys taken, as composites
    __shared__ int s_w[NWARP];
    __shared__ int s_r[4];
    const int tid = threadIdx.x, lane = tid & 31;
    const long long t = blockIdx.x;
    const int* krow = keys + t * N;

    u32 u[KPT];
    if (VEC) {
#pragma unroll
        for (int j = 0; j < KPT; j += 4) {
            const int n = tid * KPT + j;
            int4 q = n < N ? *reinterpret_cast<const int4*>(krow + n) : make_int4(0, 0, 0, 0);
            u[j] = (u32)q.x ^ 0x80000000u; u[j + 1] = (u32)q.y ^ 0x80000000u;
            u[j + 2] = (u32)q.z ^ 0x80000000u; u[j + 3] = (u32)q.w ^ 0x80000000u;
            if (n >= N) u[j] = u[j + 1] = u[j + 2] = u[j + 3] = ORD_NEG_INF_U;
        }
    } else {
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
            const int n = tid * KPT + j;
            u[j] = n < N ? (u32)krow[n] ^ 0x80000000u : ORD_NEG_INF_U;
        }
    }

    // 1. the top HB bits: the threshold bin b*, the keys above it (gt) and in it (match)
    const int nb1 = 1 << HB;
    if (HIST) {
        for (int b = tid; b < nb1; b += NT) s_h[b] = hist[t * hs + b];
    } else {
        for (int b = tid; b < nb1; b += NT) s_h[b] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < KPT; ++j)  // (one atomic per warp and distinct bin by __match_any_sync: 6x slower)
            if (u[j] != ORD_NEG_INF_U) atomicAdd(&s_h[u[j] >> (32 - HB)], 1);
    }
    __syncthreads();
    find_digit(s_h, nb1, KW, s_w, s_r);
    const bool all = s_r[0] < 0;  // fewer than KW finite keys: all of them
    u32 prefix = all ? 0u : (u32)s_r[0];
    int bits = HB, need = KW - s_r[1], match = s_r[2];
    // S = the keys in bins >= b*: sorted whole when it fits the sort buffer (the usual case; ties need no care,
    // the composites order them). Else further digits of at most 12 bits, counting only the keys matching the
    // prefix so far, until the matching keys are the ones still needed or the prefix is the whole key
    const bool whole = all || s_r[1] + match <= MAXP;
    int count = all ? s_r[3] : whole ? s_r[1] + match : KW;
    while (!whole && bits < 32 && match > need) {
        const int d = 32 - bits < 12 ? 32 - bits : 12;
        const int nb = 1 << d;
        __syncthreads();  // everyone has read s_r and is done with s_h
        for (int b = tid; b < nb; b += NT) s_h[b] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < KPT; ++j)
            if (u[j] != ORD_NEG_INF_U && (u[j] >> (32 - bits)) == prefix)
                atomicAdd(&s_h[(u[j] >> (32 - bits - d)) & (nb - 1)], 1);
        __syncthreads();
        find_digit(s_h, nb, need, s_w, s_r);
        prefix = (prefix << d) | (u32)s_r[0];
        bits += d;
        need -= s_r[1];
        match = s_r[2];
    }
    // 2. the keys taken: whole: every finite key of S; else the keys above the prefix and the first `need`
    //    matching it in candidate order (thread-major = candidate order). Slots by block scans: no atomics
    int eq = 0;
    if (!whole) {
#pragma unroll
        for (int j = 0; j < KPT; ++j) eq += (u[j] != ORD_NEG_INF_U && (u[j] >> (32 - bits)) == prefix);
    }
    int total;
    int rank = whole ? 0 : block_excl(eq, s_w, total);  // matching keys before this thread's
    u32 takes = 0u;
    int c = 0;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        bool take = false;
        if (u[j] != ORD_NEG_INF_U) {
            const u32 top = u[j] >> (32 - bits);
            take = all || (whole ? top >= prefix : top > prefix || (top == prefix && rank++ < need));
        }
        takes |= (u32)take << j;
        c += take;
    }
    int slot = block_excl(c, s_w, total);
#pragma unroll
    for (int j = 0; j < KPT; ++j)
        if (takes >> j & 1u) s_v[slot++] = ((u64)u[j] << 32) | (u64)(0xFFFFFFFFu - (u32)(tid * KPT + j));
    __syncthreads();

    // 3. bitonic sort of P = next power of two >= max(count, 128) composites, descending, by P / 128 warps: element
    //    e = 4 tid + r in register r of thread tid; partners 1, 2 apart in the thread, 4 .. 64 apart by warp
    //    shuffles, farther through shared memory (two buffers in turn, one barrier of the sorting warps each)
    int P = 128;
    while (P < count) P <<= 1;
    const int sorters = P / 4;
    for (int i = P + tid; i < KW; i += NT) out[t * KW + i] = -1;  // rows with fewer than KW keys: -1 past P
    if (tid >= sorters) return;
    u64 v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = 4 * tid + r < count ? s_v[4 * tid + r] : 0ull;  // zeros: below any key
    bool flip = false;
    for (int k = 2; k <= P; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            u64 pv[4];
            if (j >= 128) {
                u64* buf = flip ? s_v : reinterpret_cast<u64*>(s_h);
                flip = !flip;
#pragma unroll
                for (int r = 0; r < 4; ++r) buf[4 * tid + r] = v[r];
                bar_named(sorters);
#pragma unroll
                for (int r = 0; r < 4; ++r) pv[r] = buf[(4 * tid + r) ^ j];
            } else if (j >= 4) {
#pragma unroll
                for (int r = 0; r < 4; ++r) pv[r] = shfl_xor64(v[r], j >> 2);
            } else if (j == 2) {
                pv[0] = v[2]; pv[1] = v[3]; pv[2] = v[0]; pv[3] = v[1];
            } else {
                pv[0] = v[1]; pv[1] = v[0]; pv[2] = v[3]; pv[3] = v[2];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int e = 4 * tid + r;
                const bool keep_max = ((e & k) == 0) == ((e & j) == 0);
                const u64 a = v[r], b = pv[r];
                v[r] = keep_max ? (a > b ? a : b) : (a < b ? a : b);
            }
        }
    }
    // 4. the cand rows of the first KW, -1 past the keys taken
    const int taken = count < KW ? count : KW;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int i = 4 * tid + r;
        if (i < KW) out[t * KW + i] = i < taken ? cand[t * N + (long long)(0xFFFFFFFFu - (u32)v[r])] : -1ll;
    }
}
"""

KPTS = (1, 2, 4, 8, 16)
VARIANTS = [(kpt, vec, h) for kpt in KPTS for vec in (False, True) for h in (False, True) if not (vec and kpt < 4)]


def _name(kpt: int, vec: bool, hist: bool) -> str:
    return f"topk_radix<{kpt}, {str(vec).lower()}, {str(hist).lower()}>"


PROGRAM = nvrtc.Program(_SRC, "topk_radix.cu", [_name(*v) for v in VARIANTS])


def eligible(cand: torch.Tensor, k: int) -> bool:
    """Rows cand [T, N] on a CUDA device with N <= 16384, 0 < k <= 2048, the kernels built
    (:meth:`.nvrtc.Program.available`)."""
    return cand.is_cuda and cand.shape[1] <= THREADS * MAX_KPT and 0 < k <= MAX_P and PROGRAM.available(cand.device)


def select(keys: torch.Tensor, cand: torch.Tensor, k: int, hist: torch.Tensor | None = None,
           hb: int = 12) -> torch.Tensor:
    """[T, k] int64 cand rows of the k largest keys of each row of ``keys`` [T, N] int32 (contiguous; ties in
    candidate order, -1 past the finite keys). ``hist`` [T, >= 2^hb] int32: the finite keys per top-hb-bit bin
    (1 <= hb <= 12), as the score kernel counts them; None: counted here (hb = 12)."""
    t_count, n = keys.shape
    out = torch.empty(t_count, k, dtype=torch.int64, device=keys.device)
    if t_count == 0 or k == 0:
        return out
    if hist is None:
        hb = 12
    if not 1 <= hb <= 12:
        raise ValueError(f"topk_radix: histogram bits {hb} (ATB_CUDA_INDEXER_HB) outside 1..12")
    kpt = pow2(-(-n // THREADS))  # keys per thread: 1, 2, 4, 8 or 16
    keys = keys.contiguous()
    vec = kpt >= 4 and n % 4 == 0 and keys.data_ptr() % 16 == 0
    kern = PROGRAM.kernels(keys.device)[_name(kpt, vec, hist is not None)]
    kern(grid=(t_count, 1, 1), block=(THREADS, 1, 1),
         args=[keys, hist if hist is not None else keys, hist.stride(0) if hist is not None else 0,
               cand.contiguous(), out, n, k, hb])
    return out
