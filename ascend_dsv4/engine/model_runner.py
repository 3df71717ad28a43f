"""ModelRunner: runs one ragged step of a model over paged KV pools.

The runner owns the pools. A caller (the LLM API now, the scheduler later) passes the sequences of the
step and the new tokens of each; the runner allocates pages, builds the :class:`StepContext`, runs the
model, advances each sequence and frees pages no later query can read.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .context import StepContext
from .kv_pools import PoolSizes, SeqBlocks


class ModelRunner:
    def __init__(self, model: torch.nn.Module, sizes: PoolSizes, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype | None = None, cuda_graphs: bool = False, max_graph_batch: int = 256):
        self.model = model
        self.device = torch.device(device)
        self.pools = model.make_pools(sizes, kv_dtype or model.dtype, self.device)
        self.graphs = None  # captured decode steps (CUDA, DeepSeek-V4 pools), see engine/cuda_graphs.py
        if cuda_graphs and self.device.type == "cuda" and hasattr(self.pools, "csa_layers"):
            from .cuda_graphs import CudaGraphDecoder

            self.graphs = CudaGraphDecoder(model, self.pools, max_graph_batch)

    def new_sequence(self) -> SeqBlocks:
        return SeqBlocks()

    def prepare(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], logits: str = "last"):
        for s, t in zip(seqs, tokens):
            self.pools.ensure(s, s.num_tokens + len(t))
        ctx = self.pools.build_context(list(seqs), [len(t) for t in tokens], logits, self.device)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.device)
        return ids, ctx

    def commit(self, seqs: Sequence[SeqBlocks], ctx: StepContext) -> None:
        for s, n in zip(seqs, ctx.query_lens):
            s.num_tokens += n
            self.pools.trim(s)

    def forward(self, ids: torch.Tensor, ctx: StepContext, rows: Sequence[int]):
        """(streams, float32 logits of token rows ``rows``): a captured graph for decode steps when enabled,
        else the eager model."""
        if self.graphs is not None:
            key = self.graphs.key(ctx, rows)
            if key is not None:
                out = self.graphs.run(ids, ctx, key)
                if out is not None:
                    return out
        streams = self.model(ids, ctx)
        return streams, self.model.logits(streams, torch.tensor(list(rows), dtype=torch.long, device=ids.device))

    @torch.inference_mode()
    def step(self, seqs: Sequence[SeqBlocks], tokens: Sequence[Sequence[int]], logits: str = "last",
             return_streams: bool = False):
        """Run the new ``tokens[s]`` of every ``seqs[s]``; returns float32 logits [rows, vocab]
        (rows per ``logits``: "last" = one per sequence, "all" = every token), and the streams if asked."""
        ids, ctx = self.prepare(seqs, tokens, logits)
        lens = [len(t) for t in tokens]
        if logits == "last":
            rows = [sum(lens[: i + 1]) - 1 for i in range(len(lens)) if lens[i] > 0]
        elif logits == "all":
            rows = list(range(sum(lens)))
        else:
            rows = []
        streams, out = self.forward(ids, ctx, rows)
        self.commit(seqs, ctx)
        return (out, streams, ctx, ids) if return_streams else out

    def release(self, seq: SeqBlocks) -> None:
        self.pools.free(seq)
