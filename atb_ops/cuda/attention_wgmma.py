"""Sparse attention decode over gathered rows on Hopper's warpgroup MMA (``wgmma``), CUDA C built by NVRTC for
sm_90a (:mod:`.nvrtc`): V4's shape, bf16 q [T, H, 512] and pool rows [P, >= 512] (K = V = row[:512]), H a multiple of
64, no rope part. Same math and contract as :mod:`.attention_v2` (one softmax over the main set ``idx`` and the extra
set ``idx2``, the sink in the denominator, float32 scores and sums, P rounded to bf16 for P.V, -1 = absent key, never
read), and the same split partials, merged by :func:`.attention_v2._merge_splits_kernel`.

Why: attention_v2's Triton program (copies, Q.K^T, softmax, P.V in order in one 8-warp program per SM) reached 44.5 %
of an H200's copy bandwidth at T = 128, h = 64, 128 + 512 keys (goal 60 %); this kernel 66.8-67.9 % there, h = 128 334
against 237 TFLOP/s (scripts/bench_results/h200_session26.txt; default: :func:`preferred`; forms not kept: HISTORY.md
there, sessions 25-28). A second schedule of the same contract: :mod:`.attention_seesaw`.

Work layout (one CTA = 64 heads of one token, a range of its key chunks; one CTA per SM; 384 threads):

- shared memory: the 64 x 512 query tile (64 KB) and ST = 2 stages of BN = 64 key rows (64 KB each), both stored as
  8 column blocks of 64 elements, each block [rows][128 B] with the 16-byte granules of row r at ``g ^ (r % 8)``:
  the 128-byte-swizzled canonical layout of wgmma, which serves the key rows as K-major B of Q.K^T and, read with
  the transpose bit, as the MN-major B of P.V (V = K: the same bytes);
- warpgroup 2, the producer (``setmaxnreg`` 40 registers), copies the query tile, then each chunk's rows by
  ``cp.async`` (16 bytes a thread, zero-filled for absent keys) into a stage once the consumers release it (mbarrier
  ``empty``); ``cp.async.mbarrier.arrive`` marks it full when the copies land (mbarrier ``full``);
- warpgroups 0 and 1, the consumers (232 registers), each own a column half: warpgroup g computes the partial scores
  S_g = Q[:, 256 g : 256 g + 256] . K[:, same]^T (m64nBNk16, both operands from shared memory, 16 steps), the
  halves are swapped through shared memory and each adds the other's (S_0 + S_1 = S_1 + S_0: both hold the same
  bits; named barriers order the swap), runs the same online softmax (scores times scale * log2 e, absent keys to
  -inf, exp2), rescales its output half and adds P . V[:, its 256 columns] (m64n256k16, P from registers as the A
  operand, 4 steps of 16 keys): the 64 x 512 float32 output is 128 registers a thread, half in each warpgroup.
  After the last chunk each writes its half to shared memory (rows 528 bytes apart) and stores it 16 bytes a thread;
- key-list splits (:func:`splits`): partials o_s = acc_s / l_s in bf16 with (m_s, l_s) float32, exactly as
  attention_v2 stores them, merged by its merge kernel over 64-column programs.

wgmma operand encodings (descriptors, 128-byte swizzle, accumulator / A-in-register layouts), mbarriers, setmaxnreg:
PTX ISA (docs.nvidia.com/cuda/parallel-thread-execution, "Asynchronous Warpgroup Level Matrix" 9.7.15, "mbarrier").
"""

from __future__ import annotations

import torch

from . import attention_v2, nvrtc
from . import wgmma_device as WD
from ._util import pdl, pow2

NT = 384  # threads: two consumer warpgroups and a producer warpgroup
D = 512  # head dim (K = V)
HB = 64  # heads per CTA: the wgmma M
BN, ST = 64, 2  # keys per chunk, stages (with the query tile and score halves: 227 KB; 48 x 3, 32 x 4 were slower)
MERGE_CHUNKS = 1.5  # what the split merge costs, in chunks of one CTA's time: :func:`splits`
MERGE_COLS = 64  # output columns a program of the split merge: D / MERGE_COLS programs per CTA's 64 heads (run())


def smem_bytes(bn: int, st: int) -> int:
    """Query tile + ST key stages + the two score halves + the stages' key-valid bytes + 2 ST mbarriers + 1 KB of
    alignment (the output's staging, 2 x 64 rows of 528 bytes, reuses the tiles after the last chunk)."""
    return HB * D * 2 + st * bn * D * 2 + 2 * HB * bn * 4 + st * bn + 16 * st + 8 + 1024


