"""Sparse attention decode over gathered rows with FlashMLA's "seesaw" schedule: :mod:`.attention_wgmma`'s contract,
arguments, split partials and merge, a second CUDA C kernel (NVRTC, sm_90a) chosen by :func:`preferred` or
``ATB_CUDA_ATTN_IMPL=seesaw``.

Why: attention_wgmma's two consumer warpgroups each own a column half of Q.K^T and of the output, so every 64-key chunk
swaps the score halves and both warpgroups run Q.K^T, softmax and P.V in step: the tensor cores idle during the
softmax (h200_session28.txt, calls 6 and 12: with no memory traffic at all the kernel still takes 29.3 of 38.1 us at
T = 128). Here each warpgroup computes the full Q.K^T of its own key block (blocks taken in pairs: b0 -> warpgroup 0,
b1 -> warpgroup 1), the output's column halves O_L / O_R stay in warpgroup 0 / 1, and the two warpgroups hand each
other their softmax statistics and P tiles, so one's softmax overlaps the other's MMAs (DeepSeek's FlashMLA write-up,
github.com/deepseek-ai/FlashMLA, docs/20250422-new-kernel-deep-dive.md). Per pair ([w] = warpgroup; m / l the
running row maximum / sum in log2 units, the same bits in both warpgroups):

  [0] mn0 = max(m, rowmax p0), sc0 = 2^(m - mn0), p0 = 2^(p0 - mn0), ls0 = rowsum p0; O_L = O_L sc0 + p0 V0[:, :256]
  [1] mn1 = max(mn0, rowmax p1), sc1 = 2^(mn0 - mn1), p1 = 2^(p1 - mn1), ls1 = rowsum p1;
      O_R = O_R sc0 sc1 + p1 V1[:, 256:]
  [0] O_L = O_L sc1 + p1 V1[:, :256]        [1] O_R += (p0 sc1) V0[:, 256:]
  l = l sc0 sc1 + ls0 sc1 + ls1, m = mn1

(P rounded to bf16 for P.V; p0 is rounded before the sc1 multiply for O_L and after it for O_R.)

Shared memory: the query tile (64 KB), four half-block slots of 64 rows x 256 columns (32 KB each, 4 column blocks in
wgmma's 128-byte-swizzled layout; a block = a left and a right slot), two 8 KB P tiles in the wgmma A-operand layout,
the statistics. A slot is refilled as soon as its last reader is done, and the next pair's blocks take the slots in
the order they free up: b0 = (slot 0, slot 1 | 3), b1 = (slot 2, slot 3 | 1) by pair parity. Named barriers 6-10 hand
over stats0, stats1 + P1, P0, and the P tiles' release. Splits take an even number of chunks (:func:`splits`).

Measured (H200, op us against attention_wgmma's kernel): first run, h200_session28.txt call 15, T = 128, h = 128
62.4 / 68.0 (compute-bound); side by side with the dispatch, h200_session29.txt calls 1, 5 and 6: h = 128 faster at
T = 8 and 128 and in prefill, equal at T = 32, h = 64 slower in decode and faster in prefill (figures and the default
rule: :func:`preferred`).
"""

from __future__ import annotations

from . import attention_wgmma as W
from . import nvrtc
from . import wgmma_device as WD

