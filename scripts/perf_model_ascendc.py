#!/usr/bin/env python3
"""Analytical performance model of our AscendC kernels (atb_ops/ascendc) on Ascend 910B and 910C.

No NPU was available to this project: every number printed here is a PREDICTION from public hardware figures and the
kernels' own tiling (the host tiling function of kernels/tiling.h, called through the emulation build), not a
measurement. It prints, per decode step at DeepSeek-V4-Flash and DeepSeek-V3 shapes:

- the bytes each kernel moves (gathered KV rows per (token, head group) work item, q in, out, indices),
- its vector work (element passes of 256 bytes, instructions, vector->scalar round trips) per core,
- the predicted time max(HBM time, vector time of the busiest core, cube time), for the vector-only kernel and for the
  cube variant (QK^T / PV through the Matmul API), next to the roofline of an ideal kernel
  (unique bytes at full HBM bandwidth, or the QK/PV FLOPs on the cube at peak), and published Ascend numbers.

Public figures used (one device = one die):
- HBM: 910B ~1.6 TB/s; 910C 3.2 TB/s per two-die package, so 1.6 TB/s per die (SGLang docs "Ascend NPU"
  reference; Zuo et al., "Serving Large Language Models on Huawei CloudMatrix384", arXiv 2506.12708).
- BF16 cube peak: 376 TFLOPS per die (752 per 910C package, arXiv 2506.12708); 4096 FP16 MACs per cycle per AI core
  (Da Vinci, Hot Chips 2019). With 24 AI cores these imply a clock of 376e12 / (24 * 8192) = 1.91 GHz.
- Cores: 24 AI cores = 24 cube + 48 vector cores per 910B2 die and per 910C die (third-party: HAMi vNPU
  templates for 910B; no vendor datasheet is public); 192 KiB UB per vector core (triton-ascend programming guide).
- Vector unit: one "repeat" processes 256 bytes (64 float32 lanes), per the AscendC API reference's repeat model;
  assumed here to retire one repeat per cycle.
Assumptions (flags): vector instruction issue overhead --issue-cycles (default 8), vector->scalar round trip
(SetFlag/WaitFlag V_S before GetValue) --sync-cycles (default 100), scalar UB access --scalar-cycles (default 2), fixed
cost of a Matmul API call --matmul-cycles (default 200), float32 cube rate --fp32-cube-fraction (default 0.25 of bf16).
All are guesses; zeros give the ideal-pipeline bound.

Usage: python scripts/perf_model_ascendc.py [--out scripts/bench_results/perf_model_ascendc.md]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_dsv4.models import preset  # noqa: E402
from atb_ops.ascendc.emu import runner  # noqa: E402


@dataclass(frozen=True)
class Chip:
    name: str
    soc: str  # row of the kernels' SoC table
    hbm_bps: float
    cube_flops: float
    vector_cores: int
    ai_cores: int = 24

    @property
    def clock_hz(self) -> float:
        return self.cube_flops / (self.ai_cores * 4096 * 2)


CHIPS = (
    Chip("910B (910B2, one die)", "ascend910b2", 1.6e12, 376e12, 48),
    Chip("910C (one of two dies)", "ascend910c", 3.2e12 / 2, 752e12 / 2, 48),
)
LANES = 64  # float32 elements per 256-byte repeat
PUBLISHED = [
    "V3.2 sparse MLA decode kernel on A3: AscendC reference 99 us, tilelang-ascend port 109 us (tile-ai/tilelang-ascend "
    "README, shape as published there)",
    "DeepSeek-V4-Flash W8A8C16 on an A3 pod (64 chips, attention DP + MoE EP, MTP1): 4388 tok/s/chip at TPOT 29.2 ms, "
    "8K sequences (cann-recipes-infer docs/models/deepseek_v4/deepseek_v4_inference_guide.md)",
    "DeepSeek-R1 INT8 on CloudMatrix384 (910C): decode 1943 tok/s/NPU at TPOT < 50 ms (arXiv 2506.12708)",
    "DeepSeek-R1 W8A8C8 on A3 (64 chips, MTP1): 2138 tok/s/chip at TPOT 44.9 ms, 4K (cann-recipes "
    "deepseek_r1_decode_optimization.md)",
]


def passes(n: int) -> int:
    return math.ceil(n / LANES) if n else 0


def mla_kernel(chip: Chip, T: int, H: int, C: int, R: int, L0: int, L1: int, sink: bool, dt, a) -> dict:
    """One launch of dsv4_mla_decode: T tokens x H heads over L0 + L1 valid rows each (no -1 padding)."""
    t = runner.mla_tiling(T, H, C, R, L0, L1, 1 << 24, 1 << 24 if L1 else 0, sink, 1.0, dt, dt, soc=chip.soc)
    sz = torch.empty(0, dtype=dt).element_size()
    L, hg, nb = L0 + L1, t.headGroup, t.blockRows
    row_bytes = (C + R) * sz
    bytes_moved = T * t.numGroups * L * row_bytes + T * H * (2 * C + R) * sz + T * t.numGroups * L * 8
    unique_bytes = T * L * row_bytes + T * H * (2 * C + R) * sz + T * L * 8
    # per (head, row): Mul + ReduceSum over C (and over R), Axpy over C, plus the scalar reads / writes of the score
    # and the probability; per block: five vector->scalar hand-overs and five vector ops per head
    n_instr = 3 + (2 if R else 0)
    n_scalar = 3 + (1 if R else 0)
    per_hr = 3 * passes(C) + 2 * passes(R) + n_instr * a.issue_cycles + n_scalar * a.scalar_cycles
    blocks = math.ceil(L / nb)
    per_block_head = 4 * passes(nb) + passes(C) + 5 * a.issue_cycles + 3 * a.scalar_cycles
    cycles_item = L * hg * per_hr + blocks * (hg * per_block_head + 5 * a.sync_cycles + 3 * a.issue_cycles)
    items_per_core = math.ceil(t.numItems / t.blockDim)
    t_vec = items_per_core * cycles_item / chip.clock_hz
    t_mem = bytes_moved / chip.hbm_bps
    flops = 2 * T * H * L * (C + R) + 2 * T * H * L * C
    roof = max(unique_bytes / chip.hbm_bps, flops / chip.cube_flops)
    return dict(hg=hg, nb=nb, cores=t.blockDim, ub=t.ubBytes, bytes=bytes_moved, t_vec=t_vec, t_mem=t_mem,
                t=max(t_vec, t_mem), roof=roof)


def mla_cube_kernel(chip: Chip, T: int, H: int, C: int, R: int, L0: int, L1: int, sink: bool, dt, a) -> dict:
    """One launch of dsv4_mla_decode_cube (QK^T and PV through the Matmul API, softmax on the vector unit)."""
    t = runner.mla_tiling(T, H, C, R, L0, L1, 1 << 24, 1 << 24 if L1 else 0, sink, 1.0, dt, dt, soc=chip.soc, cube=True)
    sz = torch.empty(0, dtype=dt).element_size()
    L, hg, nb = L0 + L1, t.headGroup, t.blockRows
    hgp = math.ceil(hg / 16) * 16
    blocks = math.ceil(L / nb)
    items_per_core = math.ceil(t.numItems / t.blockDim)
    gathered = T * t.numGroups * L * (C + R) * sz
    # operands in UB reach the cube through a GM workspace and results come back the same way (the API's path for
    # VECCALC operands): per block the rows, q, P and the S / O results cross twice
    per_block_ws = 2 * (nb * (C + R) * sz + hgp * (C + R) * sz + hgp * nb * sz + 2 * hgp * nb * 4 + hgp * C * 4)
    bytes_moved = gathered + T * t.numGroups * blocks * per_block_ws + T * H * (2 * C + R) * sz + T * t.numGroups * L * 8
    flops = T * t.numGroups * blocks * (2 * hgp * nb * (C + R) + 2 * hgp * nb * C)
    cube_rate = chip.ai_cores * 8192 * chip.clock_hz * (1.0 if sz == 2 else a.fp32_cube_fraction)
    t_cube = flops / cube_rate
    per_block = (3 * passes(hgp * nb) + hg * (4 * passes(nb) + passes(C)) + passes(hg * C) + 2 * passes(nb * (C + R))
                 + (5 * hg + 12) * a.issue_cycles + 4 * a.sync_cycles + 3 * hg * a.scalar_cycles + 3 * a.matmul_cycles)
    t_vec = items_per_core * blocks * per_block / chip.clock_hz
    t_mem = bytes_moved / chip.hbm_bps
    unique = T * L * (C + R) * sz + T * H * (2 * C + R) * sz + T * L * 8
    roof = max(unique / chip.hbm_bps, (2 * T * H * L * (C + R) + 2 * T * H * L * C) / chip.cube_flops)
    return dict(hg=hg, nb=nb, cores=t.blockDim, ub=t.ubBytes, bytes=bytes_moved, t_vec=max(t_vec, t_cube), t_mem=t_mem,
                t=max(t_vec, t_cube, t_mem), roof=roof)


def compressor_kernel(chip: Chip, M: int, K: int, c: int, overlap: bool, a) -> dict:
    """One launch of dsv4_compressor: M entries of K float32 candidates, c output channels."""
    W = 2 * c if overlap else c
    t = runner.compressor_tiling(M, K, 1 << 24, W, overlap, torch.float32, soc=chip.soc)
    bytes_moved = M * K * 2 * c * 4 + M * c * 4 + M * t.nCTiles * K * 8
    per_cand = 10 * passes(t.cTile) + 10 * a.issue_cycles  # Max, Sub, Exp, Mul, Mul, Sub, Exp, Add, Mul, Add
    cycles_item = K * per_cand + a.sync_cycles
    t_vec = math.ceil(t.numItems / t.blockDim) * cycles_item / chip.clock_hz
    t_mem = bytes_moved / chip.hbm_bps
    return dict(ctile=t.cTile, cores=t.blockDim, bytes=bytes_moved, t=max(t_vec, t_mem), t_vec=t_vec, t_mem=t_mem,
                roof=(M * K * 2 * c * 4 + M * c * 4) / chip.hbm_bps)


def v4_step(chip: Chip, B: int, ctx: int, a) -> list[tuple[str, int, dict]]:
    """Per-layer-kind launches of one V4-Flash decode step with B sequences (one token each) at context ctx."""
    cfg = preset("deepseek-v4-flash")
    ratios = cfg.compress_ratios[: cfg.n_layers]
    H, D, win, topk = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.index_topk
    w = min(ctx, win)
    bf16 = torch.bfloat16
    kinds = [("SWA attention", ratios.count(0), w, 0), ("CSA attention (window + top-k)", ratios.count(4), w, min(topk, ctx // 4)),
             ("HCA attention (window + all /128)", ratios.count(128), w, max(ctx // 128, 1))]
    rows = [(f"{name}, {v}", n, fn(chip, B, H, D, 0, l0, l1, True, bf16, a)) for name, n, l0, l1 in kinds
            for v, fn in (("vector", mla_kernel), ("cube", mla_cube_kernel))]
    rows += [
        # worst-case step: every sequence completes a block in this step (one entry each)
        ("C4 compressor (main, c=512)", ratios.count(4), compressor_kernel(chip, B, 8, D, True, a)),
        ("C4 compressor (indexer, c=128)", ratios.count(4), compressor_kernel(chip, B, 8, cfg.index_head_dim, True, a)),
        ("C128 compressor (c=512)", ratios.count(128), compressor_kernel(chip, B, 128, D, False, a)),
    ]
    return rows


def v3_step(chip: Chip, B: int, ctx: int, a) -> list[tuple[str, int, dict]]:
    cfg = preset("deepseek-v3")
    args = (chip, B, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, ctx, 0, False, torch.bfloat16, a)
    return [(f"MLA absorbed decode (512 + 64), {v}", cfg.n_layers, fn(*args))
            for v, fn in (("vector", mla_kernel), ("cube", mla_cube_kernel))]


def table(title: str, rows: list[tuple[str, int, dict]]) -> list[str]:
    out = [f"#### {title}", "", "| launch | layers | tiling | MB moved | HBM us | compute us | predicted us | roofline us "
           "| x roofline |", "|---|---|---|---|---|---|---|---|---|"]
    tot = {"vector": 0.0, "cube": 0.0}
    roof = {"vector": 0.0, "cube": 0.0}
    for name, n, k in rows:
        tiling = f"hg={k['hg']} nb={k['nb']} cores={k['cores']} UB={k['ub'] // 1024}K" if "hg" in k else \
            f"cTile={k['ctile']} cores={k['cores']}"
        out.append(f"| {name} | {n} | {tiling} | {k['bytes'] / 1e6:.2f} | {k['t_mem'] * 1e6:.1f} | {k['t_vec'] * 1e6:.1f} | "
                   f"{k['t'] * 1e6:.1f} | {k['roof'] * 1e6:.1f} | {k['t'] / k['roof']:.1f} |")
        for v in tot:  # attention rows count for their variant, compressor rows for both
            if name.endswith(", " + v) or not name.endswith(("vector", "cube")):
                tot[v] += n * k["t"]
                roof[v] += n * k["roof"]
    out += ["", "Step total over all layers: " + "; ".join(
        f"**{tot[v] * 1e3:.2f} ms** with the {v} attention" for v in tot) +
        f" (ideal-kernel roofline {roof['cube'] * 1e3:.2f} ms).", ""]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--issue-cycles", type=float, default=8.0, help="assumed issue overhead per vector instruction")
    ap.add_argument("--sync-cycles", type=float, default=100.0, help="assumed vector->scalar round trip (cycles)")
    ap.add_argument("--scalar-cycles", type=float, default=2.0, help="assumed cost of one scalar UB read or write")
    ap.add_argument("--matmul-cycles", type=float, default=200.0, help="assumed fixed cost of one Matmul API call")
    ap.add_argument("--fp32-cube-fraction", type=float, default=0.25,
                    help="assumed float32 cube rate as a fraction of the bf16 peak (the cube kernel's float32 path)")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    a = ap.parse_args()
    lines = ["# Performance model of the AscendC kernels (predicted, not measured: no NPU was available)", "",
             f"Assumptions: {a.issue_cycles:g} cycles issue per vector instruction, {a.sync_cycles:g} cycles per "
             f"vector->scalar round trip, {a.scalar_cycles:g} cycles per scalar UB access, {a.matmul_cycles:g} cycles "
             "fixed cost per Matmul API call (cube variant), cube operands and results crossing a GM workspace twice "
             "per block (counted as HBM bytes), one 256-byte repeat per cycle per vector core, no L2 reuse between head "
             "groups (each (token, head-group) item re-reads its rows from HBM). 'roofline' = an ideal kernel: unique "
             "bytes at full HBM bandwidth or QK+PV FLOPs at the cube's BF16 peak, whichever is larger. Compressor rows: "
             "worst-case step (every sequence completes a block). One device = one die.", ""]
    for chip in CHIPS:
        lines += [f"## {chip.name}: {chip.hbm_bps / 1e12:.1f} TB/s, {chip.cube_flops / 1e12:.0f} TFLOPS bf16, "
                  f"{chip.vector_cores} vector cores, implied clock {chip.clock_hz / 1e9:.2f} GHz", ""]
        for B in (int(x) for x in a.batches.split(",")):
            for ctx in (int(x) for x in a.contexts.split(",")):
                lines += table(f"DeepSeek-V4-Flash, batch {B}, context {ctx}", v4_step(chip, B, ctx, a))
                lines += table(f"DeepSeek-V3, batch {B}, context {ctx}", v3_step(chip, B, ctx, a))
    lines += ["## Published Ascend numbers to compare with", ""] + [f"- {p}" for p in PUBLISHED] + [
        "", "Reading: the vector-only attention (QK and PV as Mul + ReduceSum / Axpy on the vector unit) is predicted far "
        "above the ideal-kernel roofline as batch x heads grow: the vector unit's float32 rate is a small fraction of "
        "the cube's. The cube variant moves QK^T and PV onto the cube through the Matmul API; what remains is the "
        "per-block softmax on the vector unit, the round trips of UB operands through the API's workspace, and the head "
        "groups re-reading each row (a split over keys for small batches and sharing a row block across all heads of a "
        "token are the next steps). None of it is measured until the kernels run on an NPU.", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
