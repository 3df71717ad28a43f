"""Decode fast path: compact step inputs in one static buffer, the step context derived from them on the device.

In a pure decode step every sequence ``s`` adds one token at position ``t_s = seq.num_tokens``. Everything a
:class:`~.context.StepContext` holds for such a step is a function of ``t_s`` and the sequence's page tables,
so the host uploads only these (:class:`DecodeInputs`, int64, one flat buffer of a static size per bucket):

=================  ==============  ==================================================================================
``ids``            ``[b]``         the new token of each row (0 on padding rows)
``positions``      ``[b]``         ``t_s``; ``-1`` marks a padding row (``b`` is the bucket's static batch)
``token_table``    ``[b, Wt]``     token pages ``lo_s .. lo_s + Wt - 1`` of row s, ``lo_s = max(t_s - S, 0) // B``
                                   (``-1`` past the table): the pages of every position a decode token reads
``tables[r]``      ``[b, Wr]``     the first ``Wr = ceil(Nr / Pr)`` pages of the ratio-r entry table (``-1`` padded)
=================  ==============  ==================================================================================

with ``B`` the token page size, ``Pr`` the entry page size of ratio r, ``Nr`` the static width of the bucket's
ratio-r visible list, and ``S = max(W - 1, 7 if CSA, 127 if HCA)`` the token span: a decode token at ``t`` reads
positions ``t - W + 1 .. t`` (window), ``t - 7 .. t`` (a completed ratio-4 entry, overlapping) and
``t - 127 .. t`` (a completed ratio-128 entry), so pages ``(t - S) // B .. t // B``: at most ``S // B + 2``.

The host fills a (pinned) host copy of the buffer (:meth:`DecodeInputs.fill`, numpy, rows of page tables that
did not change since the last step are not rewritten) and uploads it with ONE non-blocking copy
(:meth:`DecodeInputs.upload`). :func:`derive_decode_context` then computes the step context from the device
buffer with static shapes (no ``.item()``, no ``nonzero``, no host synchronisation), so a CUDA / NPU graph can
capture it together with the model: on CUDA in ONE Triton launch (atb_ops/cuda/decode_context.py), elsewhere
(and with ``ASCEND_DSV4_DECODE_CTX=torch``) with plain tensor ops, the specification of that kernel. Its
tensors equal :func:`~.context.build_step_context`'s for the real rows, with the padding conventions of captured
steps (engine/cuda_graphs.py):

- ``swa_slot`` [b]: the new token's slot; a padding row writes to ``trash_token``;
- ``window`` [b, W]: slots of positions ``t - W + 1 .. t`` (-1 where negative; all -1 on padding rows);
- ``compress[r].new_cand / new_pos / new_slot``: ONE row per token instead of one per completed entry (a decode
  token completes at most one entry per ratio: entry ``i = (t + 1) / r - 1`` when ``(t + 1) % r == 0``); rows of
  tokens that complete nothing (and padding rows) have all candidates -1, ``new_pos`` 0 and ``new_slot`` =
  ``trash_entry[r]``. The rows of completing tokens, in token order, are build_step_context's [M] rows;
- ``compress[r].visible`` [b, Nr]: slots of entries ``0 .. (t + 1) // r - 1``, -1 padded (all -1 on padding rows);
- ``positions`` = ``t`` (0 on padding rows), ``seq_index`` = ``logits_index`` = ``arange(b)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .blocks import SeqBlocks
from .context import CompressCtx, StepContext

_TABLE_OF = {4: "c4", 128: "c128"}


def token_span(pools) -> int:
    """S: the oldest token position a decode token at ``t`` reads is ``t - S`` (window, compressor candidates)."""
    return max(pools.cfg.window_size - 1, 7 if pools.csa_layers else 0, 127 if pools.hca_layers else 0)


@dataclass(frozen=True)
class DecodeLayout:
    """Static shapes of one bucket's :class:`DecodeInputs`: ``batch`` rows, ``widths`` {ratio: Nr} of the visible
    lists of the ratios the pools have, and the page geometry of the pools."""

    batch: int
    block_size: int  # B, tokens per token page
    window: int  # W
    token_span: int  # S
    widths: tuple[tuple[int, int], ...]  # ((r, Nr), ...)
    entry_pages: tuple[tuple[int, int], ...]  # ((r, Pr), ...): entries per page of ratio r

    @classmethod
    def for_pools(cls, pools, batch: int, widths: dict[int, int]) -> "DecodeLayout":
        s = pools.sizes
        page = {4: s.c4_block_size, 128: s.c128_block_size}
        rs = tuple(sorted(widths))
        return cls(batch, s.block_size, pools.cfg.window_size, token_span(pools),
                   tuple((r, widths[r]) for r in rs), tuple((r, page[r]) for r in rs))

    @property
    def token_cols(self) -> int:
        """Wt = S // B + 2 token pages per row."""
        return self.token_span // self.block_size + 2

    def table_cols(self, r: int) -> int:
        """Wr = ceil(Nr / Pr) entry pages per row of ratio r."""
        return -(-dict(self.widths)[r] // dict(self.entry_pages)[r])

    def parts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the parts of the flat buffer, in order."""
        b = self.batch
        out = [("ids", (b,)), ("positions", (b,)), ("token_table", (b, self.token_cols))]
        return out + [(f"table{r}", (b, self.table_cols(r))) for r, _ in self.widths]

    @property
    def numel(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.parts())


def _views(flat, layout: DecodeLayout) -> dict:
    out, off = {}, 0
    for name, shape in layout.parts():
        n = int(np.prod(shape))
        out[name] = flat[off:off + n].reshape(shape)
        off += n
    return out


class DecodeInputs:
    """One bucket's compact decode inputs: a static int64 device buffer (what a captured graph reads) and its host
    staging copy (pinned on CUDA), laid out by :class:`DecodeLayout` (module docstring).

    Device views: ``ids`` [b], ``positions`` [b] (-1: padding row), ``token_table`` [b, Wt], ``tables`` {r: [b, Wr]}.
    """

    def __init__(self, layout: DecodeLayout, device: torch.device | str):
        self.layout = layout
        self.device = torch.device(device)
        n = layout.numel
        pin = self.device.type == "cuda"
        self.host_buf = torch.full((n,), -1, dtype=torch.long, pin_memory=pin)
        self.buf = torch.full((n,), -1, dtype=torch.long, device=self.device)
        self._h = _views(self.host_buf.numpy(), layout)
        d = _views(self.buf, layout)
        self.ids, self.positions, self.token_table = d["ids"], d["positions"], d["token_table"]
        self.tables = {r: d[f"table{r}"] for r, _ in layout.widths}
        self._h["positions"][:] = -1  # every row padding until the first fill
        self._h["ids"][:] = 0
        self.buf.copy_(self.host_buf)
        # what each host row holds now (copies of the page lists): unchanged rows are not rewritten
        self._seen = {name: [None] * layout.batch for name in ["token_table"] + [f"table{r}" for r, _ in layout.widths]}
        self._ent = [(_TABLE_OF[r], self._h[f"table{r}"], self._seen[f"table{r}"], layout.table_cols(r))
                     for r, _ in layout.widths]
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._pending = False

    def fill(self, seqs: Sequence[SeqBlocks], token_ids: Sequence[int]) -> None:
        """Write the host copy for a decode step: row i <- ``seqs[i]`` adding ``token_ids[i]`` at position
        ``seqs[i].num_tokens``; rows ``len(seqs) ..`` become padding (position -1, id 0). Pages must be allocated
        (:meth:`V4KVPools.ensure`). Waits for the previous upload from this buffer to finish."""
        L = self.layout
        n = len(seqs)
        if n > L.batch or len(token_ids) != n:
            raise ValueError(f"DecodeInputs.fill: {n} sequences / {len(token_ids)} tokens for a bucket of {L.batch}")
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        h = self._h
        pos = [s.num_tokens for s in seqs]
        h["ids"][:n] = token_ids
        h["ids"][n:] = 0
        h["positions"][:n] = pos
        h["positions"][n:] = -1
        S, B, Wt = L.token_span, L.block_size, L.token_cols
        tok, seen_tok = h["token_table"], self._seen["token_table"]
        for i, s in enumerate(seqs):
            t = pos[i]
            lo = (t - S) // B if t > S else 0
            row = s.token[lo:lo + Wt]
            if row != seen_tok[i]:
                tok[i, :len(row)] = row
                tok[i, len(row):] = -1
                seen_tok[i] = row
            for attr, tab, seen, cols in self._ent:
                lst = getattr(s, attr)
                if lst != seen[i]:
                    m = min(len(lst), cols)
                    tab[i, :m] = lst[:m]
                    tab[i, m:] = -1
                    seen[i] = lst[:]

    def upload(self) -> None:
        """ONE copy host -> device of the whole buffer (non-blocking from pinned memory on CUDA)."""
        self.buf.copy_(self.host_buf, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True


def _token_slots(table: torch.Tensor, lo: torch.Tensor, item: torch.Tensor, ok: torch.Tensor, page: int):
    """Slots [b, k] of token positions ``item`` [b, k] through the windowed token table [b, Wt] whose column 0 is
    page ``lo`` [b]; -1 where ``ok`` is False, the position is negative or its page is -1."""
    ok = ok & (item >= 0)
    it = item.clamp(min=0)
    col = (it // page - lo.unsqueeze(1)).clamp(0, table.shape[1] - 1)
    pg = table.gather(1, col)
    return (pg * page + it % page).masked_fill(~(ok & (pg >= 0)), -1)


def _entry_slots(table: torch.Tensor, item: torch.Tensor, ok: torch.Tensor, page: int):
    """Slots [b, k] of entries ``item`` [b, k] (>= 0 where ``ok``) through the entry table [b, Wr]; -1 elsewhere."""
    it = item.clamp(min=0)
    pg = table.gather(1, (it // page).clamp(max=table.shape[1] - 1))
    return (pg * page + it % page).masked_fill(~(ok & (pg >= 0)), -1)


def decode_context_path(device: torch.device) -> str:
    """Which implementation :func:`derive_decode_context` uses for tensors on ``device``: ``"triton"`` (ONE kernel
    launch, atb_ops/cuda/decode_context.py) on CUDA, ``"torch"`` (the plain tensor ops below: the specification)
    elsewhere. ``ASCEND_DSV4_DECODE_CTX=torch`` selects the torch ops on CUDA too; ``=triton`` the kernel on any
    device (on CPU through Triton's interpreter, ``TRITON_INTERPRET=1``: what the CPU tests use)."""
    mode = os.environ.get("ASCEND_DSV4_DECODE_CTX", "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"ASCEND_DSV4_DECODE_CTX={mode!r}: expected auto, torch or triton")
    if mode == "auto":
        mode = "triton" if device.type == "cuda" and _has_triton() else "torch"
    return mode


def _has_triton() -> bool:
    import atb_ops

    return atb_ops.decode_context_kernel() is not None


def derive_decode_context(inputs: DecodeInputs, pools, trash_token: int,
                          trash_entry: dict[int, int]) -> StepContext:
    """The :class:`StepContext` of the decode step in ``inputs``' device buffer, computed on its device with
    static shapes (capture-safe); see the module docstring for what every tensor holds. ``trash_token`` /
    ``trash_entry[r]``: the slots padding rows and tokens completing no entry write to (never read).

    On CUDA one Triton launch computes every tensor (:func:`decode_context_path`); elsewhere, and with
    ``ASCEND_DSV4_DECODE_CTX=torch``, :func:`derive_decode_tensors_torch` (the specification, same values).
    """
    if decode_context_path(inputs.positions.device) == "triton":
        t, rows, swa_slot, window, compress = derive_decode_tensors_triton(inputs, trash_token, trash_entry)
    else:
        t, rows, swa_slot, window, compress = derive_decode_tensors_torch(inputs, trash_token, trash_entry)
    b = inputs.layout.batch
    return StepContext(pools, t, rows, swa_slot, window, compress, rows, [1] * b, [0] * b)


def derive_decode_tensors_triton(inputs: DecodeInputs, trash_token: int, trash_entry: dict[int, int]):
    """:func:`derive_decode_tensors_torch`'s tensors from ONE kernel launch (atb_ops/cuda/decode_context.py)."""
    import atb_ops

    decode_context = atb_ops.decode_context_kernel()
    if decode_context is None:
        raise RuntimeError("ASCEND_DSV4_DECODE_CTX=triton, but Triton is not installed: unset it or set it to torch")
    L = inputs.layout
    ratios = [(r, width, page) for (r, width), (_, page) in zip(L.widths, L.entry_pages)]
    t, rows, swa_slot, window, per = decode_context(
        inputs.positions, inputs.token_table, [inputs.tables[r] for r, _, _ in ratios], block_size=L.block_size,
        window=L.window, token_span=L.token_span, ratios=ratios, trash_token=trash_token,
        trash_entry=[trash_entry[r] for r, _, _ in ratios])
    compress = {r: CompressCtx(r, *x) for (r, _, _), x in zip(ratios, per)}
    return t, rows, swa_slot, window, compress


def derive_decode_tensors_torch(inputs: DecodeInputs, trash_token: int, trash_entry: dict[int, int]):
    """(positions, rows, swa_slot, window, {r: CompressCtx}) of the decode step in ``inputs`` with plain torch ops
    of static shapes: the specification of the Triton kernel.

    With t = positions (int64 [b], -1 on padding rows), valid = t >= 0, lo = max(t - S, 0) // B:
    slot(position q) = token_table[row, q // B - lo] * B + q % B; window = slot(t - W + 1 + j), j < W;
    for ratio r (kappa = 2 for r = 4, else 1): done = valid & ((t + 1) % r == 0), i = (t + 1) // r - 1,
    new_cand = slot(r*i - (kappa - 1)*r + j), j < kappa*r, new_pos = r*i, new_slot = entry(i);
    visible[row, e] = entry(e) for e < (t + 1) // r, with entry(e) = tables[r][row, e // Pr] * Pr + e % Pr.
    """
    L = inputs.layout
    p = inputs.positions
    dev = p.device
    b, B, W = L.batch, L.block_size, L.window
    valid = p >= 0
    t = p.clamp(min=0)
    lo = (t - L.token_span).clamp(min=0) // B
    tok = inputs.token_table
    vcol = valid.unsqueeze(1)
    swa = _token_slots(tok, lo, t.unsqueeze(1), vcol, B).squeeze(1)
    swa_slot = torch.where(valid, swa, torch.full_like(swa, trash_token))
    window = _token_slots(tok, lo, t.unsqueeze(1) - (W - 1) + torch.arange(W, device=dev), vcol, B)
    compress: dict[int, CompressCtx] = {}
    for (r, width), (_, page) in zip(L.widths, L.entry_pages):
        kappa = 2 if r == 4 else 1
        done = valid & ((t + 1) % r == 0)
        entry = (t + 1) // r - 1  # [b]; meaningful where done
        cand_pos = (entry * r - (kappa - 1) * r).unsqueeze(1) + torch.arange(kappa * r, device=dev)
        new_cand = _token_slots(tok, lo, cand_pos, done.unsqueeze(1), B)
        table = inputs.tables[r]
        slot = _entry_slots(table, entry.unsqueeze(1), done.unsqueeze(1), page).squeeze(1)
        new_slot = torch.where(done, slot, torch.full_like(slot, trash_entry[r]))
        new_pos = (entry * r).masked_fill(~done, 0)
        n_vis = ((t + 1) // r).masked_fill(~valid, 0)
        ent = torch.arange(width, device=dev).unsqueeze(0).expand(b, -1)
        visible = _entry_slots(table, ent, ent < n_vis.unsqueeze(1), page)
        compress[r] = CompressCtx(r, new_cand, new_pos, new_slot, visible)
    return t, torch.arange(b, device=dev), swa_slot, window, compress
