"""Swap-AB tensor-core GEMM over FP8-block / FP4 weights for many rows: grouped expert matmuls of any row count
(rows sorted by expert into tiles) and linears of tens of rows ("tcl" path of gemm.py).

out[m, :] = x[m, :] @ W[e(m)]^T, x bfloat16 [M, K], W [E, N, K] stored as

- ``fp8_block``: float8_e4m3fn [E, N, K], scales [E, ceil(N/128), ceil(K/128)] float32 or E8M0:
  W[n, k] = e4m3 * s[n // 128, k // 128];
- ``fp4``: int8 [E, N, K/2], element 2c in the low nibble of byte c, E8M0 scales uint8 [E, N, K/32]:
  W[n, k] = e2m1(code) * 2^(s[n, k // 32] - 127).

The product is computed transposed, as in :mod:`.gemm_tc` (out^T[n, rows] = W[n, :] . x[rows, :]^T): a tile of BW
weight rows is the wgmma's M side, decoded in the A-operand registers, and a tile of BT rows of x the N side (shared
memory). Unlike :mod:`.gemm_tc` (which gathers each expert's rows inside every program, up to 1024 rows a call),
the rows are first sorted by expert (:func:`sort_rows`: three small kernels, no host synchronisation) and cut into
tiles of at most BT rows that never cross an expert; program (t, j, s) computes row tile t against weight tile j over
K split s. Row tiles vary fastest in the grid, so the tiles of one expert read a weight tile at about the same time
(the second read comes from L2).

Per K step of BK elements the weight tile is decoded exactly to bfloat16 in registers:

- fp4: :func:`.gemm_tc._fp4x4_decode` (int16 words of 4 codes, scale folded in; 4 MMAs per step against the 4
  column phases x[:, 4h + i] of x, split in registers from int64 loads, or by a copy before the kernel: ``xsplit``);
- fp8: by default (``words=2``, since session 21) the bytes as the 16-bit pairs Triton's A-operand layout gives each
  thread (weight columns 2c, 2c + 1), decoded in column order by :data:`FP8SP_PTX` (gemm_tc's pair decoder with the
  scale folded in), so x needs no column split; or int32 words of 4 e4m3 bytes decoded into the same 4 column
  phases as fp4 by one PTX sequence per pair of words (``words=1``); or bytes, 4 per PTX call (``words=0``). On an
  H200 (scripts/bench_results/h200_session21.txt) the pairs took grouped prefill calls (3072 rows, 64 experts) from
  0.354 / 0.337 / 0.671 ms (w1 / w2 / w13, words=1) to 0.281 / 0.294 / 0.558 ms and 64- / 512-row linears over
  4096 x 4096 from 19.2 / 71.7 to 15.4 / 62.4 us. E8M0 block scales
  whose bytes lie in [10, 134] (checked once per scale tensor; ``fold``) are folded into the decode: the e4m3 bits
  placed in a bfloat16 (e4m3 * 2^-120) times 2^(s - 7) = 2^120 * 2^(s - 127), exact, so the MMAs accumulate into one
  register tile across K steps; otherwise (float32 scales, or ``fold=0``) each step's product is multiplied by its
  block scale in float32 (as :mod:`.gemm_tc`). The scale is one scalar per step, loaded one step ahead (``spf=1``;
  Triton then stages the decoded tile in shared memory for the MMA) or as a vector in its step (``spf=0``: the tile
  stays in registers); the two measured the same.

Products are exact (bfloat16 x bfloat16) and accumulation float32: the result differs from the reference op only
in the order of the float32 sums. A row's result does not depend on which tile or position it lands in (columns of
an MMA are independent), so the order of rows inside an expert's tiles (atomic, unordered) does not change any
output bit. Split-K partial sums are added in split order (by the last program to arrive at a tile, or by a second
kernel: ``fixup``). Rows whose id lies outside [0, E) are written as zeros (outside the op's contract; defined
rather than left unwritten), as in :mod:`.gemm_tc`.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from . import gemm_decode as gd
from . import gemm_tc as tc
from ._util import INTERPRET, env_overrides, sm_count, pdl_wait, pdl

# e4m3 bytes with their E8M0 block scale folded in, 4 at a time: $2 = bytes b0..b3, $3 / $4 = the scales of
# (b0, b1) / (b2, b3) as bfloat16 2^(s - 7); the bit placement of gemm_decode's FP8 decoder (e4m3 * 2^-120), whose
# rebias multiply by 2^120 becomes one by 2^120 * 2^(s - 127)
_FP8S_PTX = tl.constexpr(gd.FP8_PTX.replace("mov.b32 k, 0x7B807B80;\n", "")
                         .replace("$0, a0, k, z", "$0, a0, $3, z").replace("$1, a1, k, z", "$1, a1, $4, z")
                         .replace(".reg .b32 t0, t1, a0, a1, s0, s1, k, z;", ".reg .b32 t0, t1, a0, a1, s0, s1, z;"))
FP8S_PTX = _FP8S_PTX.value  # for the PTX emulation test (tests/ops/test_gemm_tc_large.py)
# the same two bytes at a time in order (gemm_tc's pair decoder, words=2): $1 = the pair, $2 = their scales
_FP8SP_PTX = tl.constexpr(tc.FP8P_PTX.replace("mov.b32 k, 0x7B807B80;\n", "").replace("$0, $0, k, z", "$0, $0, $2, z")
                          .replace(".reg .b32 t, a, g, k, z;", ".reg .b32 t, a, g, z;"))
FP8SP_PTX = _FP8SP_PTX.value

# e4m3 words (4 bytes = weight columns 4h .. 4h+3), two words at a time: $4 / $5 = words w0 / w1, $6 = their
# scale pair (bfloat16 2^(s - 7), or 2^120 = 0x7B80 with the scale applied later); output $i = byte i of (w0, w1)
# as bfloat16 (= phase i of the K columns). prmt makes t = [b, b, c, c] (b, c = byte i of w0, w1: each lane holds its
# byte twice); t >> 4 puts the 7 magnitude bits at 4-10 of each lane (kept by the mask 0x07F0), t & 0x8000 keeps the
# sign bit at 15; one lop3 ((a & mask) | sign) merges them: bfloat16 bits = e4m3 * 2^-120 (subnormals included),
# times the scale pair.
_FP8X4_PTX = tl.constexpr("{\n.reg .b32 t, a, s, z;\nmov.b32 z, 0x80008000;\n" + "".join(
    f"prmt.b32 t, $4, $5, 0x{4 + i}{4 + i}{i}{i};\nshr.u32 a, t, 4;\nand.b32 s, t, 0x80008000;\n"
    f"lop3.b32 a, a, s, 0x07F007F0, 0xEC;\nfma.rn.bf16x2 ${i}, a, $6, z;\n" for i in range(4)) + "}")
FP8X4_PTX = _FP8X4_PTX.value
FOLD_LO, FOLD_HI = 10, 134  # E8M0 bytes whose scale folds exactly: 2^(s - 7) <= 2^127, products normal (>= 2^-126)


@triton.jit
def _fp8x4_decode(b, s16, ASM: tl.constexpr):
    """b int32 [...] words of 4 e4m3 bytes, s16 bfloat16 [...] their scale (2^(s - 7): e4m3 * 2^(s - 127); 2^120:
    e4m3) -> bfloat16 (q0, q1, q2, q3): byte i of each word, scaled (exact)."""
    if ASM:
        q0, q1, q2, q3 = tl.inline_asm_elementwise(_FP8X4_PTX, "=r,=r,=r,=r,r,r,r", [b, s16],
                                                   dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    else:
        sf = s16.to(tl.float32) * 7.52316384526264e-37  # 2^-120
        q0 = (_e4m3(b & 0xFF) * sf).to(tl.bfloat16)
        q1 = (_e4m3((b >> 8) & 0xFF) * sf).to(tl.bfloat16)
        q2 = (_e4m3((b >> 16) & 0xFF) * sf).to(tl.bfloat16)
        q3 = (_e4m3((b >> 24) & 0xFF) * sf).to(tl.bfloat16)
    return q0, q1, q2, q3


@triton.jit
def _e4m3(v):
    """float32 value of e4m3 bytes v (int32 0..255; the NaN codes are not decoded)."""
    e = (v >> 3) & 15
    m = v & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True))
    return tl.where((v & 0x80) != 0, -mag, mag)


@triton.jit
def _fp8s_decode(b, s16, ASM: tl.constexpr, PAIRS: tl.constexpr = False):
    """b float8_e4m3fn [...], s16 bfloat16 [...] = 2^(s - 7) -> bfloat16 e4m3 * 2^(s - 127) (exact); 4 bytes per
    PTX call, or 2 (PAIRS: the pairs a thread holds in the wgmma A-operand layout, no byte packing)."""
    if ASM and PAIRS:
        w = tl.inline_asm_elementwise(_FP8SP_PTX, "=r,h,r", [b.to(tl.int8, bitcast=True), s16], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
    elif ASM:
        w = tl.inline_asm_elementwise(_FP8S_PTX, "=r,=r,r,r,r", [b.to(tl.int8, bitcast=True), s16],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        w = (b.to(tl.float32) * s16.to(tl.float32) * 7.52316384526264e-37).to(tl.bfloat16)  # 2^-120
    return w


@triton.jit
def _hist_kernel(ids_ptr, cnt_ptr, M, E, RB: tl.constexpr, PDL: tl.constexpr = False):
    """cnt[b] += rows of bucket b (b = id for ids in [0, E), else E) over this program's RB rows."""
    pdl_wait(PDL)
    m = tl.program_id(0) * RB + tl.arange(0, RB)
    mm = m < M
    ids = tl.load(ids_ptr + m, mask=mm, other=0).to(tl.int32)
    b = tl.where((ids >= 0) & (ids < E), ids, E)
    tl.atomic_add(cnt_ptr + b, 1, mask=mm)


