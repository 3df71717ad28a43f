"""Rows grouped by expert in one or two launches: the stable order of the routed rows and the tile table of the
grouped GEMM, as Triton kernels (capture-safe, no host synchronisation).

At decode sizes the torch formulations (``routing.stable_order``, ``gemm.expert_tiles``' torch part) are 8-25 tiny
element-wise launches per call, called for every MoE layer (moe_permute, then each grouped GEMM): on the H100 a
Flash-shaped decode step spent ~100 us per layer in them, plus one launch gap each. The same values here:

- :func:`stable_positions` (grid over row blocks): pos[i] = #{j : (ids[j], j) < (ids[i], i)}, the position of row
  i in the stable ascending order; order[pos[i]] = i. Equal to ``torch.argsort(ids, stable=True)``.
  :func:`permute_rows` computes the same positions and writes all of ``moe_permute``'s results with them (the
  grouped rows of x, their sorted expert ids, the order): one launch where the indexing took four.
- :func:`tile_table` (one program): counts[e] = #{i : ids[i] = e}, tiles[e] = ceil(counts[e] / bm), tile_end =
  inclusive prefix sum of tiles, row_start = exclusive prefix sum of counts; tile t belongs to expert
  e(t) = #{e : tile_end[e] <= t} (searchsorted, right) and covers sorted rows [r0, r1) with
  r0 = row_start[e] + (t - tile_end[e] + tiles[e]) * bm, r1 = min(row_start[e] + counts[e], r0 + bm);
  tiles past the last expert's get e = E - 1 and r1 = r0 (empty), as ``gemm.expert_tiles`` documents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import pdl, pdl_wait

BI = 64  # rows per program of the position kernel
BJ = 64  # rows compared per step


@triton.jit
def _stable_pos(ids_ptr, i, e_i, M, BI: tl.constexpr, BJ: tl.constexpr):
    """pos[i] = #{j : (ids[j], j) < (ids[i], i)} for the rows i [BI] (ids e_i): their stable ascending positions."""
    key_i = e_i * M + i
    pos = tl.zeros([BI], dtype=tl.int64)
    for j0 in range(0, M, BJ):
        j = j0 + tl.arange(0, BJ)
        mj = j < M
        key_j = tl.load(ids_ptr + j, mask=mj, other=0).to(tl.int64) * M + j
        pos += tl.sum(((key_j[None, :] < key_i[:, None]) & mj[None, :]).to(tl.int64), 1)
    return pos


@triton.jit
def _positions_kernel(ids_ptr, order_ptr, M, BI: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    mi = i < M
    pos = _stable_pos(ids_ptr, i, tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int64), M, BI, BJ)
    tl.store(order_ptr + pos, i.to(tl.int64), mask=mi)


def stable_positions(ids: torch.Tensor) -> torch.Tensor:
    """int64 [M]: the stable ascending order of the int ``ids`` [M] (= torch.argsort(ids, stable=True)); one launch,
    M * M comparisons (meant for M up to ``routing.SMALL``)."""
    ids = ids.reshape(-1).contiguous()
    m = ids.numel()
    order = torch.empty(m, dtype=torch.int64, device=ids.device)
    if m:
        _positions_kernel[(triton.cdiv(m, BI),)](ids, order, m, BI=BI, BJ=BJ, **pdl())
    return order