_KERNEL = r"""
#define BAR_S0 6
#define BAR_S1 7
#define BAR_P0 8
#define BAR_P1FREE 9
#define BAR_P0FREE 10
template <int BN, bool IDX64>
__global__ void __launch_bounds__(NT, 1)
attn_seesaw(const u16* __restrict__ q, const u16* __restrict__ kv, const void* __restrict__ idx,
            const u16* __restrict__ kv2, const void* __restrict__ idx2, const float* __restrict__ sink,
            u16* __restrict__ out, u16* __restrict__ part, float* __restrict__ ml,
            int T, int H, int K1, int K2, int stride_kv, int stride_kv2, double scale2_d,
            int chunks_per_split, int n_split, int has_sink, int pdl_early) {
    const float scale2 = (float)scale2_d;
    pdl_wait(pdl_early);  // q, the index lists and the pools: the previous kernels' outputs
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - ((u32)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
    unsigned char* s_q = smem;                                   // HB x D, 8 column blocks of [64][128 B]
    unsigned char* s_slot = smem + HB * D * 2;                   // 4 slots of 4 column blocks
    unsigned char* s_p = s_slot + 4 * (BN * 256 * 2);            // 2 P tiles [64][128 B] (swizzled)
    float4* s_st = (float4*)(s_p + 2 * (HB * BN * 2));           // stats [2][64]: (mn, sc, ls, -)
    unsigned char* s_valid = (unsigned char*)(s_st + 2 * HB);    // [2][BN]: block b0 / b1 of the pair
    const u32 bars = ((u32)__cvta_generic_to_shared(s_valid + 2 * BN) + 7u) & ~7u;
    #define FULL(s) (bars + 8u * (s))
    #define EMPTY(s) (bars + 8u * (4 + (s)))
    #define SLOT_BASE(s) (slot_base + (u32)(s) * (u32)(BN * 256 * 2))

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = tid >> 7, wt = tid & 127;
    const Work wk = cta_work<BN>(H, K1, K2, chunks_per_split, n_split);
    const int sp = wk.sp, h0 = wk.h0, n1 = wk.n1, c_lo = wk.c_lo, c_hi = wk.c_hi;
    const long long t = wk.t;
    const int pairs = c_hi > c_lo ? (c_hi - c_lo + 1) / 2 : 0;
    const u32 q_base = (u32)__cvta_generic_to_shared(s_q);
    const u32 slot_base = (u32)__cvta_generic_to_shared(s_slot);
    const u32 p_base = (u32)__cvta_generic_to_shared(s_p);

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            mbar_init(FULL(s), 256);   // 128 producer threads x 2 (their copies landed; the valid bytes written)
            mbar_init(EMPTY(s), 256);  // both consumer warpgroups (the one that does not read a slot arrives early)
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        const int pw = warp - 8;
        const u32 offe = (u32)((pw * 128) + (((lane & 7) ^ pw) << 4));
        const u32 offo = (u32)(((pw + 4) * 128) + (((lane & 7) ^ (pw + 4)) << 4));
        if (pairs > 0) copy_query(q, t, H, h0, q_base, pw, lane, offe, offo);
        auto row_of = [&](int c) { return row_index<BN, IDX64>(c, wk, K1, K2, idx, idx2, pw, lane); };
        int nxt0 = row_of(c_lo), nxt1 = row_of(c_lo + 1);
        for (int i = 0; i < pairs; ++i) {
            const int c0 = c_lo + 2 * i;
            const int cur0 = nxt0, cur1 = nxt1;
            nxt0 = row_of(c0 + 2);
            nxt1 = row_of(c0 + 3);
            const int r0 = (i & 1) ? 3 : 1, r1 = (i & 1) ? 1 : 3;
            // the slots in the order the previous pair frees them: b0's left, b0's right, b1's left, b1's right
#pragma unroll
            for (int qd = 0; qd < 4; ++qd) {
                const int blk = qd >> 1, half = qd & 1;
                const int slot = qd == 0 ? 0 : qd == 1 ? r0 : qd == 2 ? 2 : r1;
                const int cur = blk ? cur1 : cur0;
                const int c = c0 + blk;
                if (i > 0) mbar_wait(EMPTY(slot), (i - 1) & 1);
                if (half == 0 && lane < BN / 4) s_valid[blk * BN + pw + 4 * lane] = cur >= 0;
                const bool extra = c >= n1;
                const u16* pool = (extra ? kv2 : kv) + lane * 8 + half * 256;
                const long long stride = extra ? stride_kv2 : stride_kv;
                const u32 sb = SLOT_BASE(slot) + (lane >> 3) * BN * 128;
#pragma unroll
                for (int i2 = 0; i2 < BN / 4; ++i2) {
                    const int r = __shfl_sync(0xffffffffu, cur, i2);
                    const bool ok = r >= 0;
                    const u16* src = pool + (ok ? (long long)r * stride : 0);
                    cp_async16(sb + (i2 >> 1) * 1024 + ((i2 & 1) ? offo : offe), src, ok);
                }
                mbar_arrive_cp_async(FULL(slot));
                mbar_arrive(FULL(slot));
            }
        }
        cp_async_wait<0>();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const int g = lane >> 2, cq = lane & 3, wi = warp & 3;
    const int row_a = 16 * wi + g, row_b = row_a + 8;
    // m, l: whole-row values, the same bits in both warpgroups (each computes the same updates from the stats)
    float m_a = NEG_BIG, m_b = NEG_BIG, l_a = 0.f, l_b = 0.f;
    if (has_sink && n_split == 1) {
        m_a = sink[h0 + row_a] * 1.4426950408889634f;
        m_b = sink[h0 + row_b] * 1.4426950408889634f;
        l_a = l_b = 1.f;  // the sink's own term 2^(sink - m) at m = sink
    }
    const u32 other_p = p_base + (1 - wg) * (HB * BN * 2);  // the other warpgroup's P tile
    unsigned char* my_pt = s_p + wg * (HB * BN * 2);

    constexpr int NS = BN / 2;
    for (int i = 0; i < pairs; ++i) {
        const u32 par = i & 1;
        const int r0 = (i & 1) ? 3 : 1, r1 = (i & 1) ? 1 : 3;
        const int sl = wg == 0 ? 0 : 2, sr = wg == 0 ? r0 : r1;  // this warpgroup's block: left / right slot
        // ---- S = Q . K_own^T over all 512 columns (32 steps), both slots of the own block
        float s[NS];
        mbar_wait(FULL(sl), par);
        mbar_wait(FULL(sr), par);
        proxy_fence();
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 32; ++ks) {
            const int blk = ks >> 2;  // column block of 64 (0..7): 0..3 in the left slot, 4..7 in the right
            const u32 off = (ks & 3) * 32;
            const u32 kb = (blk < 4 ? SLOT_BASE(sl) : SLOT_BASE(sr)) + (blk & 3) * BN * 128 + off;
            wgmma_qk(s, desc(q_base + blk * HB * 128 + off, 16, 1024), desc(kb, 16, 1024), ks > 0);
        }
        wg_commit();
        wg_wait0();
#pragma unroll
        for (int k = 0; k < NS; ++k) reg_fence(s[k]);
        // scale, absent keys to -inf (this block's valid bytes), the own rows' maxima
        float mx_a, mx_b;
        scale_mask_max<BN>(s, s_valid + wg * BN, cq, scale2, mx_a, mx_b);
        // release what this warpgroup no longer reads: warpgroup 0 is done with b0's right slot (warpgroup 1 reads
        // it for O_R later) and never reads b1's right slot; warpgroup 1 is done with b1's left slot (warpgroup 0
        // reads it for O_L later: both must arrive) and never reads b0's left slot. The valid bytes were read.
        if (wg == 0) { mbar_arrive(EMPTY(r0)); mbar_arrive(EMPTY(r1)); }
        else { mbar_arrive(EMPTY(2)); mbar_arrive(EMPTY(0)); }

        float mn0_a, mn0_b, sc0_a, sc0_b, ls0_a, ls0_b, sc1_a, sc1_b, ls1_a, ls1_b, mn1_a, mn1_b;
        if (wg == 0) {
            mn0_a = fmaxf(m_a, mx_a); mn0_b = fmaxf(m_b, mx_b);
            sc0_a = ex2(m_a - mn0_a); sc0_b = ex2(m_b - mn0_b);
            exp_sum<BN>(s, mn0_a, mn0_b, ls0_a, ls0_b);
            ls0_a += __shfl_xor_sync(0xffffffffu, ls0_a, 1); ls0_a += __shfl_xor_sync(0xffffffffu, ls0_a, 2);
            ls0_b += __shfl_xor_sync(0xffffffffu, ls0_b, 1); ls0_b += __shfl_xor_sync(0xffffffffu, ls0_b, 2);
            if (cq == 0) {
                s_st[row_a] = make_float4(mn0_a, sc0_a, ls0_a, 0.f);
                s_st[row_b] = make_float4(mn0_b, sc0_b, ls0_b, 0.f);
            }
            bar_arrive(BAR_S0, 256);
            // O_L = O_L sc0 + p0 V0[:, 0:256] (P from registers)
            rescale_pv<BN>(o, s, sc0_a, sc0_b, SLOT_BASE(0));
#pragma unroll
            for (int k = 0; k < 128; ++k) reg_fence(o[k]);
            mbar_arrive(EMPTY(0));
            // warpgroup 1's stats and P1
            bar_sync(BAR_S1, 256);
            const float4 ta = s_st[HB + row_a], tb = s_st[HB + row_b];
            mn1_a = ta.x; sc1_a = ta.y; ls1_a = ta.z; mn1_b = tb.x; sc1_b = tb.y; ls1_b = tb.z;
            // P0 = p0 sc1 as bf16 into the own P tile (A operand layout: row r, keys 2 per 4 bytes, granule j ^ r % 8)
            if (i > 0) bar_sync(BAR_P0FREE, 256);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                *(u32*)(my_pt + row_a * 128 + ((j ^ (row_a & 7)) << 4) + 4 * cq) =
                    pack_bf16(s[4 * j] * sc1_a, s[4 * j + 1] * sc1_a);
                *(u32*)(my_pt + row_b * 128 + ((j ^ (row_b & 7)) << 4) + 4 * cq) =
                    pack_bf16(s[4 * j + 2] * sc1_b, s[4 * j + 3] * sc1_b);
            }
            proxy_fence();  // the generic-proxy writes, visible to warpgroup 1's wgmma (async proxy)
            bar_arrive(BAR_P0, 256);
            // O_L = O_L sc1 + P1 V1[:, 0:256] (P1 from warpgroup 1's tile)
            if (__any_sync(0xffffffffu, sc1_a != 1.f || sc1_b != 1.f)) {
#pragma unroll
                for (int k = 0; k < 128; ++k) o[k] *= (k & 2) ? sc1_b : sc1_a;
            }
#pragma unroll
            for (int k = 0; k < 128; ++k) reg_fence(o[k]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_pv_ss(o, desc(other_p + kk * 32, 16, 1024), desc(SLOT_BASE(2) + kk * 16 * 128, BN * 128, 1024));
            wg_commit();
            wg_wait0();
#pragma unroll
            for (int k = 0; k < 128; ++k) reg_fence(o[k]);
            mbar_arrive(EMPTY(2));
            if (i + 1 < pairs) bar_arrive(BAR_P1FREE, 256);
        } else {
            bar_sync(BAR_S0, 256);
            const float4 ta = s_st[row_a], tb = s_st[row_b];
            mn0_a = ta.x; sc0_a = ta.y; ls0_a = ta.z; mn0_b = tb.x; sc0_b = tb.y; ls0_b = tb.z;
            mn1_a = fmaxf(mn0_a, mx_a); mn1_b = fmaxf(mn0_b, mx_b);
            sc1_a = ex2(mn0_a - mn1_a); sc1_b = ex2(mn0_b - mn1_b);
            exp_sum<BN>(s, mn1_a, mn1_b, ls1_a, ls1_b);
            ls1_a += __shfl_xor_sync(0xffffffffu, ls1_a, 1); ls1_a += __shfl_xor_sync(0xffffffffu, ls1_a, 2);
            ls1_b += __shfl_xor_sync(0xffffffffu, ls1_b, 1); ls1_b += __shfl_xor_sync(0xffffffffu, ls1_b, 2);
            // P1 into the own P tile once warpgroup 0 has read the previous one; the stats beside it
            if (i > 0) bar_sync(BAR_P1FREE, 256);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                *(u32*)(my_pt + row_a * 128 + ((j ^ (row_a & 7)) << 4) + 4 * cq) = pack_bf16(s[4 * j], s[4 * j + 1]);
                *(u32*)(my_pt + row_b * 128 + ((j ^ (row_b & 7)) << 4) + 4 * cq) =
                    pack_bf16(s[4 * j + 2], s[4 * j + 3]);
            }
            if (cq == 0) {
                s_st[HB + row_a] = make_float4(mn1_a, sc1_a, ls1_a, 0.f);
                s_st[HB + row_b] = make_float4(mn1_b, sc1_b, ls1_b, 0.f);
            }
            proxy_fence();
            bar_arrive(BAR_S1, 256);
            // O_R = O_R sc0 sc1 + p1 V1[:, 256:512] (P from registers)
            const float f_a = sc0_a * sc1_a, f_b = sc0_b * sc1_b;
            rescale_pv<BN>(o, s, f_a, f_b, SLOT_BASE(r1));
#pragma unroll
            for (int k = 0; k < 128; ++k) reg_fence(o[k]);
            mbar_arrive(EMPTY(r1));
            // O_R += P0 V0[:, 256:512] (P0 = p0 sc1 from warpgroup 0's tile)
            bar_sync(BAR_P0, 256);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_pv_ss(o, desc(other_p + kk * 32, 16, 1024), desc(SLOT_BASE(r0) + kk * 16 * 128, BN * 128, 1024));
            wg_commit();
            wg_wait0();
#pragma unroll
            for (int k = 0; k < 128; ++k) reg_fence(o[k]);
            mbar_arrive(EMPTY(r0));
            if (i + 1 < pairs) bar_arrive(BAR_P0FREE, 256);
        }
        // the shared running sums (the same operations in both warpgroups: the same bits)
        l_a = l_a * sc0_a * sc1_a + ls0_a * sc1_a + ls1_a;
        l_b = l_b * sc0_b * sc1_b + ls0_b * sc1_b + ls1_b;
        m_a = mn1_a;
        m_b = mn1_b;
    }

    bar_sync(1, 256);  // both warpgroups are done with every slot, P tile and the query tile

    const float r_a = 1.f / (l_a > 0.f ? l_a : 1.f), r_b = 1.f / (l_b > 0.f ? l_b : 1.f);
    u16* dst = out;
    long long row0 = t * H + h0;
    if (n_split > 1) {
        dst = part;
        row0 = ((long long)sp * T + t) * H + h0;
        if (cq == 0 && wg == 0) {
            ml[(row0 + row_a) * 2] = m_a;
            ml[(row0 + row_a) * 2 + 1] = l_a;
            ml[(row0 + row_b) * 2] = m_b;
            ml[(row0 + row_b) * 2 + 1] = l_b;
        }
    }
    store_half(smem + wg * (HB * 528), o, r_a, r_b, row_a, cq, wg, wt, dst, row0);  // row_b = row_a + 8
}
"""