@triton.jit
def _scatter_kernel(ids_ptr, cnt_ptr, order_ptr, tile_ptr, M, E, n_tiles, BT: tl.constexpr, EP: tl.constexpr,
                    RB: tl.constexpr, TB: tl.constexpr, PDL: tl.constexpr = False):
    """order[row_start[b] + slot] = m (slot: an atomic cursor per bucket, cnt[EP + b]); program 0 also writes the
    tile table [3, n_tiles] (bucket, first sorted row, end row; unused tiles r0 = r1 = 0)."""
    pdl_wait(PDL)
    ev = tl.arange(0, EP)
    cnt = tl.load(cnt_ptr + ev, mask=ev <= E, other=0)
    row_start = tl.cumsum(cnt, 0) - cnt
    m = tl.program_id(0) * RB + tl.arange(0, RB)
    mm = m < M
    ids = tl.load(ids_ptr + m, mask=mm, other=0).to(tl.int32)
    b = tl.where((ids >= 0) & (ids < E), ids, E)
    start = tl.sum(tl.where(b[:, None] == ev[None, :], row_start[None, :], 0), 1)
    slot = tl.atomic_add(cnt_ptr + EP + b, 1, mask=mm)
    tl.store(order_ptr + start + slot, m, mask=mm)
    if tl.program_id(0) == 0:
        nt = (cnt + BT - 1) // BT
        tile_start = tl.cumsum(nt, 0) - nt
        total = tl.sum(nt, 0)
        for j in range(0, tl.max(nt, 0)):
            ok = j < nt
            t = tile_start + j
            r0 = row_start + j * BT
            tl.store(tile_ptr + t, ev, mask=ok)
            tl.store(tile_ptr + n_tiles + t, r0, mask=ok)
            tl.store(tile_ptr + 2 * n_tiles + t, tl.minimum(row_start + cnt, r0 + BT), mask=ok)
        for t0 in range(0, n_tiles, TB):
            t = t0 + tl.arange(0, TB)
            tm = (t >= total) & (t < n_tiles)
            tl.store(tile_ptr + t, E, mask=tm)
            tl.store(tile_ptr + n_tiles + t, 0, mask=tm)
            tl.store(tile_ptr + 2 * n_tiles + t, 0, mask=tm)


