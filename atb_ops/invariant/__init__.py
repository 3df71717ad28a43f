"""Batch-invariant variants of the atb_ops ops (``atb_ops.batch_invariant()`` / ``LLM(batch_invariant=True)``).

A batch-invariant op computes every token's (row's) result with a reduction order that depends only on that
row's own data and the op's fixed parameters, never on how many other rows share the batch, where the row
sits in it, or how far the batch's padded dimensions (keys of a ragged attention batch, candidates) extend.
Then a sequence's logits are bitwise the same alone or batched with anything, under any ``max_num_seqs``
(the idea of Thinking Machines' 2025
"batch-invariant ops" and SGLang's deterministic inference: one fixed reduction strategy, no split-K, fixed
tiles).

:mod:`.primitives` holds the three reductions everything is built on (a row-blocked matmul, a batched matmul
over fixed key/reduction chunks, a chunked row sum), dispatched by device: PyTorch with fixed shapes on the
CPU, Triton kernels with fixed tiles on CUDA (:mod:`atb_ops.cuda.invariant_kernels`). :mod:`.ops` registers
a device-generic batch-invariant variant of every op, built only on those primitives, elementwise math,
gathers and exact operations (max, comparisons, stable sorts).
"""

from . import ops  # noqa: F401  (registers the variants)
from .primitives import bmm, matmul, row_sum

__all__ = ["bmm", "matmul", "row_sum"]
