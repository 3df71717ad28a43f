"""indexer_topk's selection as one CUDA C block per token (NVRTC, :mod:`.nvrtc`): an exact radix select of the
threshold bin (and, when too many keys sit at or above it, of the threshold key), then a merge sort of the keys taken.

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
3. merge sort of P = next power of two >= max(|S|, 32) composites, descending, on all 32 warps (1 or 2 a thread):
   runs of 32 sorted in each warp by shuffles (bitonic), then log2(P / 32) merge rounds through two shared-memory
   buffers, one barrier a round: the element at index i of its run moves to i + (elements of the partner run above
   it, a binary search) from the run pair's start. Pads P - p (distinct, below every key's composite) keep every
   value distinct, so those positions form a permutation (the rank rule of a merge: Satish, Harris and Garland,
   "Designing efficient sorting algorithms for manycore GPUs", IPDPS 2009, its merge sort);
4. out[t, j] = cand[t, n_j] for the first min(KW, |S|) keys, else -1.

No host synchronisation, static shapes, no scratch memory: CUDA-graph safe. Every key distribution is exact (many
equal keys only add digits); there is no capacity fallback. Larger N (or KW > 2048) take the Triton paths.

Measured on lent H200s: session 22's form (a bitonic sort on P / 4 threads, 4 elements each) selected in 15.5-16.5 us
at T = 32, N = 16384, its sort ~17,000 cycles (clock64 stamps; h200_session22.txt). Session 27
(h200_session27.txt; Nsight Compute kernel times at T = 32, N = 16384): the block 19.0 us with that sort, 8.6-8.8 us
with no sort at all (a timing probe), 18.0 us with a stable 4-bit LSD radix sort on all warps (8 passes), 14.1-15.8 us
with this merge sort as first written (~950 instructions a thread; a pad word every 16 entries removed 36 % of the
searches' bank conflicts and no time). The kept form unrolls each search for its run length (6 instead of 12
instructions a step) and compares once per bitonic step: the op 16.6 -> 15.2 us at N = 2048, 33.1 -> 32.7 at 8192,
52.4 -> 50.7 (64.7 % of the copy bandwidth) at 16384 against the first form in the same run; the previous default
(bits, bits, split) took 18.7-18.9 / 44.5-44.6 / 58.6-62.3 us there in this session's calls. Counting the block's
own histogram from a sample first (every KPT-th key, then only the bins at or above the sample's) was exact and no
faster: not kept. The default (``ATB_CUDA_INDEXER=auto``) since, at every N <= 16384 and token count timed (1 to
2048).
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

// elements of the descending run q[0, L) above x: a binary search unrolled for this L, its offset kept in bytes so
// that each step is one load at a constant displacement, a 64-bit compare and three adds / selects (12 instructions
// a step as a loop)
template <int L>
__device__ __forceinline__ int count_above(const u64* q, u64 x) {
    const char* b = reinterpret_cast<const char*>(q);
    int cb = 0;
#pragma unroll
    for (int s = L >> 1; s > 0; s >>= 1)
        if (*reinterpret_cast<const u64*>(b + cb + (s - 1) * 8) > x) cb += s * 8;
    return (cb >> 3) + (*reinterpret_cast<const u64*>(b + cb) > x ? 1 : 0);
}

__device__ __forceinline__ int count_above_run(const u64* q, int L, u64 x) {
    switch (L) {
        case 32: return count_above<32>(q, x);
        case 64: return count_above<64>(q, x);
        case 128: return count_above<128>(q, x);
        case 256: return count_above<256>(q, x);
        case 512: return count_above<512>(q, x);
        default: return count_above<1024>(q, x);  // L < P <= MAXP = 2048
    }
}

template <int KPT, bool VEC, bool HIST>
__global__ void __launch_bounds__(NT) topk_radix(const int* __restrict__ keys, const int* __restrict__ hist, int hs,
                                                  const long long* __restrict__ cand, long long* __restrict__ out,
                                                  int N, int KW, int HB, int pdl_early) {
    __shared__ __align__(16) int s_h[4096];  // histograms; the sort's second buffer (2048 composites)
    __shared__ u64 s_v[MAXP];  // the keys taken, as composites
    __shared__ int s_w[NWARP];
    __shared__ int s_r[4];
    const int tid = threadIdx.x, lane = tid & 31;
    const long long t = blockIdx.x;
    const int* krow = keys + t * N;
    pdl_wait(pdl_early);  // the keys and histograms: the score kernel's outputs

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

    // 3. merge sort of P = next power of two >= max(count, 32) composites, descending, E = P / NT (1 or 2)
    //    elements a thread (positions tid, tid + NT): each warp sorts its runs of 32 by shuffles (bitonic), then
    //    log2(P / 32) merge rounds through shared memory, one barrier each: the element at index i of a run goes to
    //    i + the elements of the partner run above it (a binary search) from the pair's first position. The values
    //    are distinct (the pads too: P - p, below every composite of a key), so that sum is a permutation
    int P = 32;
    while (P < count) P <<= 1;
    const int E = P > NT ? P / NT : 1;
    u64* A = s_v;
    u64* B = reinterpret_cast<u64*>(s_h);
    u64 v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int p = tid + e * NT;
        v[e] = e < E && p < count ? s_v[p] : (u64)(P - p);  // pads < 2^32 <= any key's composite (u > 0)
        if (e < E && p < P) {  // whole warps (P is a multiple of 32): the shuffles see every lane
#pragma unroll
            for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
                for (int j = k >> 1; j > 0; j >>= 1) {
                    const u64 pv = shfl_xor64(v[e], j);
                    const bool keep_max = ((lane & k) == 0) == ((lane & j) == 0);
                    v[e] = (v[e] > pv) == keep_max ? v[e] : pv;  // values distinct: the larger or the smaller
                }
            A[p] = v[e];  // the position this thread read: no other thread reads it
        }
    }
    __syncthreads();
    for (int L = 32; L < P; L <<= 1) {
        const bool last = 2 * L == P;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int p = tid + e * NT;
            const int i = p & (L - 1);
            if (e < E && p < P && !(last && i >= KW)) {  // last round: an index >= KW lands at or past KW
                const bool right = (p & L) != 0;
                const int base = p & ~(2 * L - 1);
                const u64* q = A + (right ? base : base + L);  // the partner run, descending
                B[base + i + count_above_run(q, L, v[e])] = v[e];
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int p = tid + e * NT;
            if (e < E && p < P) v[e] = B[p];
        }
        u64* tmp = A; A = B; B = tmp;
    }
    // 4. the cand rows of the first KW (in A), -1 past the keys taken
    const int taken = count < KW ? count : KW;
    for (int i = tid; i < KW; i += NT)
        out[t * KW + i] = i < taken ? cand[t * N + (long long)(0xFFFFFFFFu - (u32)A[i])] : -1ll;
}
"""