def sort_rows(expert_ids: torch.Tensor, n_exp: int, bt: int):
    """Rows grouped by expert on the device: (order int32 [M]: row indices, each expert's rows together, experts
    increasing, rows with an id outside [0, E) last; tiles int32 [3, T]: bucket (E = outside), first and end
    position in ``order`` of each tile of <= bt rows, T = ceil(M / bt) + min(E + 1, M) (unused: r0 = r1))."""
    m = expert_ids.shape[0]
    dev = expert_ids.device
    ep = triton.next_power_of_2(n_exp + 1)
    n_tiles = triton.cdiv(m, bt) + min(n_exp + 1, m)
    cnt = torch.zeros(2 * ep, dtype=torch.int32, device=dev)
    order = torch.empty(m, dtype=torch.int32, device=dev)
    tiles = torch.empty(3, n_tiles, dtype=torch.int32, device=dev)
    ids = expert_ids.contiguous()
    rb = max(16, min(256, 8192 // ep))
    _hist_kernel[(triton.cdiv(m, 256),)](ids, cnt, m, n_exp, RB=256, num_warps=4, **pdl())
    _scatter_kernel[(triton.cdiv(m, rb),)](ids, cnt, order, tiles, m, n_exp, n_tiles, BT=bt, EP=ep, RB=rb, TB=256,
                                           num_warps=4, **pdl())
    return order, tiles


@triton.jit
def _dot4(q0, q1, q2, q3, x0, x1, x2, x3, acc, ASM: tl.constexpr):
    """acc + q0 @ x0 + q1 @ x1 + q2 @ x2 + q3 @ x3 (float32 operands under the interpreter: exact for bfloat16)."""
    if ASM:
        acc = tl.dot(q0, x0, acc)
        acc = tl.dot(q1, x1, acc)
        acc = tl.dot(q2, x2, acc)
        acc = tl.dot(q3, x3, acc)
    else:
        acc = tl.dot(q0.to(tl.float32), x0.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(q1.to(tl.float32), x1.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(q2.to(tl.float32), x2.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(q3.to(tl.float32), x3.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _x_phases(x_ptr, rows64, kk, xm, M, k_end, XSPLIT: tl.constexpr):
    """x[rows, 4h + i]^T for the quads h = kk, i = 0..3: bfloat16 [KS, BT] each; from x pre-split into its 4 column
    phases [4, M, K/4] (XSPLIT), or from int64 loads of 4 columns split in registers."""
    if XSPLIT:
        xp = x_ptr + rows64[None, :] * k_end + kk[:, None]
        x0 = tl.load(xp, mask=xm, other=0.0)
        x1 = tl.load(xp + M * k_end, mask=xm, other=0.0)
        x2 = tl.load(xp + 2 * M * k_end, mask=xm, other=0.0)
        x3 = tl.load(xp + 3 * M * k_end, mask=xm, other=0.0)
    else:
        xq = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + rows64[None, :] * k_end + kk[:, None], mask=xm, other=0)
        x0 = xq.to(tl.int16).to(tl.bfloat16, bitcast=True)
        x1 = (xq >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        x2 = (xq >> 32).to(tl.int16).to(tl.bfloat16, bitcast=True)
        x3 = (xq >> 48).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x0, x1, x2, x3


@triton.jit
def _tcl_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, order_ptr, tile_ptr,
                M, N, K, E, stride_we, stride_se, k_split, n_split, n_tiles,
                FMT: tl.constexpr, SCALE_E8M0: tl.constexpr, GROUPED: tl.constexpr, ASM: tl.constexpr,
                MUL1: tl.constexpr, FOLD: tl.constexpr, WORDS: tl.constexpr, PAIRS: tl.constexpr, SPF: tl.constexpr,
                EVEN_K: tl.constexpr,
                EVEN_N: tl.constexpr, FIXUP: tl.constexpr, XSPLIT: tl.constexpr,
                BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if GROUPED:
        e = tl.load(tile_ptr + pid_t)
        r0 = tl.load(tile_ptr + n_tiles + pid_t)
        r1 = tl.load(tile_ptr + 2 * n_tiles + pid_t)
        rr = r0 + tl.arange(0, BT)
        rm = rr < r1
        rows = tl.load(order_ptr + rr, mask=rm, other=0)
        live = (e < E) & (r0 < r1)  # bucket E: ids outside [0, E), written as zeros
        e = tl.minimum(e, E - 1).to(tl.int64)
    else:
        rr = pid_t * BT + tl.arange(0, BT)
        rm = rr < M
        rows = tl.minimum(rr, M - 1)
        live = pid_t >= 0
        e = 0
    rows64 = rows.to(tl.int64)
    n = pid_n * BW + tl.arange(0, BW)
    nm = n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    if FMT == 2 or WORDS:
        k_end = K // 4  # words of 4 weight columns per row (fp4: int16, fp8: int32) = activation quads per row
        KS: tl.constexpr = BK // 4
    else:
        k_end = K
        KS: tl.constexpr = BK
    k_lo = split * k_split
    k_hi = tl.where(live, tl.minimum(k_lo + k_split, k_end), k_lo)
    c = tl.arange(0, KS)
    acc = tl.zeros((BW, BT), tl.float32)
    if FMT == 2:
        g = tl.arange(0, BK // 32)
        s_ptrs = s_base + n[:, None].to(tl.int64) * (K // 32) + k_lo // 8 + g[None, :]
        sc_next = tl.load(s_ptrs, mask=nm[:, None] & ((k_lo // 8 + g) * 8 < k_hi)[None, :], other=127)
    else:
        # one scale per 128 x 128 block: a scalar per K step (BW divides 128, BK divides 128), loaded one step ahead (a
        # load in the step that uses it would stall every step on its latency)
        SB: tl.constexpr = 32 if WORDS else 128  # K units (words / bytes) per scale block
        s_row = s_base + (pid_n * BW // 128) * tl.cdiv(K, 128)
        sc_next = tl.load(s_row + k_lo // SB, mask=k_lo < k_hi, other=0)
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
            b = gd._ld(w_base + n[:, None].to(tl.int64) * k_end + kk[None, :], wm, 0, not (EVEN_K and EVEN_N))
            s16 = tl.reshape(tl.broadcast_to(gd._scale_bf16(sc, MUL1)[:, :, None], (BW, BK // 32, 8)), (BW, KS))
            q0, q1, q2, q3 = tc._fp4x4_decode(b, s16, ASM, MUL1)
            x0, x1, x2, x3 = _x_phases(x_ptr, rows64, kk, xm, M, k_end, XSPLIT)
            acc = _dot4(q0, q1, q2, q3, x0, x1, x2, x3, acc, ASM)
        else:
            if SPF:
                sc = sc_next
                sc_next = tl.load(s_row + (k0 + KS) // SB, mask=k0 + KS < k_hi, other=0)
            else:  # a [BW] vector of the same scale loaded in this step: Triton keeps the decode in the wgmma
                # A-operand registers (with the prefetched scalar it stages the decoded tile in shared memory)
                sc = tl.load(s_row + k0 // SB + n * 0, mask=nm, other=0)[:, None]
            if SCALE_E8M0:
                sv = gd._e8m0_f32(sc)
            else:
                sv = sc.to(tl.float32)
            if FOLD:  # 2^(s - 7): the rebias 2^120 times the block scale (exact; see foldable)
                s_bits = ((sc.to(tl.int32) & 0xFF) + 120) << 7
            else:
                s_bits = sc.to(tl.int32) * 0 + 0x7B80
            s16 = (tl.zeros((BW, KS), tl.int32) + s_bits).to(tl.int16).to(tl.bfloat16, bitcast=True)
            if WORDS:  # int32 words of 4 e4m3 bytes: 4 MMAs per step against the 4 column phases of x
                b = gd._ld(w_base + n[:, None].to(tl.int64) * k_end + kk[None, :], wm, 0, not (EVEN_K and EVEN_N))
                q0, q1, q2, q3 = _fp8x4_decode(b, s16, ASM)
                x0, x1, x2, x3 = _x_phases(x_ptr, rows64, kk, xm, M, k_end, XSPLIT)
                if FOLD:
                    acc = _dot4(q0, q1, q2, q3, x0, x1, x2, x3, acc, ASM)
                else:
                    d = _dot4(q0, q1, q2, q3, x0, x1, x2, x3, tl.zeros((BW, BT), tl.float32), ASM)
                    acc += d * sv
            else:
                b = gd._ld(w_base + n[:, None].to(tl.int64) * K + kk[None, :], wm, 0.0, not (EVEN_K and EVEN_N))
                xv = tl.load(x_ptr + rows64[None, :] * K + kk[:, None], mask=xm, other=0.0)
                if FOLD:
                    wq = _fp8s_decode(b, s16, ASM, PAIRS)
                    if ASM:
                        acc = tl.dot(wq, xv, acc)
                    else:
                        acc = tl.dot(wq.to(tl.float32), xv.to(tl.float32), acc, input_precision="ieee")
                else:
                    if ASM and PAIRS:
                        d = tl.dot(tc._fp8p_decode(b), xv)
                    elif ASM:
                        d = tl.dot(b.to(tl.bfloat16), xv)
                    else:
                        d = tl.dot(b.to(tl.float32), xv.to(tl.float32), input_precision="ieee")
                    acc += d * sv
    o_off = rows64[None, :] * N + n[:, None]
    om = nm[:, None] & rm[None, :]
    if FIXUP:  # split-K: the last program at this tile sums the partials in split order (tc.split_k_fixup)
        tc.split_k_fixup(acc, part_ptr + split.to(tl.int64) * M * N, part_ptr, out_ptr,
                         ctr_ptr + pid_n * tl.num_programs(0) + pid_t, o_off, om, n_split, M, N, BW, BT)
    else:
        tl.store(part_ptr + split.to(tl.int64) * M * N + o_off, acc.to(part_ptr.dtype.element_ty), mask=om)


def _config(fmt: str, rows_per_weight: float, grouped: bool) -> dict:
    """Tiles and launch settings: BW weight rows per program (wgmma M: 64 per warpgroup), BT rows per tile (the
    MMA's N), BK elements per K step, warps, pipeline stages, programs per SM aimed at by split-K (ctas; split=N
    forces N splits), register cap (regs, 0: none), split-K sums by the last program (fixup=1) or a second kernel,
    activations pre-split into 4 column phases for fp4 and fp8 words (xsplit=1), fp8 read as byte pairs decoded in
    order (words=2, the default since session 21: see the module docstring), as int32 words of 4 bytes (words=1)
    or as bytes, 4 per PTX call (words=0), fp8 E8M0 scales folded into the decoded weight where exact (fold=1), fp8
    block scale loaded one step ahead as a scalar (spf=1) or in its step as a vector (spf=0).
    ATB_CUDA_TCL_CFG="bw=128,warps=8" overrides (benchmarks).

    Defaults from the variants timed on the H100 (scripts/bench_results/gemm_h100_session4.txt, T = 512 x 6 experts
    and 1..64-row linears): 128 weight rows per program on 8 warps (64 rows on 4 warps: 6-31 % slower grouped), 64
    rows per tile at ~48 rows per expert (128: 35-46 % slower); fp4 activations split in registers (the pre-split
    copy: 17-23 % slower), 2 stages for grouped fp4 (w1 16 % faster than 3, w2 1 % slower); fp8 grouped as int32 words
    with x pre-split (bytes: w1 5 % faster, w2 8 % slower; the scale prefetch and the fold: no measurable change;
    session 21's byte pairs are faster than both);
    linears aim at one program per SM (2: 26-28 % slower at 64 rows)."""
    bt = 16 if rows_per_weight <= 16 else (32 if rows_per_weight <= 32 else 64)
    cfg = dict(bw=128, bt=bt, bk=128, warps=8, stages=3, ctas=1, split=0, regs=0, fixup=1, xsplit=1, fold=1, words=2,
               spf=1)
    if not grouped or fmt == "fp4":
        cfg.update(xsplit=0)
    if grouped and fmt == "fp4":
        cfg.update(stages=2)
    env_overrides("ATB_CUDA_TCL_CFG", cfg, dict(fixup=(0, 1), xsplit=(0, 1), fold=(0, 1), words=(0, 1, 2), spf=(0, 1)))
    return cfg


_FOLD_OK: dict = {}


def foldable(w_scale: torch.Tensor) -> bool:
    """Whether every E8M0 byte of an fp8 scale tensor lies in [FOLD_LO, FOLD_HI] (the scale folds exactly into the
    decoded bfloat16 weight). Read once per tensor and in-place version (one host synchronisation), then cached;
    False under CUDA-graph capture until known (the float32 scale path is exact too)."""
    key = id(w_scale)
    hit = _FOLD_OK.get(key)
    if hit is not None and hit[0]() is w_scale and hit[1] == w_scale._version:
        return hit[2]
    if w_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    b = w_scale.view(torch.uint8)
    ok = b.numel() == 0 or (int(b.min()) >= FOLD_LO and int(b.max()) <= FOLD_HI)
    _FOLD_OK[key] = (weakref.ref(w_scale, lambda _, k=key: _FOLD_OK.pop(k, None)), w_scale._version, ok)
    return ok


def eligible(x: torch.Tensor, fmt: str, w_scale: torch.Tensor | None) -> bool:
    """bfloat16 activations, fp4 (E8M0 scales) or fp8_block weights, an even K; any number of rows."""
    return gd.eligible(x, fmt, w_scale, 1)


def _launch(x, w, w_scale, fmt, order, tiles, grouped):
    m, k = x.shape
    n = w.shape[-2]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or m == 0:
        return out
    n_exp = w.shape[0] if grouped else 1
    cfg = _config(fmt, m / max(1, min(n_exp, m)) if grouped else m, grouped)
    bw, bt, bk = cfg["bw"], cfg["bt"], cfg["bk"]
    if fmt == "fp8_block" and (128 % bk or 128 % bw):
        raise ValueError(f"fp8_block tiles must divide the 128 x 128 scale block, got bw={bw}, bk={bk}")
    words = fmt == "fp4" or (cfg["words"] == 1 and k % 4 == 0)
    ks = bk // 4 if words else bk
    k_end = k // 4 if words else k
    k_steps = triton.cdiv(k_end, ks)
    n_wt = triton.cdiv(n, bw)
    n_rt = tiles.shape[1] if grouped else triton.cdiv(m, bt)
    split = cfg["split"] or max(1, min((cfg["ctas"] * sm_count(x.device)) // max(1, n_wt * n_rt), k_steps // 4))
    k_split = triton.cdiv(k_steps, split) * ks
    split = triton.cdiv(k_end, k_split)
    xc = x.contiguous()
    if xc.data_ptr() % 8:
        xc = xc.clone()
    xsplit = words and bool(cfg["xsplit"])
    xk = xc.view(m, k // 4, 4).permute(2, 0, 1).contiguous() if xsplit else xc
    wc = w.contiguous()
    if fmt == "fp4":
        wc = wc.view(torch.int16)
    elif words:
        wc = wc.view(torch.int32)
    e8 = fmt == "fp4" or w_scale.dtype == torch.uint8 or "e8m0" in str(w_scale.dtype)
    s = w_scale.contiguous().view(torch.uint8) if e8 else w_scale.float().contiguous()
    dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    ctr = None
    if split > 1 and cfg["fixup"] and n_wt * n_rt <= tc.CTR_SIZE:
        ctr = tc._counters(x.device)
    fixup = ctr is not None
    fold = fmt == "fp8_block" and e8 and bool(cfg["fold"]) and foldable(s)
    mul1 = fmt == "fp4" and gd.small_scales(w_scale)
    _tcl_kernel[(n_rt, n_wt, split)](
        xk, wc, s, out, dst, xc if ctr is None else ctr, order if grouped else xc, tiles if grouped else xc,
        m, n, k, n_exp, wc.stride(0) if grouped else 0, s.stride(0) if grouped else 0, k_split, split, n_rt,
        FMT=2 if fmt == "fp4" else 1, SCALE_E8M0=e8, GROUPED=grouped, ASM=not INTERPRET, MUL1=mul1, FOLD=fold,
        WORDS=words and fmt == "fp8_block", PAIRS=fmt == "fp8_block" and cfg["words"] == 2, SPF=bool(cfg["spf"]),
        EVEN_K=k_end % ks == 0, EVEN_N=n % bw == 0,
        FIXUP=fixup, XSPLIT=xsplit, BW=bw, BT=bt, BK=bk,
        num_warps=cfg["warps"], num_stages=cfg["stages"],
        **({"maxnreg": cfg["regs"]} if cfg["regs"] and not INTERPRET else {}), **pdl())
    if split > 1 and not fixup:
        total = m * n
        gd._sum_splits_kernel[(triton.cdiv(total, 1024),)](dst, out, total, split, BLOCK=1024, num_warps=4, **pdl())
    return out


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor,
                   fmt: str) -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T for bfloat16 x [M, K] over fp4 / fp8_block experts w [E, N, K] (fp4:
    [E, N, K/2]); returns bfloat16 [M, N]. Rows with an id outside [0, E) come out as zeros."""
    m = x.shape[0]
    n_exp = w.shape[0]
    if m == 0:
        return torch.empty(0, w.shape[1], dtype=x.dtype, device=x.device)
    cfg = _config(fmt, m / max(1, min(n_exp, m)), True)
    order, tiles = sort_rows(expert_ids, n_exp, cfg["bt"])
    return _launch(x, w, w_scale, fmt, order, tiles, True)


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """y = x @ W^T for bfloat16 x [M, K] over an fp4 / fp8_block weight [N, K] (fp4: [N, K/2])."""
    return _launch(x, w, w_scale, fmt, None, None, False)
