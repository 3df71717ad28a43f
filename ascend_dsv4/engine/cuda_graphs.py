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

Prefill, chunked prefill, MTP verification steps and batches above the largest bucket run eagerly (the runner
builds their context with ``build_step_context``); so does everything when ``enforce_eager`` is set. On a
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


class CudaGraphDecoder:
    """Captures and replays decode steps of ``model`` over ``pools`` (a :class:`V4KVPools`)."""

    def __init__(self, model: torch.nn.Module, pools, max_batch: int = 256):
        self.model, self.pools = model, pools
        self.device = pools.device
        self.capture = self.device.type == "cuda"  # elsewhere: the same static-buffer path, run without a graph
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= max(1, max_batch)) or (1,)
        if self.buckets[-1] < max_batch:
            self.buckets = self.buckets + (max_batch,)
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

    # ---- eligibility ---------------------------------------------------------------------------------
    def key(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], rows: Sequence[int]):
        """The bucket of a step (``seqs[s]`` adds ``tokens[s]``, logits of token ``rows``), or None when it must
        run eagerly (not a pure decode step with every row's logits, or above the largest bucket)."""
        n = len(seqs)
        if n == 0 or len(rows) != n or any(len(t) != 1 for t in tokens) or list(rows) != list(range(n)):
            return None
        b = _bucket(n, self.buckets)
        if b is None:
            return None
        tmax = max(s.num_tokens for s in seqs)
        return (b,) + tuple((r, _width((tmax + 1) // r)) for r in self.ratios)

    # ---- capture -------------------------------------------------------------------------------------
    def _forward(self, g: _Graph):
        return decode_forward(self.model, g.inputs, self.pools, self.trash_token, self.trash_entry)

    def _build(self, key) -> _Graph | bool:
        layout = DecodeLayout.for_pools(self.pools, key[0], dict(key[1:]))
        g = _Graph(DecodeInputs(layout, self.device))
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
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._build(key)
        if g is False:
            return None
        g.inputs.fill(seqs, [x[0] for x in tokens])
        g.inputs.upload()
        return g

    def replay(self, g: _Graph, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [n, hc, dim], float32 logits [n, vocab]) of the step staged in ``g`` (its first n rows)."""
        if g.graph is not None:
            g.graph.replay()
            streams, logits = g.streams, g.logits
        else:
            streams, logits = self._forward(g)
        self.replays += 1
        return streams[:n].clone(), logits[:n].clone()

    def run(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], key
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`stage` then :meth:`replay`; None when the bucket could not be captured."""
        g = self.stage(seqs, tokens, key)
        return None if g is None else self.replay(g, len(seqs))