_KERNEL = r"""
template <int BN, int ST, bool IDX64>
__global__ void __launch_bounds__(NT, 1)
attn_wgmma(const u16* __restrict__ q, const u16* __restrict__ kv, const void* __restrict__ idx,
           const u16* __restrict__ kv2, const void* __restrict__ idx2, const float* __restrict__ sink,
           u16* __restrict__ out, u16* __restrict__ part, float* __restrict__ ml,
           int T, int H, int K1, int K2, int stride_kv, int stride_kv2, double scale2_d,
           int chunks_per_split, int n_split, int has_sink, int pdl_early) {
    // (scalar arguments as torch's module loader passes them: Python ints as 32-bit int, floats as double)
    const float scale2 = (float)scale2_d;
    pdl_wait(pdl_early);  // q, the index lists and the pools: the previous kernels' outputs
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // the swizzle pattern repeats every 1024 bytes: align the tiles to it (an offset from the shared array, so
    // that the compiler keeps shared-memory instructions for the accesses below)
    unsigned char* smem = smem_raw + ((1024u - ((u32)__cvta_generic_to_shared(smem_raw) & 1023u)) & 1023u);
    unsigned char* s_q = smem;                                          // HB x D bf16, 8 column blocks
    unsigned char* s_k = smem + HB * D * 2;                             // ST stages of BN x D bf16
    float4* s_x = (float4*)(s_k + ST * BN * D * 2);                     // score halves, [2][BN / 8][128] float4
    unsigned char* s_valid = (unsigned char*)(s_x + 2 * HB * BN / 4);  // ST x BN key-valid bytes
    const u32 bars = ((u32)__cvta_generic_to_shared(s_valid + ST * BN) + 7u) & ~7u;  // mbarriers full[ST], empty[ST]
    #define FULL(s) (bars + 8u * (s))
    #define EMPTY(s) (bars + 8u * (ST + (s)))

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = tid >> 7, wt = tid & 127;  // warpgroup (0, 1: consumers; 2: producer), thread in it
    const Work wk = cta_work<BN>(H, K1, K2, chunks_per_split, n_split);
    const int sp = wk.sp, h0 = wk.h0, n1 = wk.n1, c_lo = wk.c_lo, c_hi = wk.c_hi;
    const long long t = wk.t;
    const u32 q_base = (u32)__cvta_generic_to_shared(s_q);
    const u32 k_base = (u32)__cvta_generic_to_shared(s_k);

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            mbar_init(FULL(s), 256);   // 128 producer threads x 2: a thread's copies landed; its valid bytes written
            mbar_init(EMPTY(s), 256);  // 256 consumer threads: done reading the stage (both P.V complete)
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 2) {
        // producer: the query tile, then each chunk's rows into its stage as soon as the consumers release it
        // (40 registers; the consumers take the rest of the register file: 232)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        const int pw = warp - 8;  // 0..3: rows pw + 4 i (i < BN / 4) of a chunk; lanes 512 contiguous bytes at a time
        // swizzled offsets: row r = pw + 4 i has r % 8 = pw + 4 (i % 2)
        const u32 offe = (u32)((pw * 128) + (((lane & 7) ^ pw) << 4));
        const u32 offo = (u32)(((pw + 4) * 128) + (((lane & 7) ^ (pw + 4)) << 4));
        copy_query(q, t, H, h0, q_base, pw, lane, offe, offo);  // the query tile (64 rows)
        // this lane's row index of a chunk (lanes < BN / 4: row pw + 4 lane; -1: absent or past the list; pools
        // < 2^31 rows), loaded one chunk ahead and broadcast by shuffles
        auto row_of = [&](int c) { return row_index<BN, IDX64>(c, wk, K1, K2, idx, idx2, pw, lane); };
        int nxt = row_of(c_lo);
        for (int c = c_lo; c < c_hi; ++c) {
            const int it = c - c_lo, stage = it % ST;
            const int cur = nxt;
            nxt = row_of(c + 1);
            if (it >= ST) mbar_wait(EMPTY(stage), ((it / ST) - 1) & 1);
            const bool extra = c >= n1;
            const u16* pool = (extra ? kv2 : kv) + lane * 8;
            const long long stride = extra ? stride_kv2 : stride_kv;
            if (lane < BN / 4) s_valid[stage * BN + pw + 4 * lane] = cur >= 0;
            const u32 sb = k_base + stage * BN * D * 2 + (lane >> 3) * BN * 128;
#pragma unroll
            for (int i = 0; i < BN / 4; ++i) {
                const int r = __shfl_sync(0xffffffffu, cur, i);
                const bool ok = r >= 0;
                const u16* src = pool + (ok ? (long long)r * stride : 0);
                const u32 o = sb + (i >> 1) * 1024 + ((i & 1) ? offo : offe);
                cp_async16(o, src, ok);
                cp_async16(o + 4 * BN * 128, src + 256, ok);
            }
            mbar_arrive_cp_async(FULL(stage));  // (the first also covers the query tile's copies)
            mbar_arrive(FULL(stage));           // releases the valid bytes
        }
        cp_async_wait<0>();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

    // consumers: warpgroup wg owns the column half 256 wg .. 256 wg + 255 of Q.K^T's sum and of the output
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const int g = lane >> 2, cq = lane & 3, wi = warp & 3;
    const int row_a = 16 * wi + g;  // this thread's two rows (heads): row_a, row_a + 8
    float m_a = NEG_BIG, m_b = NEG_BIG, l_a = 0.f, l_b = 0.f;
    if (has_sink && n_split == 1) {
        m_a = sink[h0 + row_a] * 1.4426950408889634f;
        m_b = sink[h0 + row_a + 8] * 1.4426950408889634f;
        // the sink's own term, 2^(sink - m) = 1 at m = sink, counted once per row: by the quad's first thread
        l_a = l_b = cq == 0 ? 1.f : 0.f;
    }

    constexpr int NS = BN / 2;
    for (int c = c_lo; c < c_hi; ++c) {
        const int it = c - c_lo, stage = it % ST;
        mbar_wait(FULL(stage), (it / ST) & 1);  // the chunk's rows (and the query tile) have landed
        proxy_fence();                          // ... and are visible to the asynchronous proxy (wgmma)

        // S_wg = Q[:, wg half] . K[:, wg half]^T: 16 steps of 16 columns
        float s[NS];
        const u32 kst = k_base + stage * BN * D * 2;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 16; ++ks) {
            const int blk = wg * 4 + (ks >> 2);  // column block of 64
            const u32 off = (ks & 3) * 32;       // 16 columns = 32 bytes into the swizzled 128-byte row
            wgmma_qk(s, desc(q_base + blk * HB * 128 + off, 16, 1024), desc(kst + blk * BN * 128 + off, 16, 1024),
                     ks > 0);
        }
        wg_commit();
        wg_wait0();
#pragma unroll
        for (int i = 0; i < NS; ++i) reg_fence(s[i]);

        // swap the halves through shared memory: each warpgroup writes its partial and adds the other's (S_0 + S_1 =
        // S_1 + S_0: the same bits in both); 16-byte accesses, consecutive threads consecutive (no bank conflicts).
        // Its buffer s_x[wg] is rewritten once the other warpgroup has read the last chunk's (named barrier 2 + wg)
        if (it > 0) bar_sync(2 + wg, 256);
#pragma unroll
        for (int i = 0; i < NS / 4; ++i)
            s_x[(wg * NS / 4 + i) * 128 + wt] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
        bar_sync(1, 256);
#pragma unroll
        for (int i = 0; i < NS / 4; ++i) {
            const float4 v = s_x[((1 - wg) * NS / 4 + i) * 128 + wt];
            s[4 * i] += v.x;
            s[4 * i + 1] += v.y;
            s[4 * i + 2] += v.z;
            s[4 * i + 3] += v.w;
        }
        if (c + 1 < c_hi) bar_arrive(2 + (1 - wg), 256);  // the other's half is read: it may overwrite it

        float mx_a, mx_b;  // online softmax (scale_mask_max / exp_sum above)
        scale_mask_max<BN>(s, s_valid + stage * BN, cq, scale2, mx_a, mx_b);
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float al_a = ex2(m_a - mn_a), al_b = ex2(m_b - mn_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a, sum_b;
        exp_sum<BN>(s, mn_a, mn_b, sum_a, sum_b);
        l_a = l_a * al_a + sum_a;
        l_b = l_b * al_b + sum_b;
        if (__any_sync(0xffffffffu, al_a != 1.f || al_b != 1.f)) {  // (the row maxima rarely move late in the list)
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? al_b : al_a;
        }

        // O[:, wg half] += P . V[:, wg half]: 16 keys a step; V = the stage's rows read MN-major (transposed). P in
        // bf16 pairs as the A fragments (rows row_a / row_a + 8, keys 2cq and 2cq + 8 of each 16), every register
        // the MMA reads produced before the fence (the compiler must not sink the rescale or the packs past it)
        u32 pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 p0 = pack_bf16(s[8 * kk], s[8 * kk + 1]), p1 = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            const u32 p2 = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]), p3 = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
            pa[kk][0] = p0; pa[kk][1] = p1; pa[kk][2] = p2; pa[kk][3] = p3;
#pragma unroll
            for (int r = 0; r < 4; ++r) reg_fence_u(pa[kk][r]);
        }
#pragma unroll
        for (int i = 0; i < 128; ++i) reg_fence(o[i]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            // leading byte offset: the next 64-column block (BN rows of 128 B); stride: the next 8 keys (1 KB)
            wgmma_pv(o, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                     desc(kst + (wg * 4) * BN * 128 + kk * 16 * 128, BN * 128, 1024));
        wg_commit();
        wg_wait0();
#pragma unroll
        for (int i = 0; i < 128; ++i) reg_fence(o[i]);
        mbar_arrive(EMPTY(stage));  // this thread's reads of the stage are done
    }

    bar_sync(1, 256);  // both warpgroups are done with every stage, score buffer and the query tile
    // the rows' sums over the quad; out = o / l (one reciprocal a row), or the split's normalised partial
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float r_a = 1.f / (l_a > 0.f ? l_a : 1.f), r_b = 1.f / (l_b > 0.f ? l_b : 1.f);
    u16* dst = out;
    long long row0 = t * H + h0;
    if (n_split > 1) {
        dst = part;
        row0 = ((long long)sp * T + t) * H + h0;
        if (cq == 0 && wg == 0) {
            ml[(row0 + row_a) * 2] = m_a;
            ml[(row0 + row_a) * 2 + 1] = l_a;
            ml[(row0 + row_a + 8) * 2] = m_b;
            ml[(row0 + row_a + 8) * 2 + 1] = l_b;
        }
    }
    store_half(smem + wg * (HB * 528), o, r_a, r_b, row_a, cq, wg, wt, dst, row0);  // this warpgroup's half
}
"""


