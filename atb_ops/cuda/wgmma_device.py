"""CUDA C device code of the wgmma attention kernels (:mod:`.attention_wgmma`, :mod:`.attention_seesaw`): the PTX
wrappers (wgmma, mbarrier, cp.async, named barriers, shared-memory descriptors), the online-softmax steps on one
thread's scores, and the output stage both schedules end with. Source text only: each kernel module puts the pieces
it uses in front of its kernel and builds the whole with NVRTC (:mod:`.nvrtc`).

Encodings (shared-memory descriptors, 128-byte swizzle, accumulator and register-A fragment layouts), mbarriers,
``cp.async.mbarrier.arrive`` and ``setmaxnreg``: the PTX ISA (docs.nvidia.com/cuda/parallel-thread-execution,
"Asynchronous Warpgroup Level Matrix" 9.7.15, "mbarrier"). Fragment layout used by the helpers: a consumer thread
holds rows row_a and row_a + 8 of the 64-row tile, key / column pairs 8 j + 2 cq + {0, 1} (cq = its lane % 4).
"""

from __future__ import annotations


def acc_list(first: int, count: int) -> str:
    return ", ".join(f"%{first + i}" for i in range(count))


def wgmma_ss(bn: int) -> str:
    """m64n{bn}k16, A and B from shared memory (K-major both), float32 accumulators d[bn / 2]."""
    n = bn // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return f"""
__device__ __forceinline__ void wgmma_qk(float (&d)[{n}], u64 da, u64 db, int accumulate) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 2}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16 {{{acc_list(0, n)}}}, %{n}, %{n + 1}, p, 1, 1, 0, 0;\\n}}\\n"
                 : {outs}
                 : "l"(da), "l"(db), "r"(accumulate));
}}
"""


def wgmma_rs() -> str:
    """m64n256k16, A (P) from registers, B (V) from shared memory MN-major (transposed), 128 accumulators."""
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(128))
    return f"""
