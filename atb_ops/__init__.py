"""atb_ops: the op surface of ascend-dsv4.

One public function per fused op (see :mod:`atb_ops.ops` for shapes and math). Backends: ``reference``
(pure PyTorch, the specification), ``cuda`` (Triton), ``npu`` (torch_npu and custom ops). Dispatch is by
the device of the inputs; force one with :func:`use_backend` or ``ATB_OPS_BACKEND``. :func:`batch_invariant`
(or :func:`set_batch_invariant`, ``ATB_OPS_BATCH_INVARIANT=1``) switches every op to a variant whose per-token
result is bitwise independent of the rest of the batch (see :mod:`atb_ops.invariant`).
"""

from ._dispatch import (
    BACKENDS,
    BackendError,
    batch_invariant,
    device_available,
    implementations,
    is_batch_invariant,
    register,
    selected_backend,
    set_batch_invariant,
    use_backend,
)
from .ops import (
    add_rms_norm,
    apply_rope,
    compressor_entries,
    compressor_pool,
    compressor_state_write,
    dequantize_weight,
    fp4_act_round,
    fp8_act_round,
    group_linear,
    grouped_matmul,
    hadamard,
    hc_head,
    hc_post,
    hc_pre,
    indexer_topk,
    kv_quant,
    linear,
    mla_decode,
    mla_decode_split,
    mla_prefill,
    moe_gate,
    moe_permute,
    moe_unpermute,
    quant_grouped_matmul,
    quant_linear,
    rms_norm,
    rms_norm_rope,
    sparse_attention,
    swiglu,
)
from .hc_fused import hc_head_norm, hc_pre_norm
from ._dispatch import kv_layout
from .layout import KVLayout, register_kv_layout
from .reference.rope import rope_inv_freq
from .invariant import enable_torch_ops as enable_batch_invariant_torch

OPS = (
    "rms_norm", "apply_rope", "hc_pre", "hc_post", "hc_head", "compressor_pool", "indexer_topk",
    "sparse_attention", "moe_gate", "swiglu", "linear", "grouped_matmul", "fp8_act_round", "fp4_act_round", "hadamard",
    "mla_decode", "mla_prefill", "dequantize_weight", "quant_linear", "quant_grouped_matmul", "group_linear",
    "add_rms_norm", "kv_quant", "mla_decode_split", "moe_permute", "moe_unpermute", "compressor_state_write",
)


def decode_context_kernel():
    """The CUDA backend's one-launch derivation of a captured decode step's context
    (:func:`atb_ops.cuda.decode_context.decode_context`: KV index bookkeeping, not an op of the model, so not in
    :data:`OPS`), or None where Triton is not installed. The KV layer asks here instead of importing the backend."""
    try:
        from .cuda.decode_context import decode_context
    except ImportError:
        return None
    return decode_context


# fused forms of registered ops (one launch where the backend's kernel has the epilogue, the ops in sequence
# otherwise): public functions, not registry entries
FUSED = ("rms_norm_rope", "compressor_entries", "hc_pre_norm", "hc_head_norm")

__all__ = list(OPS) + list(FUSED) + [
    "BACKENDS", "BackendError", "KVLayout", "batch_invariant", "decode_context_kernel", "device_available",
    "enable_batch_invariant_torch",
    "implementations", "is_batch_invariant", "kv_layout", "register", "register_kv_layout", "rope_inv_freq",
    "selected_backend", "set_batch_invariant", "use_backend",
]
