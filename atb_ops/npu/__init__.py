"""Ascend NPU backend: torch_npu fused ops, custom-op packages, compositions (see :mod:`.optable`).

Importing this package registers, for every atb_ops op, an ``npu`` implementation that runs the entry of the
op table (:func:`atb_ops.npu.optable.table`, resolved once at first use and logged): a custom op when its
package is loaded, else a torch_npu fused op, else a composition of torch / torch_npu ops on the device, else
(logged as a warning) the reference implementation. torch_npu is called through the module at call time, so
``atb_ops.npu.emulation.install()`` (a CPU emulation of torch_npu) lets the whole backend run on CPU tensors.
No NPU is available to this project: the backend is verified by that emulation and by the torch_npu wheel's
own schemas and Meta kernels (:mod:`.contracts`), not on hardware.
"""

from __future__ import annotations

import functools

from .._registry import register
# importing the implementation modules registers their candidates
from . import impl_attn, impl_custom, impl_dense, impl_moe, impl_numerics, impl_quant  # noqa: F401
from .optable import HOT_PATH, candidate, format_table, hot_path_fallbacks, reset, run, table  # noqa: F401


def _register_all() -> None:
    from .. import OPS

    for op in OPS:
        def _impl(*args, _op=op):
            return run(_op, *args)

        functools.update_wrapper(_impl, run)
        _impl.__name__ = f"npu_{op}"
        register(op, "npu")(_impl)


def _ascendc_candidates() -> None:
    """Our AscendC kernels (atb_ops/ascendc: ``torch.ops.ascend_dsv4.*``) are custom-op candidates of their ops,
    used when ``libascend_dsv4_ascendc_ops.so`` was built and loads (checked when the table is resolved)."""
    from ..ascendc import loader

    for name in loader.SCHEMAS:
        def _kernel(*args, _name=name):
            return loader.npu_impls()[_name](*args)

        candidate(name, "custom", f"ascend_dsv4 AscendC kernel torch.ops.ascend_dsv4.{name}",
                  loader.load_ascendc_ops)(_kernel)


def _register_layout() -> None:
    """The KV-pool layout the NPU attention ops need (asked by the runner through ``atb_ops.kv_layout``)."""
    from ..layout import KVLayout, register_kv_layout

    register_kv_layout("npu", KVLayout(
        mla_split_rope=True, block_size_multiple=16,
        why="npu_fused_infer_attention_score's paged MLA form reads separate contiguous nope / rope caches "
            "(no non-contiguous key) with a block size that is a multiple of 16"))


_ascendc_candidates()
_register_all()
_register_layout()

from .worker_emulation import apply_from_env  # noqa: E402

apply_from_env()  # a worker of a multi-rank check-npu: emulation + contract recorder (no-op otherwise)