__device__ __forceinline__ void wgmma_pv(float (&d)[128], u32 a0, u32 a1, u32 a2, u32 a3, u64 db) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %133, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{{acc_list(0, 128)}}}, "
                 "{{%128, %129, %130, %131}}, %132, p, 1, 1, 1;\\n}}\\n"
                 : {outs}
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}}
"""


HEAD = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
#define NT 384
#define D 512
#define HB 64
#define NEG_BIG (-1.0e30f)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// the compiler must not move register reads / writes of an accumulator across the asynchronous MMA's fences
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void reg_fence_u(u32& x) { asm volatile("" : "+r"(x) :: "memory"); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// shared-memory matrix descriptor: 128-byte swizzle (bits 62-63 = 1), addresses and offsets in 16-byte units
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {  // when this thread's earlier cp.async complete
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory"); }
// online softmax steps on one thread's scores s[BN / 2]: rows row_a (s[4j], s[4j+1]) and row_a + 8 (s[4j+2],
// s[4j+3]), keys 8j + 2cq + {0, 1}. Scale by scale2, absent keys (valid byte 0 in vb) to -inf, the rows' maxima over
// the quad:
template <int BN>
__device__ __forceinline__ void scale_mask_max(float (&s)[BN / 2], const unsigned char* vb, int cq, float scale2,
                                               float& mx_a, float& mx_b) {
    mx_a = NEG_BIG; mx_b = NEG_BIG;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const u32 vv = *(const u16*)(vb + 8 * j + 2 * cq);  // keys 8j + 2cq, + 1
        const float b0 = (vv & 0xFFu) ? 0.f : NEG_INF, b1 = (vv >> 8) ? 0.f : NEG_INF;
        s[4 * j] = fmaf(s[4 * j], scale2, b0);
        s[4 * j + 1] = fmaf(s[4 * j + 1], scale2, b1);
        s[4 * j + 2] = fmaf(s[4 * j + 2], scale2, b0);
        s[4 * j + 3] = fmaf(s[4 * j + 3], scale2, b1);
        mx_a = fmaxf(mx_a, fmaxf(s[4 * j], s[4 * j + 1]));
        mx_b = fmaxf(mx_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
}
// then s = 2^(s - row max) and this thread's row sums (not yet over the quad)
template <int BN>
__device__ __forceinline__ void exp_sum(float (&s)[BN / 2], float mn_a, float mn_b, float& sum_a, float& sum_b) {
    sum_a = 0.f; sum_b = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        s[4 * j] = ex2(s[4 * j] - mn_a);
        s[4 * j + 1] = ex2(s[4 * j + 1] - mn_a);
        s[4 * j + 2] = ex2(s[4 * j + 2] - mn_b);
        s[4 * j + 3] = ex2(s[4 * j + 3] - mn_b);
        sum_a += s[4 * j] + s[4 * j + 1];
        sum_b += s[4 * j + 2] + s[4 * j + 3];
    }
}
// the prologue of both kernels. A CTA's work (grid: token, then split, then 64-head block fastest): heads h0.. of
// token t, key chunks [c_lo, c_hi) of split sp; the main list's n1 chunks come first, nc in all
struct Work {
    int sp, h0, n1, c_lo, c_hi;
    long long t;
};
template <int BN>
__device__ __forceinline__ Work cta_work(int H, int K1, int K2, int chunks_per_split, int n_split) {
    const int n_hb = H / HB;
    const int pid = blockIdx.x;
    const int hb = pid % n_hb;
    Work w;
    w.sp = (pid / n_hb) % n_split;
    w.t = pid / n_hb / n_split;
    w.h0 = hb * HB;
    w.n1 = (K1 + BN - 1) / BN;
    const int nc = w.n1 + (K2 + BN - 1) / BN;
    w.c_lo = w.sp * chunks_per_split;
    w.c_hi = min(w.c_lo + chunks_per_split, nc);
    return w;
}
// the producer warp pw's rows pw + 4 i of the 64 x 512 query tile into the swizzled layout (offe / offo: the 16-byte
// granule offsets of its even / odd rows)
__device__ __forceinline__ void copy_query(const u16* q, long long t, int H, int h0, u32 q_base, int pw, int lane,
                                           u32 offe, u32 offo) {
#pragma unroll 4
    for (int i = 0; i < HB / 4; ++i) {
        const u16* src = q + ((t * H + h0 + pw + 4 * i) * D);
        const u32 o = q_base + (i >> 1) * 1024 + ((i & 1) ? offo : offe) + (lane >> 3) * HB * 128;
        cp_async16(o, src + lane * 8, true);
        cp_async16(o + 4 * HB * 128, src + (lane + 32) * 8, true);
    }
}
// this lane's row index in chunk c (lanes < BN / 4: row pw + 4 lane; -1: absent or past the list; pools < 2^31 rows)
template <int BN, bool IDX64>
__device__ __forceinline__ int row_index(int c, const Work& w, int K1, int K2, const void* idx, const void* idx2,
                                         int pw, int lane) {
    if (c >= w.c_hi || lane >= BN / 4) return -1;
    const bool main = c < w.n1;
    const int lim = main ? K1 : K2;
    const int n = (main ? c : c - w.n1) * BN + pw + 4 * lane;
    if (n >= lim) return -1;
    const long long base = w.t * (long long)lim;
    const void* ip = main ? idx : idx2;
    return IDX64 ? (int)((const long long*)ip)[base + n] : ((const int*)ip)[base + n];
}
// both schedules' epilogue: this warpgroup's 64 x 256 half of O (row_a times r_a, row_a + 8 times r_b) through smem
// rows 528 bytes apart (bank-conflict free), then 16-byte stores, a warp one 512-byte row half at a time (session 26:
// the fragments' direct 4-byte stores cost ~6 us of a 41 us call)
__device__ __forceinline__ void store_half(unsigned char* s_o, const float (&o)[128], float r_a, float r_b, int row_a,
                                           int cq, int wg, int wt, u16* dst, long long row0) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int cb = (8 * j + 2 * cq) * 2;
        *(u32*)(s_o + row_a * 528 + cb) = pack_bf16(o[4 * j] * r_a, o[4 * j + 1] * r_a);
        *(u32*)(s_o + (row_a + 8) * 528 + cb) = pack_bf16(o[4 * j + 2] * r_b, o[4 * j + 3] * r_b);
    }
    bar_sync(4 + wg, 128);
#pragma unroll 4
    for (int k = wt; k < HB * 32; k += 128) {
        const int r = k >> 5, gr = k & 31;
        *(uint4*)(dst + (row0 + r) * D + wg * 256 + gr * 8) = *(const uint4*)(s_o + r * 528 + gr * 16);
    }
}
"""

WGMMA_SS_PV = r"""
// m64n256k16, A (P) from shared memory K-major, B (V) from shared memory MN-major (transposed)
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], u64 da, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {""" + acc_list(0, 128) + r"""}, "
                 "%128, %129, p, 1, 1, 0, 1;\n}\n"
                 : """ + ", ".join(f'"+f"(d[{i}])' for i in range(128)) + r"""
                 : "l"(da), "l"(db), "r"(1));
}
"""

RESCALE_PV = r"""
// o = o * (f_a on row_a, f_b on row_a + 8) + P V[:, this warpgroup's 256 columns]: P this thread's scores s (bf16,
// registers), V the block half at shared address v (64 keys x 256 columns, MN-major)
template <int BN>
__device__ __forceinline__ void rescale_pv(float (&o)[128], const float (&s)[BN / 2], float f_a, float f_b, u32 v) {
    if (__any_sync(0xffffffffu, f_a != 1.f || f_b != 1.f)) {
#pragma unroll
        for (int k = 0; k < 128; ++k) o[k] *= (k & 2) ? f_b : f_a;
    }
    u32 pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]); pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]); pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
#pragma unroll
        for (int r = 0; r < 4; ++r) reg_fence_u(pa[kk][r]);
    }
#pragma unroll
    for (int k = 0; k < 128; ++k) reg_fence(o[k]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_pv(o, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], desc(v + kk * 16 * 128, BN * 128, 1024));
    wg_commit();
    wg_wait0();
}
"""
