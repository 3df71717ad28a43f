"""KV-pool layouts a backend's attention ops need, asked by the runner when it builds the pools.

The model files never check devices: a backend registers the :class:`KVLayout` its ops want (the NPU backend:
separate MLA nope / rope caches, block sizes a multiple of 16, for ``npu_fused_infer_attention_score``'s paged
form), and the runner hands it to ``model.make_pools(..., layout=...)``. Backends that register nothing get the
reference layout (:data:`REFERENCE`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._registry import check as _check


@dataclass(frozen=True)
class KVLayout:
    """mla_split_rope: DeepSeek-V3 MLA pools keep ``c_kv`` [P, C] and ``k_pe`` [P, R] as two caches (read by
    ``atb_ops.mla_decode_split``) instead of one ``[c_kv | k_pe]`` row (``atb_ops.mla_decode``).
    block_size_multiple: the pools' block size (tokens per page) must be a multiple of it.
    why: one line for logs and errors."""

    mla_split_rope: bool = False
    block_size_multiple: int = 1
    why: str = "reference layout"


REFERENCE = KVLayout()
_layouts: dict[str, KVLayout] = {}


def register_kv_layout(backend: str, layout: KVLayout) -> None:
    _layouts[_check(backend)] = layout


def registered_layout(backend: str) -> KVLayout | None:
    """The layout ``backend`` registered, or None (``atb_ops.kv_layout`` loads the backend first)."""
    return _layouts.get(backend)
