"""CUDA backend (Triton kernels).

Importing this package registers the Triton kernels with ``atb_ops._registry.register(op, "cuda")``; one
module per op family. Ops without a kernel here (``hadamard``, ``mla_prefill``, ...) run the reference
implementation on the GPU, and the dispatcher logs that once per op.

The same kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported); the CPU test-suite uses that to check them at small shapes.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:  # no triton: the backend registers nothing and every op falls back (logged)
    triton = None

if triton is not None:
    from . import attention, compressor, gate, gemm, group_linear, hc, indexer, norm_rope, quant, routing  # noqa: F401
