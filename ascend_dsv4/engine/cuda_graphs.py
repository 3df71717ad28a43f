"""CUDA-graph-captured decode steps for DeepSeek-V4 (the capture-safe path NPU graph mode needs too).

A decode step (every sequence adds one token) is replayed from a graph captured once per bucket
``(batch, width of the ratio-4 visible list, width of the ratio-128 visible list)``. The host does little per
step (:meth:`CudaGraphDecoder.run`): the runner allocates pages (``V4KVPools.ensure``), then the bucket's
:class:`~ascend_dsv4.kv.decode_inputs.DecodeInputs` takes the compact inputs -- token ids, positions and the
padded token / ratio-4 / ratio-128 page tables -- into one pinned host buffer, ONE non-blocking copy moves it
to the bucket's static device buffer, and the graph replays. Inside the captured region
(:func:`decode_forward`) :func:`~ascend_dsv4.kv.decode_inputs.derive_decode_context` derives the step context
from that buffer (new-token slots, the window grid, the entries completed this step, the visible-entry grids)
with static shapes (on CUDA in one Triton launch; ``ASCEND_DSV4_DECODE_CTX=torch``: the torch ops), and the
model runs exactly the eager code on it (the ops are capture-safe: no ``.item()``, no data-dependent shapes).
Padding conventions:

- padded rows (position -1 in the buffer) write their KV and compressor state rows to a reserved "trash" slot of
  the token pages, and a token completing no compressed entry (padded rows included) writes its entry (all
  candidates -1) to a trash entry slot of that ratio's pages; nothing reads those slots;
- per-step lists whose length depends on the data are static: one completed-entry row per token (a decode
  token completes at most one entry per ratio), the visible entries padded with -1 to the bucket's width,
  which every op ignores;
- widths grow in steps of 1/8 of their power of two, so a growing context needs about 8 graphs per doubling.

A step whose sequences add a few tokens each with every token's logits -- an MTP verification step, [x, draft] --
replays the same graphs: every new token becomes its own row, a view of its sequence's page tables at its own
position (:func:`decode_rows`). Row t + 1 reads the KV, the compressor state rows and a compressed entry that row t
writes in the same step; every layer writes all rows' KV / state / entries before it reads any (the order of the
eager path for a prefill chunk), so each row sees exactly what the eager step's token sees. The MTP draft that
follows (one row per committed position, the main model's hidden states of those rows as input) replays graphs of
its own, keyed ``("mtp", k, batch, widths...)`` (:meth:`CudaGraphDecoder.draft_key`, :func:`draft_forward`).

Prefill, chunked prefill, steps without every row's logits and batches above the largest bucket run eagerly (the
runner builds their context with ``build_step_context``); so does everything when ``enforce_eager`` is set. On a
non-CUDA device the decoder runs :func:`decode_forward` on the static buffers without capture (what the CPU
tests check against the eager path).
"""

from __future__ import annotations

import logging
import weakref
from typing import Sequence

import torch

from parallel.groups import before_destroy

from ..kv.blocks import SeqBlocks
from ..kv.decode_inputs import DecodeInputs, DecodeLayout, derive_decode_context
from ..layers.experts import static_shape_moe

