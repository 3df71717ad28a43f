"""Tensor / expert parallelism: process groups, comm backend choice and parallel layers.

- :mod:`parallel.groups`: world / TP / EP groups from a layout; backend by device (npu -> hccl, cuda -> nccl,
  cpu -> gloo), HCCL group options.
- :mod:`parallel.comm`: all-reduce / all-gather / all-to-all, identities at group size 1.
- :mod:`parallel.layers`: column / row / vocab-parallel layers and the parallel LM head.
- :mod:`parallel.moe_linear`: ``MoeRowParallelLinear`` / ``MoeColumnParallelLinear``.
- :mod:`parallel.linear`: the single-rank linear every parallel linear extends.
"""

from .groups import (BACKEND_BY_DEVICE, Group, ParallelError, ParallelState, backend_for_device, destroy_parallel,
                     init_parallel, resolve_group)
from .layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from .moe_linear import MoeColumnParallelLinear, MoeRowParallelLinear

__all__ = ["BACKEND_BY_DEVICE", "Group", "ParallelError", "ParallelState", "backend_for_device", "destroy_parallel",
           "init_parallel", "resolve_group", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelLMHead", "MoeRowParallelLinear", "MoeColumnParallelLinear"]