def _source() -> str:
    return WD.HEAD + nvrtc.PDL_DEVICE + WD.wgmma_ss(BN) + WD.wgmma_rs() + _KERNEL


def _name(bn: int, st: int, idx64: bool) -> str:
    return f"attn_wgmma<{bn}, {st}, {str(idx64).lower()}>"


PROGRAM = nvrtc.Program(_source(), "attention_wgmma.cu", [_name(BN, ST, i64) for i64 in (False, True)],
                        arch_suffix="a")


def splits(nc: int, n_sm: int, programs: int) -> tuple[int, int]:
    """(splits, chunks per split) of ``nc`` key chunks over ``programs`` CTAs: :func:`.attention_v2.key_splits`, kept
    where ``chunks + MERGE_CHUNKS < nc`` (H200, us, h200_session28.txt call 3: 128 + 512 keys, T = 8: 10 x 1 15.9, 3 x 4
    19.5; HCA's 128 + 64 keys, T = 8: 3 x 1 10.7, unsplit 13.0; T = 64: unsplit 14.8, 2 x 2 17.1)."""
    n, c = attention_v2.key_splits(nc, max(n_sm, 1), programs)
    if n > 1 and c + MERGE_CHUNKS >= nc:
        return 1, max(nc, 1)
    return n, c


