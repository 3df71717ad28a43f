"""One Triton launch for the step context of a captured decode step (ascend_dsv4/kv/decode_inputs.py).

The decode fast path derives its :class:`~ascend_dsv4.kv.context.StepContext` on the device from a compact int64
buffer (positions, a windowed token page table, one entry page table per compress ratio). Written with torch ops
(``derive_decode_context``'s torch path, the specification of this kernel) that is ~15 tiny kernels per ratio plus
the window part; here ONE launch writes every tensor. Not an ``atb_ops`` op (no model math, no NPU variant): index
bookkeeping of the KV layer, kept with the other Triton kernels; kv/decode_inputs.py imports it lazily on CUDA.

Inputs (all int64, rows contiguous; ``b`` rows; S = token span, B = token page size, W = window):

- ``positions`` [b]: ``t``, -1 on padding rows (valid = t >= 0, t clamped to 0 below);
- ``token_table`` [b, Wt]: token pages ``lo .. lo + Wt - 1`` with ``lo = max(t - S, 0) // B`` (-1: none);
- ``tables[k]`` [b, Wr_k]: entry pages of ratio ``r_k`` (``P_k`` entries per page, -1: none).

With ``tok(q) = token_table[row, clamp(q // B - lo, 0, Wt - 1)] * B + q % B`` (-1 when q < 0, not ok or the page
is -1) and ``ent_k(e) = tables[k][row, min(e // P_k, Wr_k - 1)] * P_k + e % P_k`` (-1 when not ok or page -1):

- ``positions_out`` [b] = t (0 on padding rows); ``rows`` [b] = arange(b);
- ``swa_slot`` [b] = tok(t) (``trash_token`` on padding rows); ``window`` [b, W][j] = tok(t - W + 1 + j);
- per ratio r (kappa = 2 for r = 4 else 1), done = valid & (t + 1) % r == 0, i = (t + 1) // r - 1:
  ``new_cand`` [b, kappa r][j] = tok(r i - (kappa - 1) r + j) (ok = done), ``new_pos`` [b] = r i if done else 0,
  ``new_slot`` [b] = ent(i) if done else ``trash_entry``, ``visible`` [b, N][e] = ent(e) for e < (t + 1) // r
  (and valid), else -1.

Grid (b, ceil(max N / BLOCK_V)): program (row, 0) writes the row's per-token outputs, every program one BLOCK_V
chunk of the row's visible lists (so long contexts spread over many programs). Page sizes, window, span and the
ratios are compile-time constants (fixed per pools); batch and widths are runtime arguments, so a new bucket
does not recompile the kernel. No host synchronisation: capture-safe.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ._util import pow2, pdl_wait, pdl

BLOCK_V = 512


@triton.jit
def _tok_slot(tok_row, wt, lo, item, ok, mask, B: tl.constexpr):
    """tok(item): slots through the windowed token table row (``ok`` and item >= 0, page >= 0), else -1."""
    ok = ok & (item >= 0)
    it = tl.maximum(item, 0)
    col = tl.minimum(tl.maximum(it // B - lo, 0), wt - 1)
    pg = tl.load(tok_row + col, mask=mask, other=-1)
    return tl.where(ok & (pg >= 0), pg * B + it % B, -1)


@triton.jit
def _ent_slot(tab_row, wr, item, ok, mask, P: tl.constexpr):
    """ent(item): slots through an entry table row (``ok`` and page >= 0), else -1."""
    it = tl.maximum(item, 0)
    col = tl.minimum(it // P, wr - 1)
    pg = tl.load(tab_row + col, mask=mask, other=-1)
    return tl.where(ok & (pg >= 0), pg * P + it % P, -1)


@triton.jit
def _ratio_token_part(row, t, valid, lo, tok_row, wt, tab_row, wr, cand_out, npos_out, nslot_out, trash,
                      R: tl.constexpr, KAPPA: tl.constexpr, BK: tl.constexpr, B: tl.constexpr, P: tl.constexpr):
    done = valid & ((t + 1) % R == 0)
    entry = (t + 1) // R - 1
    k = tl.arange(0, BK)
    km = k < KAPPA * R
    cand = _tok_slot(tok_row, wt, lo, entry * R - (KAPPA - 1) * R + k, done, km, B)
    tl.store(cand_out + row * (KAPPA * R) + k, cand, mask=km)
    slot = _ent_slot(tab_row, wr, entry, done, True, P)
    tl.store(nslot_out + row, tl.where(done, slot, trash))
    tl.store(npos_out + row, tl.where(done, entry * R, 0))


@triton.jit
def _ratio_visible_part(row, chunk, t, valid, tab_row, wr, vis_out, n,
                        R: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
    n_vis = tl.where(valid, (t + 1) // R, 0)
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    m = e < n
    vis = _ent_slot(tab_row, wr, e, e < n_vis, m, P)
    tl.store(vis_out + row * n + e, vis, mask=m)


@triton.jit
def _decode_context_kernel(
        pos_ptr, tok_ptr, tok_stride, wt, t_out, rows_out, swa_out, win_out, trash_token,
        tab0, tab0_stride, wr0, cand0, npos0, nslot0, vis0, n0, trash0,
        tab1, tab1_stride, wr1, cand1, npos1, nslot1, vis1, n1, trash1,
        S: tl.constexpr, B: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, NUM_R: tl.constexpr,
        R0: tl.constexpr, KAPPA0: tl.constexpr, BK0: tl.constexpr, P0: tl.constexpr,
        R1: tl.constexpr, KAPPA1: tl.constexpr, BK1: tl.constexpr, P1: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    p = tl.load(pos_ptr + row)
    valid = p >= 0
    t = tl.maximum(p, 0)
    lo = tl.maximum(t - S, 0) // B
    tok_row = tok_ptr + row * tok_stride
    tab0_row = tab0 + row * tab0_stride
    tab1_row = tab1 + row * tab1_stride
    if chunk == 0:
        tl.store(t_out + row, t)
        tl.store(rows_out + row, row)
        swa = _tok_slot(tok_row, wt, lo, t, valid, True, B)
        tl.store(swa_out + row, tl.where(valid, swa, trash_token))
        j = tl.arange(0, BW)
        jm = j < W
        win = _tok_slot(tok_row, wt, lo, t - (W - 1) + j, valid, jm, B)
        tl.store(win_out + row * W + j, win, mask=jm)
        if NUM_R > 0:
            _ratio_token_part(row, t, valid, lo, tok_row, wt, tab0_row, wr0, cand0, npos0, nslot0, trash0,
                              R0, KAPPA0, BK0, B, P0)
        if NUM_R > 1:
            _ratio_token_part(row, t, valid, lo, tok_row, wt, tab1_row, wr1, cand1, npos1, nslot1, trash1,
                              R1, KAPPA1, BK1, B, P1)
    if NUM_R > 0:
        _ratio_visible_part(row, chunk, t, valid, tab0_row, wr0, vis0, n0, R0, P0, BLOCK)
    if NUM_R > 1:
        _ratio_visible_part(row, chunk, t, valid, tab1_row, wr1, vis1, n1, R1, P1, BLOCK)


def decode_context(positions: torch.Tensor, token_table: torch.Tensor, tables: Sequence[torch.Tensor], *,
                   block_size: int, window: int, token_span: int, ratios: Sequence[tuple[int, int, int]],
                   trash_token: int, trash_entry: Sequence[int]):
    """The decode step context of the compact inputs in ONE kernel launch (module docstring for the math).

    positions [b], token_table [b, Wt], tables[k] [b, Wr_k]: int64, rows contiguous (views of the flat buffer).
    ratios[k] = (r, N, P): ratio, static visible width, entries per page; at most two ratios.
    Returns (t [b], rows [b], swa_slot [b], window [b, W], [(new_cand [b, kappa r], new_pos [b], new_slot [b],
    visible [b, N]) per ratio]), all int64 and contiguous (views of one fresh buffer).
    """
    if len(ratios) > 2 or len(tables) != len(ratios) or len(trash_entry) != len(ratios):
        raise ValueError(f"decode_context: {len(ratios)} ratios / {len(tables)} tables (at most two ratios)")
    b = positions.shape[0]
    named = [("positions", positions), ("token_table", token_table)]
    named += [(f"tables[{k}] (ratio {r})", x) for k, ((r, _, _), x) in enumerate(zip(ratios, tables))]
    for name, x in named:
        if x.dtype != torch.long or x.stride(-1) != 1:
            raise ValueError(f"decode_context: {name} must be int64 with contiguous rows, got {x.dtype} with "
                             f"strides {tuple(x.stride())}")
    kappas = [2 if r == 4 else 1 for r, _, _ in ratios]
    sizes = [b, b, b, b * window]
    for (r, n, _), kappa in zip(ratios, kappas):
        sizes += [b * kappa * r, b, b, b * n]
    out = torch.empty(sum(sizes), dtype=torch.long, device=positions.device)
    parts = list(torch.split(out, sizes))
    t, rows, swa = parts[0], parts[1], parts[2]
    win = parts[3].view(b, window)
    per_ratio = []
    for k, ((r, n, _), kappa) in enumerate(zip(ratios, kappas)):
        cand, npos, nslot, vis = parts[4 + 4 * k: 8 + 4 * k]
        per_ratio.append((cand.view(b, kappa * r), npos, nslot, vis.view(b, n)))
    if b == 0:
        return t, rows, swa, win, per_ratio
    rargs, cargs = [], []
    for k in range(2):
        if k < len(ratios):
            (r, n, page), tab, (cand, npos, nslot, vis) = ratios[k], tables[k], per_ratio[k]
            rargs += [tab, tab.stride(0), tab.shape[1], cand, npos, nslot, vis, n, int(trash_entry[k])]
            cargs += [r, kappas[k], pow2(kappas[k] * r), page]
        else:  # unused slot: any valid pointers, never read or written (NUM_R)
            rargs += [positions, 0, 1, t, t, t, t, 0, 0]
            cargs += [1, 1, 1, 1]
    nmax = max([n for _, n, _ in ratios], default=0)
    grid = (b, max(1, triton.cdiv(nmax, BLOCK_V)))
    _decode_context_kernel[grid](
        positions, token_table, token_table.stride(0), token_table.shape[1], t, rows, swa, win, int(trash_token),
        *rargs, S=token_span, B=block_size, W=window, BW=pow2(window), NUM_R=len(ratios),
        R0=cargs[0], KAPPA0=cargs[1], BK0=cargs[2], P0=cargs[3], R1=cargs[4], KAPPA1=cargs[5], BK1=cargs[6],
        P1=cargs[7], BLOCK=BLOCK_V, num_warps=4, **pdl())
    return t, rows, swa, win, per_ratio
