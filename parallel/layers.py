"""Tensor-parallel layers; each is the single-device layer at group size 1.

``in_features`` / ``out_features`` / ``num_embeddings`` keep the GLOBAL sizes (what the checkpoint holds); the
parameters hold this rank's slice. ``shard_dim`` names the dimension of the checkpoint weight ([out, in]) that is
split (``0``: rows / output features, ``1``: columns / input features) and ``tp`` the group, so that a loader
reads ``weight[rank * n / size : (rank + 1) * n / size]`` along that dimension and nothing else.

- :class:`ColumnParallelLinear`: W [N, K] split on N; y_r = x @ W_r^T is this rank's N/size outputs (no
  communication; ``gather_output`` concatenates them).
- :class:`RowParallelLinear`: W [N, K] split on K; y = sum_r x_r @ W_r^T by all-reduce, then ``+ b`` once
  (the bias is not split and not added per rank); ``reduce=False`` returns the partial sum x_r @ W_r^T for a
  caller that reduces several partial sums at once.
- :class:`VocabParallelEmbedding`: table [V, D] split on V; ids outside the rank's range give zeros, the
  all-reduce sums the one rank that owns each id.
- :class:`ParallelLMHead`: column-parallel [V, D] over the vocabulary + all-gather of the logits shards.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import all_gather, all_reduce
from .groups import Group, ParallelError, resolve_group
from .linear import Linear


def split_size(n: int, g: Group, what: str) -> int:
    if n % g.size:
        raise ParallelError(f"{what} = {n} is not divisible by the group size {g.size}")
    return n // g.size


class ColumnParallelLinear(Linear):
    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, group=None,
                 gather_output: bool = False, bias: bool = False, fp8_input: bool = False, compute_fp32: bool = False):
        self.tp = resolve_group(group)
        local = split_size(out_features, self.tp, "out_features")
        super().__init__(in_features, local, dtype, fp8_input, compute_fp32)
        self.out_features = out_features
        self.gather_output = gather_output
        self.bias = nn.Parameter(torch.zeros(local, dtype=self.weight.dtype), requires_grad=False) if bias else None

    def plain_output(self) -> bool:
        return self.bias is None and not self.gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return all_gather(y, self.tp, -1) if self.gather_output else y


class RowParallelLinear(Linear):
    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, group=None,
                 input_is_parallel: bool = True, bias: bool = False, fp8_input: bool = False,
                 compute_fp32: bool = False, reduce_fp32: bool = False, reduce: bool = True):
        self.tp = resolve_group(group)
        local = split_size(in_features, self.tp, "in_features")
        super().__init__(local, out_features, dtype, fp8_input, compute_fp32)
        self.in_features = in_features
        self.input_is_parallel = input_is_parallel
        self.reduce_fp32, self.reduce = reduce_fp32, reduce
        if bias and not reduce:
            raise ParallelError("RowParallelLinear: a bias needs reduce=True (it is added once, after the reduction)")
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype), requires_grad=False) if bias else None

    def plain_output(self) -> bool:
        return False  # an input slice, a reduction, a bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp.size > 1:
            k = x.shape[-1] // self.tp.size
            x = x[..., self.tp.rank * k:(self.tp.rank + 1) * k]
        if self.reduce and self.tp.size > 1:  # npu backend: one npu_mm_all_reduce_base (matmul + reduce + bias)
            from .npu_comm import try_matmul_all_reduce

            fused = try_matmul_all_reduce(self, x)
            if fused is not None:
                return fused
        y = super().forward(x)
        if not self.reduce:  # the caller reduces this partial sum (fused with other partial sums)
            return y
        if self.reduce_fp32 and self.tp.size > 1:
            y = all_reduce(y.float(), self.tp).to(y.dtype)
        else:
            y = all_reduce(y, self.tp)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


class VocabParallelEmbedding(nn.Module):
    shard_dim = 0

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, group=None):
        super().__init__()
        self.tp = resolve_group(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = split_size(num_embeddings, self.tp, "vocab_size")
        self.start, self.end = self.tp.rank * per, (self.tp.rank + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [*] -> [*, D] in the table's dtype."""
        if self.tp.size == 1:
            return self.weight[ids]
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        y = self.weight[local] * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y, self.tp)

    def full_weight(self) -> torch.Tensor:
        """The whole table [V, D] (gathered; used by MTP's embedding lookup only through :meth:`forward`)."""
        return all_gather(self.weight, self.tp, 0)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} x {self.embedding_dim}, rows [{self.start}, {self.end})"


class ParallelLMHead(ColumnParallelLinear):
    """[V, D] split over the vocabulary; returns the full logits [*, V] on every rank (all-gather)."""

    def __init__(self, in_features: int, vocab_size: int, dtype: torch.dtype, group=None, compute_fp32: bool = False):
        super().__init__(in_features, vocab_size, dtype, group, gather_output=True, compute_fp32=compute_fp32)

