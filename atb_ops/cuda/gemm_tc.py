"""Swap-AB tensor-core linears and grouped expert matmuls over FP8-block and FP4 weights (few rows per weight).

out[m, :] = x[m, :] @ W[e(m)]^T, x bfloat16 [M, K], W [E, N, K] stored as

- ``fp8_block``: float8_e4m3fn [E, N, K], scales [E, ceil(N/128), ceil(K/128)] float32 or E8M0:
  W[n, k] = e4m3 * s[n // 128, k // 128];
- ``fp4``: int8 [E, N, K/2], element 2c in the low nibble of byte c, E8M0 scales uint8 [E, N, K/32]:
  W[n, k] = e2m1(code) * 2^(s[n, k // 32] - 127).

Decode-sized calls have a handful of rows (tokens) per weight, far fewer than the 64-row side of a Hopper
``wgmma``. The kernel therefore computes the transposed product out^T[n, m] = W[n, :] . x[m, :] ("swap AB"): a tile
of BW weight rows is the MMA's M side (64 / 128) and BT = 16..64 tokens its N side, so no MMA work is padding
beyond the rounding of the token count up to 16. Per K step of BK elements:

- the weight tile is copied to shared memory by cp.async (software-pipelined, ``num_stages`` deep) and read back
  straight into the wgmma A-operand register layout undecoded (Triton hoists the layout change above the
  decode), then decoded in registers: fp8 bytes as the 16-bit pairs each thread holds in that layout (weight
  columns 2c, 2c + 1) by a PTX bit decoder (:data:`FP8P_PTX`, exact, in column order: the default since session 21),
  or by Triton's e4m3 -> bfloat16 conversion (d8=0), or as int16 words against the activations' even / odd columns
  (:data:`FP8X2_PTX`, d8=1: session 20's form); fp4 as int16 words of 4 codes by a PTX bit decoder
  (:data:`FP4X4_PTX`: bf16 bits ``s << 15 | (e, m) << 6`` = e2m1 * 2^-126, times 2^126 and the E8M0 scale, a power
  of two; exact), giving 4 operands q_i [BW, BK/4] with code i of each word (weight column 4h + i), or (xsplit=2,
  opt-in) bytes decoded in order by :func:`.gemm_decode._fp4_decode` with their low / high nibbles interleaved
  into one operand. The weight never exists in bfloat16 in memory;
- the activation tile x[rows, k-range]^T is the B operand (shared memory, by cp.async); for fp4 words it is split
  into the 4 column phases x[:, 4h + i] that meet q_i (4 MMAs per step): in registers from int64 loads of 4
  columns, or by a copy of x to [4, M, K/4] before the kernel (``xsplit=1``), whose tiles then go to shared
  memory directly;
- fp8 block scales (one per 128 x 128 block: BW divides 128 and BK = 128) multiply each step's product; a program
  loads all the scales of its K range (a vector of NSC >= its steps) before its loop and takes each step's from
  registers (session 20, H200: the same time at 4096 x 4096 and M = 1 / 8 / 64, 3 % less at M = 32, 7.5 % less at
  M = 64 over a 32768 x 1024 weight, against loading the next step's scale one step ahead:
  scripts/bench_results/h200_session20.txt); the fp4 scale tile of the next step is loaded one step ahead (two
  steps ahead measured 9-21 % slower there).

Accumulation is float32 in registers; the products are exact (bfloat16 x bfloat16), so results differ from the
reference op (float32 dequantised weight, float32 matmul) only in summation order. When the tiles alone cannot
fill the GPU, K is split over programs; the float32 partial sums are added in split order (deterministic) by the
program that arrives last at its tile (an arrival counter per tile and pass, reset by that program), or by a
second kernel (``fixup=0``).

Rows of the grouped op: as in :mod:`.gemm_decode`, program slot j takes the j-th active expert (in increasing id)
and gathers its rows from ``expert_ids`` itself, BT at a time; the slot after the last active expert writes zeros
to rows whose id lies outside [0, E) (outside the op's contract; defined rather than left unwritten).

Under TRITON_INTERPRET the weights are decoded by plain Triton arithmetic (same values) and the dots run on
float32 copies of the operands.

One module of ~530 lines on purpose: the kernel's decode variants (each a constexpr branch of one K loop), their PTX
and the launcher that maps the tile settings onto those branches change together; the PTX strings are tested on
the CPU by emulation (tests/ops/test_gemm_tc.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm_decode as gd
from ._util import INTERPRET, env_overrides, sm_count, pdl_wait, pdl

MAX_ROWS = 1024  # rows of one call up to which this kernel may be used (rows are gathered in-kernel)


def _config(fmt: str, rows_per_weight: float, grouped: bool) -> dict:
    """Tile settings: BW weight rows (64: one warpgroup's wgmma M), BT rows per pass (the MMA's N: 16 / 32 / 64 from
    the rows per weight), BK elements per K step (fp8: 128, one scale block), warps, pipeline stages, programs per
    SM aimed at by split-K (ctas), a register cap (regs, 0: none), split-K partial sums added by the last program
    of each tile (fixup=1) or by a second kernel (fixup=0), fp4 activations split into their 4 column phases by a
    copy before the kernel (xsplit=1) or in registers each step (xsplit=0), or fp4 bytes decoded in order with x
    unsplit (xsplit=2), fp8 weights decoded by Triton's e4m3 conversion (d8=0), by the PTX of :data:`FP8X2_PTX` as
    int16 words against the even / odd activation columns (d8=1), by :data:`FP8P_PTX` as byte pairs in order
    (d8=2) or by gemm_decode's 4-byte decoder (d8=3). ATB_CUDA_TC_CFG="ctas=1,fixup=0" overrides some (benchmarks:
    the variants are timed side by side).

    Defaults from the variants timed on the H100 (scripts/bench_results/gemm_tc_h100.txt): grouped calls cap the
    registers at 128 at 16 rows per pass (four programs per SM; 5-10 % faster than uncapped), pre-split fp4
    activations (the copy is cheap next to ~100 us of expert weights; 8-12 % faster) and use 3 pipeline stages
    (fp4: 0.3-3 % faster than 4; fp8: the same); linears aim at 2 programs per SM up to 32 rows; at 64 rows fp8
    adds the splits in a second kernel and aims at 2 programs per SM (session 4: 0.0157 vs 0.0163 ms at 3 programs per
    SM, whose 448 programs overran one wave; scripts/bench_results/gemm_h100_session4.txt) and fp4 aims at one
    program per SM.

    fp8 calls decode with a PTX decoder instead of Triton's conversion (Nsight Compute had shown the kernel bound by its
    instruction stream, the conversion taking three conversion-pipe instructions per pair of weights), and fp8 linears
    of 17+ rows add split-K partials in a second kernel (up to 16 rows: below). Session 20's word decoder (d8=1)
    measured 4096 x 4096 at M = 1 / 8 / 32 11.7 / 11.9 / 13.5 -> 10.4 / 10.4 / 12.1 us but 3-12 % slower at 64 rows,
    whose activations' even / odd split passes through registers (scripts/bench_results/h200_session20.txt). Session
    21's pair decoder (d8=2) leaves the activations to cp.async and was as fast or faster at every shape timed (H200,
    scripts/bench_results/h200_session21.txt; against d8=0 / d8=1 in the same run): 4096 x 4096 at M = 1 / 32 / 64 12.1
    / 12.9 / 14.3 and 10.5 / 12.0 / 14.8 -> 10.3 / 11.1 / 13.3 us; 32768 x 1024 at M = 64 21.0 / 23.7 -> 17.4 us;
    grouped (64 experts, 8-64 tokens x top 6) 62-69 % -> 73-84 % of the copy bandwidth. Other 64-row tiles timed with it
    (bw=128 on 8 warps, 8 warps, bt=32, 2 or 4 stages, 1 / 3 / 4 programs per SM, fixup=1) were slower.

    fp4 bytes decoded in order (xsplit=2) stay opt-in: in the same session a 4096 x 4096 fp4 linear at M = 64 took
    16.3 us with it (3 stages) against 17.9 by the default path (gemm_tc_large), but 32768 x 1024 at M = 64 19.2
    against 18.9, M <= 32 was slower than the default paths, and grouped calls ran at 28-34 % of the copy bandwidth
    against 39-45 % with the 4 column phases (Triton reads the weight bytes one at a time in that layout).

    fp8 linears of at most 16 rows add their split-K partials in the kernel (fixup=1) since session 29 (H200,
    scripts/bench_results/h200_session29.txt, the FP8 linears of a Flash decode step at 8 rows): wq_a + wkv, wq_b,
    wo_b, shared w13 / w2 7.4 / 12.4 / 16.0 / 10.0 / 7.3 us against 8.0 / 12.4 / 16.3 / 10.4 / 7.6 with the second
    kernel; at 32 rows the second kernel stays (there fixup=1 measured 0-10 % slower)."""
    bt = 16 if rows_per_weight <= 16 else (32 if rows_per_weight <= 32 else 64)
    cfg = dict(bw=64, bt=bt, bk=128, warps=4, stages=3 if fmt == "fp8_block" else 4, ctas=3, regs=0, fixup=1, xsplit=0,
               d8=0)
    if grouped:
        cfg.update(regs=128 if bt == 16 else 0, xsplit=int(fmt == "fp4"), stages=3, d8=2 * (fmt == "fp8_block"))
    elif fmt == "fp8_block":
        cfg.update(ctas=2, d8=2, fixup=int(bt == 16))
    elif bt <= 32:
        cfg.update(ctas=2)
    else:
        cfg.update(ctas=1)
    env_overrides("ATB_CUDA_TC_CFG", cfg, dict(fixup=(0, 1), xsplit=(0, 1, 2), d8=(0, 1, 2, 3)))
    if fmt == "fp8_block":
        cfg["bk"] = 128  # one 128x128 scale block per step
    return cfg


# fp4 codes, one int16 word (4 codes) per element, 2 words per register: $4 = bytes b0 b1 (word 0) b2 b3 (word 1);
# $5 = the two words' scales (bfloat16). Output $i holds code i of each word (element 4h + i): $0 / $1 = low / high
# nibbles of (b0, b2), $2 / $3 = of (b1, b3). t = [0, b0, 0, b2] puts each byte in the high half of a 16-bit lane.
# Low nibble: magnitude bits 8-10 >> 2 -> 6-8, sign bit 11 << 4 -> 15; high nibble (h = t & 0xF000F000):
# magnitude bits 12-14 >> 6 -> 6-8, sign bit 15 in place. Bits the mask 0x81C0 keeps from one operand are zero in
# the other, so one lop3 ((a | b) & mask) merges them: bfloat16 bits s << 15 | (e, m) << 6 = e2m1 * 2^-126, then
# times 2^126 and the scale.
_FP4X4_PTX = tl.constexpr("""{
.reg .b32 t0, t1, a, b, h, k, z;
mov.b32 k, 0x7E807E80;
mov.b32 z, 0x80008000;
prmt.b32 t0, $4, 0, 0x2404;
prmt.b32 t1, $4, 0, 0x3414;
shr.u32 a, t0, 2;
shl.b32 b, t0, 4;
lop3.b32 $0, a, b, 0x81C081C0, 0xA8;
and.b32 h, t0, 0xF000F000;
shr.u32 a, h, 6;
lop3.b32 $1, a, h, 0x81C081C0, 0xA8;
shr.u32 a, t1, 2;
shl.b32 b, t1, 4;
lop3.b32 $2, a, b, 0x81C081C0, 0xA8;
and.b32 h, t1, 0xF000F000;
shr.u32 a, h, 6;
lop3.b32 $3, a, h, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $0, $0, k, z;
fma.rn.bf16x2 $1, $1, k, z;
fma.rn.bf16x2 $2, $2, k, z;
fma.rn.bf16x2 $3, $3, k, z;
fma.rn.bf16x2 $0, $0, $5, z;
fma.rn.bf16x2 $1, $1, $5, z;
fma.rn.bf16x2 $2, $2, $5, z;
fma.rn.bf16x2 $3, $3, $5, z;
}""")
# one multiply, by 2^126 * scale = 2^(s - 1) (E8M0 bytes s <= 128: see gemm_decode.small_scales)
_FP4X4_PTX_1MUL = tl.constexpr(gd.one_multiply(_FP4X4_PTX.value))
FP4X4_PTX = _FP4X4_PTX.value  # for the PTX emulation test (tests/ops/test_gemm_tc.py)
FP4X4_PTX_1MUL = _FP4X4_PTX_1MUL.value

# fp8 e4m3 bytes, one int16 word (2 codes, element 2c in the low byte) per element, 2 words per register:
# $2 = bytes b0 b1 (word 0) b2 b3 (word 1). Output $0 = (b0, b2), the words' even codes, $1 = (b1, b3), the odd ones,
# as bfloat16 pairs. t = [0, b0, 0, b2] (prmt) puts each byte in the high half of a 16-bit lane: its magnitude bits
# (e3..e0 m2..m0) >> 4 land on bfloat16 bits 4..10 and its sign stays on bit 15, so the bits read as e4m3 * 2^-120
# (bias 127 against 7; e = 0 subnormals included); one multiply by 2^120 (0x7B80) makes it exact. All on the ALU /
# FMA pipes: Triton's e4m3 -> bfloat16 conversion goes through cvt.rn.f16x2.e4m3x2 and two cvt.bf16.f16, three
# conversion-pipe instructions per pair. The NaN codes (0x7F, 0xFF) decode as +-480 (checkpoints hold none).
# (d8=1; the default is FP8P_PTX below, which spares the activations' even / odd split.)
_FP8_HEAD = ".reg .b32 t, a, g, k, z;\nmov.b32 k, 0x7B807B80;\nmov.b32 z, 0x80008000;\n"


def _e4m3_pair(dst: str, src: str, sel: str) -> str:
    """PTX: bfloat16 pair ``dst`` of the two e4m3 bytes of ``src`` that the prmt selector ``sel`` moves to bits 8-15
    and 24-31 (t = [0, b, 0, c]), by the bit placement above."""
    return (f"prmt.b32 t, {src}, 0, {sel};\nshr.u32 a, t, 4;\nand.b32 g, t, 0x80008000;\n"
            f"lop3.b32 {dst}, a, g, 0x07F007F0, 0xEC;\nfma.rn.bf16x2 {dst}, {dst}, k, z;\n")


_FP8X2_PTX = tl.constexpr("{\n" + _FP8_HEAD + _e4m3_pair("$0", "$2", "0x2404") + _e4m3_pair("$1", "$2", "0x3414") + "}")
FP8X2_PTX = _FP8X2_PTX.value  # for the PTX emulation test (tests/ops/test_gemm_tc.py)

# fp8 e4m3 bytes two at a time in order (d8=2, the default): $1 = the 16-bit pair b0 | b1 << 8 (the two weight
# columns 2c, 2c + 1 that one thread holds in the wgmma A-operand layout; Triton reads it from shared memory with one
# 16-bit load), $0 = bfloat16 (b0, b1). The same bits as FP8X2_PTX (t = [0, b0, 0, b1]), so the decoded tile is in
# natural column order and the activations go to shared memory by cp.async unchanged, one MMA per step.
# gemm_decode's 4-byte form (d8=3) makes Triton pack the bytes of two pairs into one register first: 5-20 % slower.
_FP8P_PTX = tl.constexpr("{\n" + _FP8_HEAD + "cvt.u32.u16 t, $1;\n" + _e4m3_pair("$0", "t", "0x1404") + "}")
FP8P_PTX = _FP8P_PTX.value  # for the PTX emulation test (tests/ops/test_gemm_tc.py)


@triton.jit
def _e4m3_f32(v):
    """float32 value of e4m3 bytes v (int32 0..255; interpreter path of :func:`_fp8x2_decode`)."""
    e = (v >> 3) & 0xF
    m = (v & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((v & 0x80) != 0, -mag, mag)


@triton.jit
def _fp8x2_decode(b, ASM: tl.constexpr):
    """b int16 [...] words of 2 e4m3 codes -> bfloat16 (even code, odd code) of each word (exact)."""
    if ASM:
        qe, qo = tl.inline_asm_elementwise(_FP8X2_PTX, "=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=2)
    else:
        c = b.to(tl.int32) & 0xFFFF
        qe = _e4m3_f32(c & 0xFF).to(tl.bfloat16)
        qo = _e4m3_f32(c >> 8).to(tl.bfloat16)
    return qe, qo


@triton.jit
def _fp8p_decode(b):
    """b float8_e4m3fn [...] -> bfloat16 (exact; GPU only), two codes per PTX call."""
    return tl.inline_asm_elementwise(_FP8P_PTX, "=r,h", [b.to(tl.int8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)


@triton.jit
def _fp4x4_decode(b, s, ASM: tl.constexpr, MUL1: tl.constexpr):
    """b int16 [...] words of 4 packed codes, s bfloat16 [...] their scale 2^(e - 127) (2^(e - 1) with MUL1) ->
    bfloat16 (q0, q1, q2, q3): code i of each word, scaled (exact)."""
    if ASM and MUL1:
        q0, q1, q2, q3 = tl.inline_asm_elementwise(_FP4X4_PTX_1MUL, "=r,=r,=r,=r,r,r", [b, s],
                                                   dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    elif ASM:
        q0, q1, q2, q3 = tl.inline_asm_elementwise(_FP4X4_PTX, "=r,=r,=r,=r,r,r", [b, s],
                                                   dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    else:
        c = b.to(tl.int32) & 0xFFFF
        sf = s.to(tl.float32)
        if MUL1:
            sf = sf * 1.1754943508222875e-38  # 2^-126
        q0 = (gd._e2m1(c & 0xF) * sf).to(tl.bfloat16)
        q1 = (gd._e2m1((c >> 4) & 0xF) * sf).to(tl.bfloat16)
        q2 = (gd._e2m1((c >> 8) & 0xF) * sf).to(tl.bfloat16)
        q3 = (gd._e2m1((c >> 12) & 0xF) * sf).to(tl.bfloat16)
    return q0, q1, q2, q3


@triton.jit
def split_k_fixup(acc, part_at, part_ptr, out_ptr, ctr, o_off, om, n_split, M, N, BW: tl.constexpr,
                  BT: tl.constexpr):
    """Split-K epilogue of the tensor-core GEMMs (this module, gemm_tc_large, gemm_fp4_moe): store this program's
    float32 partial tile at ``part_at + o_off``; the program that arrives last at the tile (atomic counter ``ctr``)
    adds the ``n_split`` partials ``part_ptr[sp, M, N]`` in split order (deterministic), writes the output tile and
    resets the counter for the next launch."""
    tl.store(part_at + o_off, acc, mask=om)
    tl.debug_barrier()
    old = tl.atomic_add(ctr, 1, sem="acq_rel")
    if old == n_split - 1:
        tot = tl.zeros((BW, BT), tl.float32)
        for sp in range(0, n_split):
            tot += tl.load(part_ptr + sp * M * N + o_off, mask=om, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + o_off, tot.to(out_ptr.dtype.element_ty), mask=om)
        tl.atomic_xchg(ctr, 0)


@triton.jit
def _tc_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr,
               M, N, K, E, stride_we, stride_se, stride_sn, k_split, n_slots, n_split, max_pass,
               FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, GROUPED: tl.constexpr, ASM: tl.constexpr,
               MUL1: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EP: tl.constexpr, MP: tl.constexpr,
               FIXUP: tl.constexpr, XSPLIT: tl.constexpr, NSC: tl.constexpr, D8: tl.constexpr,
               BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    if GROUPED:
        # this slot's expert and its rows: cnt rows, the r-th one = the r-th m with sel[m]
        sel, cnt, pos, e, n_act = gd.expert_slot(ids_ptr, act_ptr, M, E, n_slots, slot, MP, EP)
        m_all = tl.arange(0, MP)
        r_first = 0
    else:
        cnt = tl.minimum(M - slot * BT, BT)  # linear: slot = tile of BT rows
        r_first = slot * BT
        e = 0
    n = pid_n * BW + tl.arange(0, BW)
    nm = n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    if FMT == 2:
        k_end = K // 4  # int16 words (4 codes) per weight row = int64 activation quads per row
        KS: tl.constexpr = BK // 4
    else:
        k_end = K
        KS: tl.constexpr = BK
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k_end)
    if GROUPED:
        k_hi = tl.where(slot >= n_act, k_lo, k_hi)  # rows with an id outside [0, E): zeros
    c = tl.arange(0, KS)
    c2 = tl.arange(0, KS // 2)
    part_base = part_ptr + split.to(tl.int64) * M * N
    ctr_base = ctr_ptr + (pid_n * tl.num_programs(1) + slot) * max_pass
    if FMT == 1:  # fp8: the NSC >= steps block scales of this program's K range, loaded once before its loops
        jsc = tl.arange(0, NSC)
        s_row = s_base + (pid_n * BW // 128) * tl.cdiv(K, 128)
        svec = tl.load(s_row + k_lo // 128 + jsc, mask=k_lo + jsc * 128 < k_hi, other=0)
        if SCALE_E8M0:
            svf = gd._e8m0_f32(svec)
        else:
            svf = svec.to(tl.float32)
    for r0 in range(0, cnt, BT):
        r = r0 + tl.arange(0, BT)
        rm = r < cnt
        if GROUPED:
            hit = (pos[None, :] == r[:, None]) & sel[None, :]
            rows = tl.sum(tl.where(hit, m_all[None, :], 0), 1)
        else:
            rows = tl.minimum(r_first + r, M - 1)
        rows64 = rows.to(tl.int64)
        acc = tl.zeros((BW, BT), tl.float32)
        if FMT == 2:
            g = tl.arange(0, BK // 32)
            s_ptrs = s_base + n[:, None].to(tl.int64) * stride_sn + k_lo // 8 + g[None, :]
            sc_next = tl.load(s_ptrs, mask=nm[:, None] & ((k_lo // 8 + g) * 8 < k_hi)[None, :], other=127)
        for k0 in range(k_lo, k_hi, KS):
            k0 = tl.multiple_of(k0, KS)
            kk = k0 + c
            km = kk < k_end
            wm = nm[:, None] & km[None, :]
            xm = km[:, None] & rm[None, :]
            if FMT == 2:
                sc = sc_next
                s_ptrs += KS // 8
                sc_next = tl.load(s_ptrs, mask=nm[:, None] & (((k0 + KS) // 8 + g) * 8 < k_hi)[None, :], other=127)
            if FMT == 2 and XSPLIT == 2:  # bytes decoded in order, nibbles interleaved: x unsplit, one dot
                kb = k0 * 2 + tl.arange(0, BK // 2)  # byte columns of this step
                b8 = gd._ld(w_base.to(tl.pointer_type(tl.int8)) + n[:, None].to(tl.int64) * (K // 2) + kb[None, :],
                            nm[:, None] & (kb < K // 2)[None, :], 0, not (EVEN_K and EVEN_N))
                sb = tl.reshape(tl.broadcast_to(gd._scale_bf16(sc, MUL1)[:, :, None], (BW, BK // 32, 16)),
                                (BW, BK // 2))
                lo, hi = gd._fp4_decode(b8, sb, ASM, MUL1)
                kx = k0 * 4 + tl.arange(0, BK)
                xv = tl.load(x_ptr + rows64[None, :] * K + kx[:, None], mask=(kx < K)[:, None] & rm[None, :], other=0.0)
                if ASM:
                    acc = tl.dot(tl.interleave(lo, hi), xv, acc)
                else:
                    acc = tl.dot(tl.interleave(lo, hi).to(tl.float32), xv.to(tl.float32), acc, input_precision="ieee")
            elif FMT == 2:
                b = gd._ld(w_base + n[:, None].to(tl.int64) * k_end + kk[None, :], wm, 0, not (EVEN_K and EVEN_N))
                s16 = tl.reshape(tl.broadcast_to(gd._scale_bf16(sc, MUL1)[:, :, None], (BW, BK // 32, 8)), (BW, KS))
                q0, q1, q2, q3 = _fp4x4_decode(b, s16, ASM, MUL1)
                if XSPLIT:  # x pre-split into its 4 column phases [4, M, K/4]: four direct B-operand tiles
                    xp = x_ptr + rows64[None, :] * k_end + kk[:, None]
                    x0 = tl.load(xp, mask=xm, other=0.0)
                    x1 = tl.load(xp + M * k_end, mask=xm, other=0.0)
                    x2 = tl.load(xp + 2 * M * k_end, mask=xm, other=0.0)
                    x3 = tl.load(xp + 3 * M * k_end, mask=xm, other=0.0)
                else:  # activation columns 4h .. 4h+3 as one int64, split in registers: one dot per nibble position
                    xq = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + rows64[None, :] * k_end + kk[:, None], mask=xm,
                                 other=0)
                    x0 = xq.to(tl.int16).to(tl.bfloat16, bitcast=True)
                    x1 = (xq >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
                    x2 = (xq >> 32).to(tl.int16).to(tl.bfloat16, bitcast=True)
                    x3 = (xq >> 48).to(tl.int16).to(tl.bfloat16, bitcast=True)
                if ASM:
                    acc = tl.dot(q0, x0, acc)
                    acc = tl.dot(q1, x1, acc)
                    acc = tl.dot(q2, x2, acc)
                    acc = tl.dot(q3, x3, acc)
                else:  # float32 operands under the interpreter (exact for bfloat16 values)
                    acc = tl.dot(q0.to(tl.float32), x0.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(q1.to(tl.float32), x1.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(q2.to(tl.float32), x2.to(tl.float32), acc, input_precision="ieee")
                    acc = tl.dot(q3.to(tl.float32), x3.to(tl.float32), acc, input_precision="ieee")
            elif D8 == 1:  # weights as int16 words of 2 codes, x as int32 pairs: even / odd columns, two dots
                kw = k0 // 2 + c2
                kwm = kw < K // 2
                b = gd._ld(w_base + n[:, None].to(tl.int64) * (K // 2) + kw[None, :], nm[:, None] & kwm[None, :], 0,
                           not (EVEN_K and EVEN_N))
                xq = tl.load(x_ptr + rows64[None, :] * (K // 2) + kw[:, None], mask=kwm[:, None] & rm[None, :],
                             other=0)
                sv = tl.sum(tl.where(jsc == (k0 - k_lo) // KS, svf, 0.0), 0)
                qe, qo = _fp8x2_decode(b, ASM)
                xe = xq.to(tl.int16).to(tl.bfloat16, bitcast=True)
                xo = (xq >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
                if ASM:
                    d = tl.dot(qo, xo, tl.dot(qe, xe))
                else:
                    d = tl.dot(qo.to(tl.float32), xo.to(tl.float32),
                               tl.dot(qe.to(tl.float32), xe.to(tl.float32), input_precision="ieee"),
                               input_precision="ieee")
                acc += d * sv
            else:
                b = gd._ld(w_base + n[:, None].to(tl.int64) * K + kk[None, :], wm, 0.0, not (EVEN_K and EVEN_N))
                xv = tl.load(x_ptr + rows64[None, :] * K + kk[:, None], mask=xm, other=0.0)
                sv = tl.sum(tl.where(jsc == (k0 - k_lo) // KS, svf, 0.0), 0)  # this step's scale, from registers
                if ASM and D8 == 2:  # byte pairs in order by FP8P_PTX
                    d = tl.dot(_fp8p_decode(b), xv)
                elif ASM and D8 == 3:  # 4 bytes in order per PTX call (gemm_decode._FP8_PTX)
                    d = tl.dot(gd._fp8_decode(b, ASM), xv)
                elif ASM:
                    d = tl.dot(b.to(tl.bfloat16), xv)
                else:
                    d = tl.dot(b.to(tl.float32), xv.to(tl.float32), input_precision="ieee")
                acc += d * sv
        o_off = rows64[None, :] * N + n[:, None]
        om = nm[:, None] & rm[None, :]
        if FIXUP:  # split-K: the last program at this tile and pass sums the partials (split_k_fixup)
            split_k_fixup(acc, part_base, part_ptr, out_ptr, ctr_base + r0 // BT, o_off, om, n_split, M, N, BW, BT)
        else:
            tl.store(part_base + o_off, acc.to(part_ptr.dtype.element_ty), mask=om)


def eligible(x: torch.Tensor, fmt: str, w_scale: torch.Tensor | None, rows: int, n: int) -> bool:
    """Whether this kernel serves the call: bfloat16 activations, fp4 (E8M0 scales) or fp8_block weights,
    1..MAX_ROWS rows, an even K (fp4: a multiple of 32)."""
    return gd.eligible(x, fmt, w_scale, rows) and rows <= MAX_ROWS


def _launch(x, w, w_scale, fmt, ids, n_exp, n_slots, act, grouped, ep=0):
    m, k = x.shape
    n = w.shape[-2]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or m == 0:
        return out
    cfg = _config(fmt, m / n_slots if grouped else m, grouped)
    bw, bt, bk = cfg["bw"], cfg["bt"], cfg["bk"]
    if fmt == "fp8_block" and 128 % bw:
        raise ValueError(f"fp8_block weight tiles must divide the 128-row scale block, got bw={bw}")
    ks = bk // 4 if fmt == "fp4" else bk
    k_end = k // 4 if fmt == "fp4" else k
    k_steps = triton.cdiv(k_end, ks)
    n_tiles = triton.cdiv(n, bw)
    slots = n_slots + 1 if grouped else triton.cdiv(m, bt)
    split = _splits(n_tiles * (n_slots if grouped else slots), k_steps, x.device, cfg["ctas"])
    k_split = triton.cdiv(k_steps, split) * ks
    split = triton.cdiv(k_end, k_split)
    xc = x.contiguous()
    if xc.data_ptr() % 8:
        xc = xc.clone()
    xsplit = fmt == "fp4" and cfg["xsplit"] == 1
    xk = xc.view(m, k // 4, 4).permute(2, 0, 1).contiguous() if xsplit else xc
    wc = w.contiguous()
    d8 = fmt == "fp8_block" and cfg["d8"] == 1
    if fmt == "fp4" or d8:
        wc = wc.view(torch.int16)
    if d8:
        xk = xk.view(torch.int32)
    if fmt == "fp4" or w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype):
        s, e8 = w_scale.contiguous().view(torch.uint8), True
    else:
        s, e8 = w_scale.float().contiguous(), False
    dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    max_pass = triton.cdiv(m, bt)
    ctr = _counters(x.device) if split > 1 and cfg["fixup"] and n_tiles * slots * max_pass <= CTR_SIZE else None
    fixup = ctr is not None
    ctr = xc if ctr is None else ctr
    mul1 = fmt == "fp4" and gd.small_scales(w_scale)
    _tc_kernel[(n_tiles, slots, split)](
        xk, wc, s, out, dst, ctr, ids if grouped else xc, act if grouped else xc, m, n, k, n_exp,
        wc.stride(0) if grouped else 0, s.stride(0) if grouped else 0, k // 32, k_split, n_slots, split, max_pass,
        FMT=2 if fmt == "fp4" else 1, SCALE_E8M0=e8, GROUPED=grouped, ASM=not INTERPRET, MUL1=mul1,
        EVEN_K=k_end % ks == 0, EVEN_N=n % bw == 0, EP=ep, MP=triton.next_power_of_2(m) if grouped else 1,
        FIXUP=fixup, XSPLIT=cfg["xsplit"] if fmt == "fp4" else 0,
        NSC=triton.next_power_of_2(k_split // ks) if fmt == "fp8_block" else 1,
        D8=cfg["d8"] if fmt == "fp8_block" else 0,
        BW=bw, BT=bt, BK=bk, num_warps=cfg["warps"], num_stages=cfg["stages"],
        **({"maxnreg": cfg["regs"]} if cfg["regs"] and not INTERPRET else {}), **pdl())
    if split > 1 and not fixup:
        total = m * n
        gd._sum_splits_kernel[(triton.cdiv(total, 1024),)](dst, out, total, split, BLOCK=1024, num_warps=4, **pdl())
    return out


CTR_SIZE = 1 << 16  # split-K arrival counters per set (int32, zero between launches)
CTR_SETS = 4  # counter sets per device: one per stream that launches these kernels (main, side, graph capture)
_CTRS: dict = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The current stream's zeroed arrival counters on ``device`` ([CTR_SIZE] int32; every launch leaves them
    zero), or None: then the caller takes its path without counters (a separate fix-up launch, or no split).

    One set per stream: two launches running at once on two streams (the model's side-stream overlap,
    ``ascend_dsv4/layers/overlap.py``) must not count arrivals in the same slots, or a tile's last arrival is
    misjudged and a counter left non-zero for every later launch. The sets are allocated together, once, outside
    CUDA-graph capture (None while capturing before they exist); a stream takes the next free set when it first
    asks -- also during capture, which allocates nothing -- and keeps it; past CTR_SETS streams, None. A captured
    graph keeps the sets of the streams it was captured on: two replays running at once would share them (the
    model runner replays one graph at a time)."""
    key = str(device)
    if key not in _CTRS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _CTRS[key] = (torch.zeros(CTR_SETS, CTR_SIZE, dtype=torch.int32, device=device), {})
    sets, owners = _CTRS[key]
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    i = owners.get(stream)
    if i is None:
        if len(owners) >= CTR_SETS:
            return None
        i = owners[stream] = len(owners)
    return sets[i]


