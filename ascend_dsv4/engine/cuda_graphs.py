"""CUDA-graph-captured decode steps for DeepSeek-V4 (the capture-safe path NPU graph mode needs too).

A decode step (every sequence adds one token) is replayed from a graph captured once per bucket
``(batch, width of the ratio-4 visible list, width of the ratio-128 visible list)``. The step context is
built by the runner as in eager mode; :meth:`CudaGraphDecoder.run` pads it into the bucket's static device
buffers (device-side copies, no host synchronisation) and replays:

- padded tokens write their KV and compressor state rows to a reserved "trash" slot of each page space,
  and their entries (all candidates -1) to a trash entry slot; nothing reads those slots;
- every per-step list whose length depends on the data (entries completed this step, visible compressed
  entries) is padded to a static width with -1, which every op ignores;
- widths grow in steps of 1/8 of their power of two, so a growing context needs about 8 graphs per doubling.

Inside the captured region the model runs exactly the eager code (the ops are capture-safe: no ``.item()``,
no data-dependent shapes). Prefill, chunked prefill, MTP verification steps and batches above the largest
bucket run eagerly; so does everything when ``enforce_eager`` is set.
"""

from __future__ import annotations

import logging

import torch

from ..kv.context import CompressCtx, StepContext

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


class _Graph:
    """One captured bucket: static input buffers, the graph, static outputs."""

    def __init__(self, ctx: StepContext, ids: torch.Tensor):
        self.ctx, self.ids = ctx, ids
        self.graph = torch.cuda.CUDAGraph()
        self.streams: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None


class CudaGraphDecoder:
    """Captures and replays decode steps of ``model`` over ``pools`` (a :class:`V4KVPools`)."""

    def __init__(self, model: torch.nn.Module, pools, max_batch: int = 256):
        self.model, self.pools = model, pools
        self.device = pools.device
        self.buckets = tuple(b for b in BATCH_BUCKETS if b <= max(1, max_batch)) or (1,)
        if self.buckets[-1] < max_batch:
            self.buckets = self.buckets + (max_batch,)
        self.graphs: dict[tuple, _Graph] = {}
        self.mempool = None
        self.replays = 0
        s = pools.sizes
        # one reserved page per page space: padded tokens / entries write there (never read)
        self._trash_pages = (pools.token_alloc.alloc(1)[0],
                             pools.c4_alloc.alloc(1)[0] if pools.csa_layers else -1,
                             pools.c128_alloc.alloc(1)[0] if pools.hca_layers else -1)
        self.trash_token = self._trash_pages[0] * s.block_size
        self.trash_entry = {4: self._trash_pages[1] * s.c4_block_size, 128: self._trash_pages[2] * s.c128_block_size}

    # ---- eligibility ---------------------------------------------------------------------------------
    def key(self, ctx: StepContext, rows: list[int]):
        """The bucket of a step, or None when it must run eagerly."""
        t = ctx.num_tokens
        if t == 0 or any(n != 1 for n in ctx.query_lens) or list(rows) != list(range(t)):
            return None
        b = _bucket(t, self.buckets)
        if b is None:
            return None
        widths = tuple((r, _width(cc.visible.shape[1])) for r, cc in sorted(ctx.compress.items()))
        return (b,) + widths

    # ---- capture -------------------------------------------------------------------------------------
    def _static_ctx(self, key) -> tuple[StepContext, torch.Tensor]:
        b, widths = key[0], dict(key[1:])
        dev = self.device
        z = dict(dtype=torch.long, device=dev)
        w = self.model.cfg.window_size
        compress = {}
        for r, width in widths.items():
            kappa = 2 if r == 4 else 1
            compress[r] = CompressCtx(r, torch.full((b, kappa * r), -1, **z), torch.zeros(b, **z),
                                      torch.full((b,), self.trash_entry[r], **z), torch.full((b, width), -1, **z))
        ctx = StepContext(self.pools, torch.zeros(b, **z), torch.zeros(b, **z), torch.full((b,), self.trash_token, **z),
                          torch.full((b, w), -1, **z), compress, torch.arange(b, **z), [1] * b, [0] * b)
        return ctx, torch.zeros(b, **z)

    def _capture(self, key) -> _Graph | bool:
        try:
            return self._capture_unsafe(key)
        except Exception as e:  # e.g. an op without a capture-safe kernel: that bucket runs eagerly (logged)
            log.warning("CUDA graph capture of decode bucket %s failed (%s: %s); running it eagerly",
                        key, type(e).__name__, e)
            return False

    def _capture_unsafe(self, key) -> _Graph:
        ctx, ids = self._static_ctx(key)
        g = _Graph(ctx, ids)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles the kernels of these shapes outside the capture
            self.model.logits(self.model(ids, ctx), ctx.logits_index)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g.graph, pool=self.mempool):
            g.streams = self.model(ids, ctx)
            g.logits = self.model.logits(g.streams, ctx.logits_index)
        log.info("captured a CUDA graph for decode bucket %s", key)
        return g

    # ---- replay --------------------------------------------------------------------------------------
    def run(self, ids: torch.Tensor, ctx: StepContext, key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(streams [T, hc, dim], float32 logits [T, vocab]) of a decode step, replayed from its bucket;
        None when that bucket could not be captured (the caller runs the step eagerly)."""
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key)
        if g is False:
            return None
        t = ctx.num_tokens
        s = g.ctx
        # rows t.. are padding: reset them (a smaller batch than the last replay leaves stale real slots)
        g.ids[:t].copy_(ids)
        g.ids[t:].zero_()
        s.positions[:t].copy_(ctx.positions)
        s.positions[t:].zero_()
        s.seq_index[:t].copy_(ctx.seq_index)
        s.swa_slot[:t].copy_(ctx.swa_slot)
        s.swa_slot[t:].fill_(self.trash_token)
        s.window[:t].copy_(ctx.window)
        s.window[t:].fill_(-1)
        for r, cc in s.compress.items():
            src = ctx.compress[r]
            m, n = src.new_slot.shape[0], src.visible.shape[1]
            cc.new_cand.fill_(-1)
            cc.new_cand[:m].copy_(src.new_cand)
            cc.new_pos[:m].copy_(src.new_pos)
            cc.new_slot.fill_(self.trash_entry[r])
            cc.new_slot[:m].copy_(src.new_slot)
            cc.visible[:t, :n].copy_(src.visible)
            cc.visible[:t, n:].fill_(-1)
            cc.visible[t:].fill_(-1)
        g.graph.replay()
        self.replays += 1
        return g.streams[:t].clone(), g.logits[:t].clone()