@triton.jit
def _permute_kernel(ids_ptr, x_ptr, xs_ptr, e_ptr, order_ptr, M, k, d, BI: tl.constexpr, BJ: tl.constexpr,
                    BD: tl.constexpr, PDL: tl.constexpr = False):
    """moe_permute in one launch: rows i of a block get their stable position pos[i] (as _positions_kernel) and
    write xs[pos, cols] = x[i // k, cols] for their column block (program axis 1); the first column block also
    writes order[pos] = i and e[pos] = ids[i]."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    mi = i < M
    e_i = tl.load(ids_ptr + i, mask=mi, other=0).to(tl.int64)
    pos = _stable_pos(ids_ptr, i, e_i, M, BI, BJ)
    if tl.program_id(1) == 0:
        tl.store(order_ptr + pos, i.to(tl.int64), mask=mi)
        tl.store(e_ptr + pos, e_i, mask=mi)
    src = (i // k).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m2 = mi[:, None] & (c < d)[None, :]
    tl.store(xs_ptr + pos[:, None] * d + c[None, :], tl.load(x_ptr + src[:, None] * d + c[None, :], mask=m2), mask=m2)


def permute_rows(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x[order // k] [M, d], ids.flat[order] int64 [M], order int64 [M]) for x [T, d] and ids [T, k] (M = T k),
    order = the stable ascending order of ids.flat: ``moe_permute``'s three results in one launch (meant for M up
    to ``routing.SMALL``; the copies are those of the indexing they replace)."""
    k = ids.shape[1]
    flat = ids.reshape(-1).contiguous()
    m, d = flat.numel(), x.shape[-1]
    xs = torch.empty(m, d, dtype=x.dtype, device=x.device)
    e = torch.empty(m, dtype=torch.int64, device=x.device)
    order = torch.empty(m, dtype=torch.int64, device=x.device)
    if m:
        bi, bd = 16, min(512, triton.next_power_of_2(max(d, 1)))
        grid = (triton.cdiv(m, bi), max(1, triton.cdiv(d, bd)))  # column block 0 also writes order and ids
        _permute_kernel[grid](flat, x.contiguous(), xs, e, order, m, k, d, BI=bi, BJ=BJ, BD=bd, **pdl())
    return xs, e, order


@triton.jit
def _tiles_kernel(ids_ptr, te_ptr, r0_ptr, r1_ptr, M, E, bm, n_tiles, BE: tl.constexpr, BJ: tl.constexpr,
                  BT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    e = tl.arange(0, BE)
    me = e < E
    counts = tl.zeros([BE], dtype=tl.int64)
    for j0 in range(0, M, BJ):
        j = j0 + tl.arange(0, BJ)
        v = tl.load(ids_ptr + j, mask=j < M, other=-1).to(tl.int64)
        counts += tl.sum((v[None, :] == e[:, None]).to(tl.int64), 1)
    tiles = tl.where(me, (counts + bm - 1) // bm, 0)
    tile_end = tl.cumsum(tiles, 0)
    row_start = tl.cumsum(counts, 0) - counts
    tile_start = tile_end - tiles
    for t0 in range(0, n_tiles, BT):
        t = t0 + tl.arange(0, BT)
        mt = t < n_tiles
        ex = tl.sum(((tile_end[None, :] <= t[:, None]) & me[None, :]).to(tl.int64), 1)
        valid = ex < E
        ec = tl.minimum(ex, E - 1)
        pick = e[None, :] == ec[:, None]
        rs = tl.sum(tl.where(pick, row_start[None, :], 0), 1)
        ts = tl.sum(tl.where(pick, tile_start[None, :], 0), 1)
        cn = tl.sum(tl.where(pick, counts[None, :], 0), 1)
        r0 = rs + (t - ts) * bm
        r1 = tl.where(valid, tl.minimum(rs + cn, r0 + bm), r0)
        tl.store(te_ptr + t, ec, mask=mt)
        tl.store(r0_ptr + t, r0, mask=mt)
        tl.store(r1_ptr + t, r1, mask=mt)


def tile_table(ids: torch.Tensor, n_experts: int, bm: int, n_tiles: int):
    """(tile_e, tile_r0, tile_r1), int64 [n_tiles] each, of the rows ``ids`` [M] (values in [0, n_experts)) grouped
    by expert in tiles of ``bm`` rows (see the module docstring); one launch of one program."""
    ids = ids.reshape(-1).contiguous()
    out = torch.empty(3, n_tiles, dtype=torch.int64, device=ids.device)
    if n_tiles:
        be = max(16, triton.next_power_of_2(n_experts))
        _tiles_kernel[(1,)](ids, out[0], out[1], out[2], ids.numel(), n_experts, bm, n_tiles, BE=be, BJ=32,
                            BT=max(8, 4096 // be), num_warps=8, **pdl())
    return out[0], out[1], out[2]