def _source() -> str:
    return WD.HEAD + nvrtc.PDL_DEVICE + WD.wgmma_ss(W.BN) + WD.wgmma_rs() + WD.WGMMA_SS_PV + WD.RESCALE_PV + _KERNEL


def name(idx64: bool) -> str:
    return f"attn_seesaw<{W.BN}, {str(idx64).lower()}>"


PROGRAM = nvrtc.Program(_source(), "attention_seesaw.cu", [name(i) for i in (False, True)], arch_suffix="a")
SLOT = W.BN * 256 * 2  # a half block: 64 rows x 256 columns bf16
PT = W.HB * W.BN * 2   # a P tile: 64 heads x 64 keys bf16


def smem_bytes() -> int:
    """Query tile + 4 slots + 2 P tiles + stats [2][64] float4 + valid bytes [2][64] + 8 mbarriers + alignment."""
    return W.HB * W.D * 2 + 4 * SLOT + 2 * PT + 2 * W.HB * 16 + 2 * W.BN + 8 * 8 + 1024


def splits(nc: int, n_sm: int, programs: int) -> tuple[int, int]:
    """:func:`.attention_wgmma.splits` with an even number of chunks a split (a pair's second block is otherwise
    absent: computed, never read)."""
    n, c = W.splits(nc, n_sm, programs)
    if n > 1 and c % 2:
        c += 1
        n = -(-nc // c)
    return (n, c) if n > 1 else (1, max(nc, 1))


def preferred(t_count: int, h_count: int) -> bool:
    """Where the default takes this kernel over attention_wgmma's (both only where attention_wgmma.preferred): 128+
    heads, or 64 heads from 512 CTAs. H200, us, forced side by side (scripts/bench_results/h200_session29.txt):
    h = 128, T = 8 / 32 / 128 decode 13.9 / 24.6 / 59.0 against 15.2 / 24.6 / 64.7, 2048-token prefill (distinct
    rows / one sequence) 934 / 789 against 993 / 905; h = 64, T = 32 / 64 / 128 decode 19.9 / 28.8 / 36.4 against
    19.3 / 26.3 / 35.7 (slower), prefill 525 / 401 against 542 / 466 (faster). Between 128 and 2048 tokens at 64
    heads nothing was timed: 512 is their geometric middle."""
    return h_count >= 128 or t_count * (h_count // W.HB) >= 512
