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

__all__ = ["bmm", "enable_torch_ops", "matmul", "row_sum"]


def enable_torch_ops(device_type: str) -> None:
    """Make the plain PyTorch products and scatter-adds that model code runs outside atb_ops batch-invariant on
    ``device_type``, process-wide (``LLM(batch_invariant=True)`` calls this for its device).

    ``cuda``: ``mm`` / ``bmm`` / ``addmm`` run the fixed-tile Triton kernels (:mod:`atb_ops.cuda.invariant_aten`)
    and ``torch.use_deterministic_algorithms(True, warn_only=True)`` gives ``index_add_`` its ordered path.
    ``cpu``: nothing to do (the float32 GEMMs that change with M all go through atb_ops; the bfloat16 einsum of
    the V4 output projection is checked by the end-to-end test). Other devices: logged, not guaranteed.
    """
    import logging

    import torch

    log = logging.getLogger("atb_ops")
    if device_type == "cpu":
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device_type == "cuda":
        try:
            from ..cuda import invariant_aten
        except ImportError:
            log.warning("batch-invariant mode on cuda without triton: torch matmuls outside atb_ops use cuBLAS, "
                        "whose results change with the batch")
            return
        invariant_aten.enable()
    else:
        log.warning("batch-invariant mode on %s: no batch-invariant kernels for torch matmuls outside atb_ops",
                    device_type)