KPTS = (1, 2, 4, 8, 16)
VARIANTS = [(kpt, vec, h) for kpt in KPTS for vec in (False, True) for h in (False, True) if not (vec and kpt < 4)]


def _name(kpt: int, vec: bool, hist: bool) -> str:
    return f"topk_radix<{kpt}, {str(vec).lower()}, {str(hist).lower()}>"


PROGRAM = nvrtc.Program(nvrtc.PDL_DEVICE + _SRC, "topk_radix.cu", [_name(*v) for v in VARIANTS])


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
    on = nvrtc.pdl_on()
    nvrtc.launch(kern, (t_count, 1, 1), (THREADS, 1, 1),
                 [keys, hist if hist is not None else keys, hist.stride(0) if hist is not None else 0,
                  cand.contiguous(), out, n, k, hb], shared_mem=one_block_per_sm(kern, keys.device) if on else 0,
                 pdl=on)
    return out


_PAD: dict = {}


def one_block_per_sm(kern, device: torch.device) -> int:
    """Bytes of dynamic shared memory (unused) that keep ``kern`` at one block an SM (over half an SM's shared
    memory with the static part), allowed once per kernel. Launched with programmatic dependent launch, this
    kernel's blocks become resident while the score kernel before it still runs, and the block scheduler then put
    two of them on one SM where it had room -- this issue-bound block then shares its SM: on an H200 at T = 32,
    N = 2048, 19.0 us a call against 15.0-15.6 launched plainly and 14.5 with one block an SM (N = 16384: 49.3 /
    51.1 / 49.6; scripts/bench_results/h200_session39.txt)."""
    key = (str(device), id(kern))
    if key not in _PAD:
        pad = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor // 2 + 1024
        kern.set_shared_memory_config(pad)
        _PAD[key] = pad
    return _PAD[key]
