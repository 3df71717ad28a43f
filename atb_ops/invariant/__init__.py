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

from . import ops, ops_fused  # noqa: F401  (register the variants)
from .primitives import bmm, matmul, row_sum

__all__ = ["bmm", "enable_torch_ops", "matmul", "row_sum"]


def enable_torch_ops(device_type: str) -> None:
    """Make the PyTorch reductions that model code runs outside atb_ops batch-invariant on ``device_type``,
    process-wide (``LLM(batch_invariant=True)`` calls this for its device).

    Every product of the models goes through atb_ops (``linear``, ``group_linear``, ``grouped_matmul``, ...);
    what remains is the MoE combine's scatter-add (``index_add_``): sequential in index order on the CPU, atomic
    on CUDA unless ``torch.use_deterministic_algorithms(True)`` gives it its ordered path, which this sets
    (``warn_only=True``: ops without a deterministic path warn instead of failing).
    """
    import torch

    if device_type != "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