log = logging.getLogger("ascend_dsv4.cuda_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _bucket(n: int, buckets) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def _width(n: int, lo: int = 16) -> int:
    """Static width for a list of n entries: the next multiple of max(lo, 2^floor(log2 n) / 8) (at most 12.5%
    padding, 8 graphs per doubling of the context)."""
    if n <= lo:
        return lo
    step = max(lo, (1 << (n.bit_length() - 1)) // 8)
    return -(-n // step) * step


def decode_forward(model: torch.nn.Module, inputs: DecodeInputs, pools, trash_token: int,
                   trash_entry: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a captured decode graph runs: the step context derived on the device from ``inputs``' static buffer,
    the model, the logits of every row -> (streams [b, hc, dim], float32 logits [b, vocab])."""
    ctx = derive_decode_context(inputs, pools, trash_token, trash_entry)
    with static_shape_moe():  # expert parallelism in its capturable form (layers/experts.py)
        streams = model(inputs.ids, ctx)
    return streams, model.logits(streams, ctx.logits_index)


def draft_forward(model: torch.nn.Module, inputs: DecodeInputs, hidden: torch.Tensor, k: int, pools,
                  trash_token: int, trash_entry: dict[int, int]) -> torch.Tensor:
    """What a captured MTP draft graph runs: the step context derived from ``inputs`` (row i: the committed position
    ``positions[i]``, ``ids[i]`` the true token after it), MTP module ``k`` over the main model's hidden states
    ``hidden`` [b, hc, dim] of those positions -> float32 draft logits [b, vocab] of every row."""
    ctx = derive_decode_context(inputs, pools, trash_token, trash_entry)
    with static_shape_moe():
        return model.mtp_logits(hidden, inputs.ids, ctx, k)


def decode_rows(seqs: Sequence[SeqBlocks], counts: Sequence[int]) -> list[SeqBlocks]:
    """One row per new token: ``counts[s]`` views of ``seqs[s]``'s page tables at positions ``num_tokens``,
    ``num_tokens + 1``, ... (a sequence adding one token is its own row)."""
    out = []
    for s, n in zip(seqs, counts):
        out.extend([s] if n == 1 else [SeqBlocks(s.token, s.c4, s.c128, s.num_tokens + j) for j in range(n)])
    return out


_LIVE: "weakref.WeakSet[CudaGraphDecoder]" = weakref.WeakSet()  # decoders that hold captured graphs


def release_all() -> int:
    """Release the graphs of every live decoder (:meth:`CudaGraphDecoder.release`); run by
    ``parallel.groups.destroy_parallel`` before it destroys the process groups. Returns how many it released."""
    n = 0
    for d in list(_LIVE):
        n += d.release()
    return n


class _Graph:
    """One bucket: static inputs, the graph (None without capture), static outputs."""

    def __init__(self, inputs: DecodeInputs):
        self.inputs = inputs
        self.graph = None
        self.streams: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.draft: int | None = None  # MTP module of a draft graph (None: a main-model decode graph)
        self.hidden: torch.Tensor | None = None  # a draft graph's static hidden-state input [b, hc, dim]


class CudaGraphDecoder:
    """Captures and replays decode steps of ``model`` over ``pools`` (a :class:`V4KVPools`)."""

    def __init__(self, model: torch.nn.Module, pools, max_batch: int = 256):
        self.model, self.pools = model, pools
        self.device = pools.device
        self.capture = self.device.type == "cuda"  # elsewhere: the same static-buffer path, run without a graph
        self.buckets: tuple[int, ...] = ()
        self.allow_rows(max_batch)
        self.graphs: dict[tuple, _Graph | bool] = {}
        self.mempool = None
        self.replays = 0  # decode steps run from a bucket's static buffers (graph replays on CUDA)
        s = pools.sizes
        self.ratios = tuple(r for r, layers in ((4, pools.csa_layers), (128, pools.hca_layers)) if layers)
        # one reserved page per page space: padded tokens / entries write there (never read)
        self._trash_pages = (pools.token_alloc.alloc(1)[0],
                             pools.c4_alloc.alloc(1)[0] if pools.csa_layers else -1,
                             pools.c128_alloc.alloc(1)[0] if pools.hca_layers else -1)
        self.trash_token = self._trash_pages[0] * s.block_size
        self.trash_entry = {4: self._trash_pages[1] * s.c4_block_size, 128: self._trash_pages[2] * s.c128_block_size}

    def allow_rows(self, n: int) -> None:
        """Let steps of up to ``n`` rows replay graphs (buckets of :data:`BATCH_BUCKETS` up to n, and n): the engine
        raises it from ``max_num_seqs`` to (1 + num_speculative_tokens) x that, a verification step's rows."""
        n = max(1, n)
        self.buckets = tuple(sorted(set(self.buckets) | {b for b in BATCH_BUCKETS if b <= n} | {n}))

    # ---- eligibility ---------------------------------------------------------------------------------
    def _bucket_key(self, seqs: Sequence[SeqBlocks], counts: Sequence[int]):
        """(batch bucket, (r, width) ...) of a step whose ``seqs[s]`` adds ``counts[s]`` >= 1 rows, or None (no
        rows, or more than the largest bucket)."""
        n = sum(counts)
        if not seqs or n == 0 or min(counts) < 1:
            return None
        b = _bucket(n, self.buckets)
        if b is None:
            return None
        tmax = max(s.num_tokens + c - 1 for s, c in zip(seqs, counts))  # the last position any row writes
        return (b,) + tuple((r, _width((tmax + 1) // r)) for r in self.ratios)

    def key(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], rows: Sequence[int]):
        """The bucket of a step (``seqs[s]`` adds ``tokens[s]``, logits of token ``rows``), or None when it must
        run eagerly (not every new token's logits in order, or above the largest bucket). One new token a
        sequence is a decode step; more (an MTP verification step) give a row each (:func:`decode_rows`)."""
        counts = [len(t) for t in tokens]
        if list(rows) != list(range(sum(counts))):
            return None
        return self._bucket_key(seqs, counts)

    def draft_key(self, seqs: Sequence[SeqBlocks], counts: Sequence[int], k: int = 0):
        """The bucket of an MTP draft over ``counts[s]`` committed positions of every ``seqs[s]`` from its
        ``num_tokens`` (module ``k``), or None (eager)."""
        key = self._bucket_key(seqs, counts)
        return None if key is None else ("mtp", k) + key

    # ---- capture -------------------------------------------------------------------------------------
    def _forward(self, g: _Graph):
        if g.draft is None:
            return decode_forward(self.model, g.inputs, self.pools, self.trash_token, self.trash_entry)
        return None, draft_forward(self.model, g.inputs, g.hidden, g.draft, self.pools, self.trash_token,
                                   self.trash_entry)

    def _build(self, key, hidden: torch.Tensor | None = None) -> _Graph | bool:
        draft = key[1] if key[0] == "mtp" else None
        bucket = key[2:] if draft is not None else key
        layout = DecodeLayout.for_pools(self.pools, bucket[0], dict(bucket[1:]))
        g = _Graph(DecodeInputs(layout, self.device))
        if draft is not None:  # the MTP graph's static input: hidden states, one row per position
            g.draft = draft
            g.hidden = torch.zeros((bucket[0],) + tuple(hidden.shape[1:]), dtype=hidden.dtype, device=self.device)
        if not self.capture:
            return g
        try:
            return self._capture_unsafe(g, key)
        except Exception as e:  # e.g. an op without a capture-safe kernel: that bucket runs eagerly (logged)
            log.warning("CUDA graph capture of decode bucket %s failed (%s: %s); running it eagerly",
                        key, type(e).__name__, e)
            return False

    def _capture_unsafe(self, g: _Graph, key) -> _Graph:
        g.inputs.upload()  # every row padding: the warm-up and the capture write trash slots only
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles the kernels of these shapes outside the capture
            self._forward(g)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
            _LIVE.add(self)
            before_destroy(release_all)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.mempool):
            g.streams, g.logits = self._forward(g)
        log.info("captured a CUDA graph for decode bucket %s", key)
        return g

    def release(self) -> int:
        """Drop every captured graph and the memory pool (after the device finished them): the decoder captures
        again on next use. A graph that holds NCCL collectives keeps ``ncclCommDestroy`` waiting, so the process
        groups are destroyed only after this (``parallel.groups.before_destroy``). Returns the graphs dropped."""
        n = sum(1 for g in self.graphs.values() if g is not False and g.graph is not None)
        if n or self.mempool is not None:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.mempool = None
        _LIVE.discard(self)
        return n

    # ---- replay --------------------------------------------------------------------------------------
    def stage(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], key) -> _Graph | None:
        """Host part of a decode step (pages allocated): the bucket of ``key`` (captured on first use) with the
        step's compact inputs filled and uploaded (one copy); None when that bucket could not be captured (the
        caller runs the step eagerly)."""
        g = self._get(key)
        if g is None:
            return None
        g.inputs.fill(decode_rows(seqs, [len(t) for t in tokens]), [x for t in tokens for x in t])
        g.inputs.upload()
        return g

    def _get(self, key, hidden: torch.Tensor | None = None) -> _Graph | None:
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._build(key, hidden)
        return None if g is False else g

    def stage_draft(self, seqs: Sequence[SeqBlocks], counts: Sequence[int], next_ids: Sequence[int],
                    hidden: torch.Tensor, key) -> _Graph | None:
        """:meth:`stage` for an MTP draft (``key`` from :meth:`draft_key`): rows of the committed positions, ids the
        true next tokens, ``hidden`` [rows, hc, dim] copied into the graph's static input (stream-ordered)."""
        g = self._get(key, hidden)
        if g is None:
            return None
        g.inputs.fill(decode_rows(seqs, counts), list(next_ids))
        g.inputs.upload()
        g.hidden[:hidden.shape[0]].copy_(hidden)
        return g

    def replay(self, g: _Graph, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [n, hc, dim], float32 logits [n, vocab]) of the step staged in ``g`` (its first n rows; a draft
        graph: (None, its logits))."""
        if g.graph is not None:
            g.graph.replay()
            streams, logits = g.streams, g.logits
        else:
            streams, logits = self._forward(g)
        self.replays += 1
        return None if streams is None else streams[:n].clone(), logits[:n].clone()

    def run(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], key
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`stage` then :meth:`replay`; None when the bucket could not be captured."""
        g = self.stage(seqs, tokens, key)
        return None if g is None else self.replay(g, sum(len(t) for t in tokens))