def _splits(programs: int, k_steps: int, device: torch.device, per_sm: int) -> int:
    """K splits so that about ``per_sm`` programs per SM are started, each with at least 4 K steps."""
    want = triton.cdiv(per_sm * sm_count(device), max(programs, 1))
    return max(1, min(want, k_steps // 4))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor,
                   fmt: str) -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T for bfloat16 x [M <= MAX_ROWS, K] over fp4 / fp8_block experts w
    [E, N, K] (fp4: [E, N, K/2]); returns bfloat16 [M, N]. Rows with an id outside [0, E) come out as zeros."""
    m = x.shape[0]
    n_exp = w.shape[0]
    n_slots = max(1, min(n_exp, m))
    ids = expert_ids.contiguous()
    mp = triton.next_power_of_2(max(m, 1))
    ep = triton.next_power_of_2(n_exp)
    if mp * ep <= gd.FUSED_ACTIVE:  # each program lists the active experts itself
        return _launch(x, w, w_scale, fmt, ids, n_exp, n_slots, ids, True, ep)
    act = torch.empty(n_slots + 1, dtype=torch.int32, device=x.device)
    gd._active_experts_kernel[(1,)](ids, act, m, n_exp, n_slots, MP=mp, EB=max(1, min(32, 8192 // mp)),
                                    num_warps=8, **pdl())
    return _launch(x, w, w_scale, fmt, ids, n_exp, n_slots, act, True, 0)


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """y = x @ W^T for bfloat16 x [M <= MAX_ROWS, K] over an fp4 / fp8_block weight [N, K] (fp4: [N, K/2])."""
    return _launch(x, w, w_scale, fmt, None, 1, 1, None, False, 0)
