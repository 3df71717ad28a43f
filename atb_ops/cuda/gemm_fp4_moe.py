"""MoE decode: grouped expert matmul over FP4 experts, swap-AB on the Hopper tensor cores (few rows per expert).

out[m, :] = x[m, :] @ W[e(m)]^T for bfloat16 x [M, K] over DeepSeek-V4's FP4 experts: W int8 [E, N, K/2] (element
2c in the low nibble of byte c, an e2m1 code: sign, 2 exponent bits, 1 mantissa bit) with E8M0 scales uint8
[E, N, K/32]: W[n, k] = e2m1(code) * 2^(s[n, k // 32] - 127), exactly as ``quant.fp4.dequant_fp4``.

The kernel is :mod:`.gemm_tc`'s fp4 grouped path (weight rows as the wgmma M side, the few tokens of an expert as
its N side; int16 words of 4 codes copied to shared memory by cp.async and decoded in the A-operand registers by
:data:`.gemm_tc.FP4X4_PTX`; the activations pre-split into their 4 column phases x[:, 4h + i]; split-K with an
ordered fix-up), restructured into one unit of work (:func:`_unit`: weight tile x expert slot x K range) that two
schedules share, with tunables for what its compiled code and the H100 runs pointed at
(scripts/bench_results/fp4_moe_h100_session4.txt):

- default: one program per (weight tile, expert slot, K split), split-K aiming at ``ctas = 2`` programs per SM
  (gemm_tc: 3, which at one token x 6 experts of 4096 x 2048 splits the 384 tiles in two: 768 programs, 1.45 waves
  of 528; with 2, 384 programs in one wave: 39 -> 46 % of HBM); measured 1.5-2 points of HBM faster than gemm_tc
  on w1 at 8-64 tokens (both runs), equal on w2;
- ``persist=1``: a fixed grid of as many programs as fit at once walks a list of equal units (tile x K chunk, the
  chunks per tile chosen in the kernel from the number of active experts, read on the device) so that no wave runs
  part-empty (8 tokens: ~1100 tiles = 2.1 waves of 528); measured 16-24 % slower at every size, also without K
  chunks (not explained by one measurement; candidates: each unit restarts the copy pipeline, the per-unit
  prologue spills at 128 registers): kept selectable, off;
- ``nacc=4``: one accumulator per column phase (added at the end in a fixed order) keeps the wgmmas asynchronous
  (``wait_group 7``; with one accumulator Triton waits for each wgmma before the next): measured no faster, off.

What bounds it (SASS of the main loop, ``scripts/fp4_moe_sass.py``): ~300 instructions per thread per K step of
4 KB of weights at 128 registers (4 programs of 4 warps per SM): 144 decode (14 integer operations + 4 bf16
multiplies per 8 codes), ~35 to bring each row's 4 scale bytes into the A-operand layout (byte loads, a shared
memory round trip, byte extracts, exponent shifts), ~50 uniform-datapath descriptor and pipeline bookkeeping, 8
wgmma; at 60 % of HBM the SM issues on ~60 % of its cycles, so neither issue slots nor the integer pipe are full.

Products are exact (bfloat16 x bfloat16 into float32), so results differ from the reference op (float32
dequantised weight, float32 matmul) only in summation order. Rows: as in :mod:`.gemm_decode`, program slot j takes
the j-th active expert (increasing id) and gathers its rows from ``expert_ids``; the slot after the last active
expert writes zeros to rows whose id lies outside [0, E).

``ATB_CUDA_FP4_MOE`` = ``mma`` (default: :mod:`.fp4_moe_mma` where it builds and applies, else this kernel) | ``new``
(this kernel) | ``old`` (:mod:`.gemm_tc` / :mod:`.gemm_decode` as before) selects the path in :mod:`.gemm`; ``ATB_CUDA_FP4_MOE_CFG="persist=1,nacc=4,stages=3,regs=128,ctas=3"`` overrides tunables (benchmarks).
Under TRITON_INTERPRET the weights are decoded by plain Triton arithmetic (same values) and the dots run on float32
copies of the operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm_decode as gd
from . import gemm_tc as tc
from ._util import INTERPRET, env_overrides, sm_count, pdl_wait, pdl

MAX_ROWS = 1024  # rows of one call (rows are gathered in-kernel)

@triton.jit
def _mma(q, x, acc, ASM: tl.constexpr):
    if ASM:
        acc = tl.dot(q, x, acc)
    else:  # float32 operands under the interpreter (exact for bfloat16 values)
        acc = tl.dot(q.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _unit(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr, M, N, K, E, stride_we, stride_se,
          n_slots, max_pass, slot, pid_n, split, k_split, n_split,
          ASM: tl.constexpr, MUL1: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EP: tl.constexpr,
          MP: tl.constexpr, NACC: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """One unit of work: weight tile pid_n (BW rows) of expert slot ``slot``, K words [split * k_split, +k_split),
    for all the slot's rows (BT per pass). n_split > 1: float32 partial sums to part[split], added in split order by
    the unit that arrives last at the tile (an arrival counter per tile and pass, reset by that unit)."""
    sel, cnt, pos, e, n_act = gd.expert_slot(ids_ptr, act_ptr, M, E, n_slots, slot, MP, EP)
    m_all = tl.arange(0, MP)
    n = pid_n * BW + tl.arange(0, BW)
    nm = n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    k_end = K // 4  # int16 words (4 codes) per weight row = activation quads per row
    KS: tl.constexpr = BK // 4  # words per K step
    G: tl.constexpr = BK // 32  # scale groups per K step
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k_end)
    k_hi = tl.where(slot >= n_act, k_lo, k_hi)  # rows with an id outside [0, E): zeros
    c = tl.arange(0, KS)
    part_base = part_ptr + split * M * N  # < PART_BYTES / 4 elements: int32 offsets
    ctr_base = ctr_ptr + (pid_n * (n_slots + 1) + slot) * max_pass
    for r0 in range(0, cnt, BT):
        r = r0 + tl.arange(0, BT)
        rm = r < cnt
        hit = (pos[None, :] == r[:, None]) & sel[None, :]
        rows64 = tl.sum(tl.where(hit, m_all[None, :], 0), 1).to(tl.int64)
        acc = tl.zeros((BW, BT), tl.float32)
        if NACC == 4:
            acc1 = tl.zeros((BW, BT), tl.float32)
            acc2 = tl.zeros((BW, BT), tl.float32)
            acc3 = tl.zeros((BW, BT), tl.float32)
        g = tl.arange(0, G)
        s_ptrs = s_base + n[:, None].to(tl.int64) * (K // 32) + k_lo // 8 + g[None, :]
        sc_next = tl.load(s_ptrs, mask=nm[:, None] & ((k_lo // 8 + g) * 8 < k_hi)[None, :], other=127)
        for k0 in range(k_lo, k_hi, KS):
            k0 = tl.multiple_of(k0, KS)
            kk = k0 + c
            km = kk < k_end
            wm = nm[:, None] & km[None, :]
            xm = km[:, None] & rm[None, :]
            sc = sc_next  # this step's scales; the next step's are loaded one step ahead
            s_ptrs += G
            sc_next = tl.load(s_ptrs, mask=nm[:, None] & (((k0 + KS) // 8 + g) * 8 < k_hi)[None, :], other=127)
            b = gd._ld(w_base + n[:, None].to(tl.int64) * k_end + kk[None, :], wm, 0, not (EVEN_K and EVEN_N))
            s16 = tl.reshape(tl.broadcast_to(gd._scale_bf16(sc, MUL1)[:, :, None], (BW, G, 8)), (BW, KS))
            q0, q1, q2, q3 = tc._fp4x4_decode(b, s16, ASM, MUL1)
            xp = x_ptr + rows64[None, :] * k_end + kk[:, None]
            x0 = tl.load(xp, mask=xm, other=0.0)
            x1 = tl.load(xp + M * k_end, mask=xm, other=0.0)
            x2 = tl.load(xp + 2 * M * k_end, mask=xm, other=0.0)
            x3 = tl.load(xp + 3 * M * k_end, mask=xm, other=0.0)
            if NACC == 4:
                acc = _mma(q0, x0, acc, ASM)
                acc1 = _mma(q1, x1, acc1, ASM)
                acc2 = _mma(q2, x2, acc2, ASM)
                acc3 = _mma(q3, x3, acc3, ASM)
            else:
                acc = _mma(q0, x0, acc, ASM)
                acc = _mma(q1, x1, acc, ASM)
                acc = _mma(q2, x2, acc, ASM)
                acc = _mma(q3, x3, acc, ASM)
        if NACC == 4:
            acc = (acc + acc1) + (acc2 + acc3)
        o_off = rows64[None, :] * N + n[:, None]
        om = nm[:, None] & rm[None, :]
        if n_split > 1:
            tc.split_k_fixup(acc, part_base, part_ptr, out_ptr, ctr_base + r0 // BT, o_off, om, n_split, M, N, BW, BT)
        else:
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=om)


@triton.jit
def _moe_fp4_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr,
                    M, N, K, E, stride_we, stride_se, k_split, n_slots, n_split, max_pass, max_chunks, overhead,
                    ASM: tl.constexpr, MUL1: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    EP: tl.constexpr, MP: tl.constexpr, PERSIST: tl.constexpr, NACC: tl.constexpr,
                    BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    """x: [4, M, K/4] (column phases), w: int16 words [E, N, K/4], s: uint8 [E, N, K/32]; out bfloat16 [M, N];
    part float32 [n_split or max_chunks, M, N] (split-K partials).

    PERSIST = 0: one unit per program (grid: weight tiles x expert slots + 1 x n_split K splits of k_split words).
    PERSIST = 1: a fixed grid of P programs (as many as fit on the GPU at once) takes the units u = pid, pid + P, ...
    of a list that every program derives alike from the number of active experts A (read on the device): A x
    n_tiles weight tiles, each cut into `chunks` K ranges (chosen here, <= max_chunks, minimising
    ceil(units / P) * (K steps per unit + overhead)), in (slot, tile, chunk) order, then n_tiles units of the slot
    after the last active expert (rows with ids outside [0, E): zeros). Every unit is the same work whichever
    program runs it, and split sums are added in chunk order: results do not depend on the schedule."""
    pdl_wait(PDL)
    KS: tl.constexpr = BK // 4
    if PERSIST:
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        n_tiles = tl.cdiv(N, BW)
        _, _, _, _, n_act = gd.expert_slot(ids_ptr, act_ptr, M, E, n_slots, 0, MP, EP)
        k_steps = tl.cdiv(K // 4, KS)
        tiles = n_act * n_tiles
        chunks = n_act * 0 + 1  # a tensor from the start: max_chunks == 1 is specialised to a constant (empty loop)
        best = tl.cdiv(tiles + n_tiles, P) * (k_steps + overhead)
        for cc in range(2, max_chunks + 1):
            steps = tl.cdiv(k_steps, cc)
            cost = tl.cdiv(tiles * tl.cdiv(k_steps, steps) + n_tiles, P) * (steps + overhead)
            chunks = tl.where(cost < best, cc, chunks)
            best = tl.minimum(cost, best)
        steps = tl.cdiv(k_steps, chunks)
        chunks = tl.cdiv(k_steps, steps)
        per_slot = n_tiles * chunks
        n_main = tiles * chunks
        for u in range(pid, n_main + n_tiles, P):
            if u < n_main:
                slot = u // per_slot
                pid_n = (u % per_slot) // chunks
                split = u % chunks
                _unit(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr, M, N, K, E, stride_we,
                      stride_se, n_slots, max_pass, slot, pid_n, split, steps * KS, chunks,
                      ASM, MUL1, EVEN_K, EVEN_N, EP, MP, NACC, BW, BT, BK)
            else:
                _unit(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr, M, N, K, E, stride_we,
                      stride_se, n_slots, max_pass, n_act, u - n_main, 0, steps * KS, 1,
                      ASM, MUL1, EVEN_K, EVEN_N, EP, MP, NACC, BW, BT, BK)
    else:
        _unit(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, ctr_ptr, ids_ptr, act_ptr, M, N, K, E, stride_we, stride_se,
              n_slots, max_pass, tl.program_id(1), tl.program_id(0), tl.program_id(2), k_split, n_split,
              ASM, MUL1, EVEN_K, EVEN_N, EP, MP, NACC, BW, BT, BK)


def _config(rows_per_weight: float) -> dict:
    """Tunables: BW weight rows (wgmma M), BT rows per pass (wgmma N), BK codes per K step, warps, pipeline stages,
    register cap (regs; 0 = none), accumulators (nacc: 4, one per column phase, or 1), the schedule (persist=1: a
    fixed grid of pctas programs per SM taking balanced units, up to maxc K chunks per weight tile, ov = per-unit
    overhead in K steps for the choice of chunks; persist=0: one program per tile and K split, split-K aiming at
    ctas programs per SM, as gemm_tc). ATB_CUDA_FP4_MOE_CFG="k=v,..." overrides (benchmarks)."""
    bt = 16 if rows_per_weight <= 16 else (32 if rows_per_weight <= 32 else 64)
    cfg = dict(bw=64, bt=bt, bk=128, warps=4, stages=3, ctas=2, regs=128 if bt == 16 else 0, nacc=1, persist=0,
               pctas=0, maxc=8, ov=2)
    env_overrides("ATB_CUDA_FP4_MOE_CFG", cfg, dict(persist=(0, 1)))
    if not cfg["pctas"]:  # programs that fit on one SM at once (65536 registers, 128 threads each)
        cfg["pctas"] = max(1, min(4, 65536 // (128 * (cfg["regs"] or 255))))
    return cfg


PART_BYTES = 32 << 20  # largest float32 split-K partial buffer (chunks x M x N) the persistent schedule may use


def eligible(x: torch.Tensor, fmt: str, w_scale: torch.Tensor | None, rows: int) -> bool:
    """bfloat16 activations, fp4 weights with E8M0 scales, 1..MAX_ROWS rows, K a multiple of 128 (one step)."""
    return (fmt == "fp4" and gd.eligible(x, fmt, w_scale, rows) and rows <= MAX_ROWS and x.shape[-1] % 128 == 0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, w_scale: torch.Tensor,
                   fmt: str = "fp4") -> torch.Tensor:
    """out[m] = x[m] @ W[expert_ids[m]]^T for bfloat16 x [M <= MAX_ROWS, K] over fp4 experts w [E, N, K/2] with
    E8M0 scales [E, N, K/32]; returns bfloat16 [M, N]. Rows with an id outside [0, E) come out as zeros."""
    m, k = x.shape
    n_exp, n = w.shape[0], w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or m == 0:
        return out
    n_slots = max(1, min(n_exp, m))
    ids = expert_ids.contiguous()
    mp = triton.next_power_of_2(m)
    ep = triton.next_power_of_2(n_exp)
    if mp * ep <= gd.FUSED_ACTIVE:  # each program lists the active experts itself
        act, ep_arg = ids, ep
    else:
        act, ep_arg = torch.empty(n_slots + 1, dtype=torch.int32, device=x.device), 0
        gd._active_experts_kernel[(1,)](ids, act, m, n_exp, n_slots, MP=mp, EB=max(1, min(32, 8192 // mp)),
                                        num_warps=8, **pdl())
    cfg = _config(m / n_slots)
    bw, bt, bk = cfg["bw"], cfg["bt"], cfg["bk"]
    ks = bk // 4
    k_end = k // 4
    k_steps = triton.cdiv(k_end, ks)
    n_tiles = triton.cdiv(n, bw)
    slots = n_slots + 1
    max_pass = triton.cdiv(m, bt)
    # split-K arrival counters (absent only under graph capture before the first eager call: no split then)
    ctr = tc._counters(x.device) if n_tiles * slots * max_pass <= tc.CTR_SIZE else None
    if cfg["persist"]:
        split, k_split = 1, k_end
        max_chunks = 1 if ctr is None else max(1, min(cfg["maxc"], k_steps // 2, PART_BYTES // (4 * m * n)))
        grid = (cfg["pctas"] * sm_count(x.device),)
        part = torch.empty(max_chunks, m, n, dtype=torch.float32, device=x.device) if max_chunks > 1 else out
    else:
        split = tc._splits(n_tiles * n_slots, k_steps, x.device, cfg["ctas"]) if ctr is not None else 1
        k_split = triton.cdiv(k_steps, split) * ks
        split = triton.cdiv(k_end, k_split)
        max_chunks = 1
        grid = (n_tiles, slots, split)
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    xk = x.contiguous().view(m, k // 4, 4).permute(2, 0, 1).contiguous()  # [4, M, K/4]: column phases
    wc = w.contiguous().view(torch.int16)
    s = w_scale.contiguous().view(torch.uint8)
    mul1 = gd.small_scales(w_scale)
    if ctr is None:  # never touched (one split), but an int32 pointer: the atomics are compiled in the persistent mode
        ctr = torch.empty(1, dtype=torch.int32, device=x.device)
    _moe_fp4_kernel[grid](
        xk, wc, s, out, part, ctr, ids, act, m, n, k, n_exp, wc.stride(0), s.stride(0),
        k_split, n_slots, split, max_pass, max_chunks, cfg["ov"], ASM=not INTERPRET, MUL1=mul1,
        EVEN_K=k_end % ks == 0, EVEN_N=n % bw == 0, EP=ep_arg, MP=mp, PERSIST=bool(cfg["persist"]),
        NACC=cfg["nacc"], BW=bw, BT=bt, BK=bk, num_warps=cfg["warps"], num_stages=cfg["stages"],
        **({"maxnreg": cfg["regs"]} if cfg["regs"] and not INTERPRET else {}), **pdl())
    return out