def preferred(t_count: int, h_count: int) -> bool:
    """Where the default (``ATB_CUDA_ATTN_IMPL=auto``) takes this kernel over attention_v2's / attention.py's: from 8
    CTAs (tokens x 64-head blocks). H200, us (h200_session28.txt call 4): h = 64, T = 8 / 32 / 128 17.0 / 20.5 / 38.7
    against 18.6 / 26.5 / 57.3; HCA T = 8 11.1 against 13.3; 4 CTAs: T = 4 14.3 against 15.1, HCA 10.9 against 8.5."""
    return t_count * (h_count // HB) >= 8


def eligible(q1, q2, kv, idx, kv2, idx2, out_dtype) -> bool:
    """bf16 q1 [T, H, 512] with H a multiple of 64, no rope part, bf16 pools of >= 512 columns with unit column
    stride, 16-byte aligned rows, index lists int32 / int64 of one dtype, a bf16 output, and the kernels built
    for this device (compute capability 9.0: wgmma)."""
    if q2 is not None or q1.dtype != torch.bfloat16 or out_dtype != torch.bfloat16 or not q1.is_cuda:
        return False
    if q1.dim() != 3 or q1.shape[-1] != D or q1.shape[1] % HB or q1.shape[1] == 0:
        return False
    pools = [kv] + ([kv2] if kv2 is not None and idx2 is not None and idx2.shape[-1] > 0 else [])
    for p in pools:
        if p.dtype != torch.bfloat16 or p.dim() != 2 or p.shape[1] < D or p.stride(1) != 1 or p.stride(0) % 8 \
                or p.data_ptr() % 16 or p.shape[0] >= 2**31 or p.stride(0) >= 2**31:
            return False
    idxs = [idx] + ([idx2] if len(pools) == 2 else [])
    if any(i.dtype not in (torch.int32, torch.int64) or i.dtype != idx.dtype for i in idxs):
        return False
    return PROGRAM.available(q1.device, min_cc=(9, 0), max_cc=(9, 0))


_CONFIGURED: set = set()


def _kernel(device: torch.device, idx64: bool, seesaw: bool):
    """(instance, its shared memory, its split rule); the instance allowed that memory once (over 48 KB: opt-in)."""
    from . import attention_seesaw as S  # (it imports this module)
    prog, name, smem, rule = (S.PROGRAM, S.name(idx64), S.smem_bytes(), S.splits) if seesaw else \
        (PROGRAM, _name(BN, ST, idx64), smem_bytes(BN, ST), splits)
    kern = prog.kernels(device)[name]
    if (str(device), name) not in _CONFIGURED:
        kern.set_shared_memory_config(smem)
        _CONFIGURED.add((str(device), name))
    return kern, smem, rule


def run(q1, kv, idx, kv2, idx2, sink, scale, n_sm: int, seesaw: bool = False):
    """The op (arguments as attention.py's ``_run``; :func:`eligible` holds) -> out [T, H, 512] bf16 (``seesaw``:
    on :mod:`.attention_seesaw`'s kernel)."""
    t_count, h_count, _ = q1.shape
    out = torch.empty(t_count, h_count, D, dtype=torch.bfloat16, device=q1.device)
    has_extra = kv2 is not None and idx2 is not None and idx2.shape[-1] > 0
    k1, k2 = idx.shape[-1], (idx2.shape[-1] if has_extra else 0)
    nc = -(-k1 // BN) + -(-k2 // BN)
    if t_count == 0 or nc == 0:  # no key: zeros (a CTA without chunks would race its query-tile copies with the
        return out.zero_()      # output's staging in the same shared memory)
    n_hb = h_count // HB
    programs = t_count * n_hb
    kern, smem, rule = _kernel(q1.device, idx.dtype == torch.int64, seesaw)
    n_split, cps = rule(nc, n_sm, programs)  # one CTA per SM
    q1c, idxc = q1.contiguous(), idx.contiguous()
    idx2c = idx2.contiguous() if has_extra else idxc
    kv2c = kv2 if has_extra else kv
    sinkc = sink.float().contiguous() if sink is not None else out
    if n_split > 1:
        part = torch.empty(n_split, t_count, h_count, D, dtype=torch.bfloat16, device=q1.device)
        ml = torch.empty(n_split, t_count, h_count, 2, dtype=torch.float32, device=q1.device)
    else:
        part, ml = out, out
    nvrtc.launch(kern, (programs * n_split, 1, 1), (NT, 1, 1),
                 [q1c, kv, idxc, kv2c, idx2c, sinkc, out, part, ml, t_count, h_count, k1, k2, kv.stride(0),
                  kv2c.stride(0), float(scale) * attention_v2.LOG2E, cps, n_split, int(sink is not None)],
                 shared_mem=smem)
    if n_split > 1:
        # attention_v2's merge, MERGE_COLS columns a program
        nd = D // MERGE_COLS
        attention_v2._merge_splits_kernel[(programs * nd,)](part, ml, sinkc, out, t_count, h_count, D, n_split,
                                                            n_hb, HAS_SINK=sink is not None, BH=HB, DV=MERGE_COLS,
                                                            ND=nd, SP=pow2(n_split), num_warps=4,
                                                            **pdl())
    return out
