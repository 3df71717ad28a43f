"""A pure-PyTorch CPU emulation of the torch_npu ops the NPU backend calls, installable as ``torch_npu``.

:func:`install` puts a module named ``torch_npu`` into ``sys.modules`` whose ``npu_*`` functions are the
emulations in :mod:`atb_ops.npu.emu` (each written from the torch_npu documentation and the op-plugin CPU
goldens, independently of the reference backend), when the real torch_npu is not importable. Afterwards
``LLM(..., backend="npu", device="cpu")`` and ``atb_ops.use_backend("npu")`` run the NPU backend on CPU
tensors. It emulates semantics, not speed, and it proves nothing about NPU hardware: no NPU was used.

``install(custom=True)`` also registers emulations of the DeepSeek-V4 custom ops the backend prefers when
their packages are loaded (vllm-ascend ``torch.ops._C_ascend.npu_hc_pre`` / ``npu_hc_post``, cann-recipes
``torch.ops.custom.npu_moe_gating_top_k``; :mod:`atb_ops.npu.emu.custom`). By default they are absent, as on an
Ascend machine without those packages.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

from .emu import attention, comm, hc, moe, norm_rope, quant, routing
from .emu import custom as custom_ops

log = logging.getLogger("atb_ops")

MODULE_NAME = "torch_npu"
_MARK = "__ascend_dsv4_emulation__"

#: every emulated op: name -> function
OPS = {
    "npu_rms_norm": norm_rope.npu_rms_norm,
    "npu_add_rms_norm": norm_rope.npu_add_rms_norm,
    "npu_rotary_mul": norm_rope.npu_rotary_mul,
    "npu_swiglu": norm_rope.npu_swiglu,
    "npu_dynamic_quant": quant.npu_dynamic_quant,
    "npu_quantize": quant.npu_quantize,
    "npu_quant_matmul": quant.npu_quant_matmul,
    "npu_weight_quant_batchmatmul": quant.npu_weight_quant_batchmatmul,
    "npu_trans_quant_param": quant.npu_trans_quant_param,
    "npu_format_cast": quant.npu_format_cast,
    "npu_moe_gating_top_k": moe.npu_moe_gating_top_k,
    "npu_grouped_matmul": moe.npu_grouped_matmul,
    "npu_moe_init_routing_v2": routing.npu_moe_init_routing_v2,
    "npu_moe_finalize_routing": routing.npu_moe_finalize_routing,
    "npu_mm_all_reduce_base": comm.npu_mm_all_reduce_base,
    "npu_fused_infer_attention_score": attention.npu_fused_infer_attention_score,
    "npu_lightning_indexer": attention.npu_lightning_indexer,
    "npu_mhc_pre": hc.npu_mhc_pre,
    "npu_mhc_sinkhorn": hc.npu_mhc_sinkhorn,
    "npu_mhc_post": hc.npu_mhc_post,
}

#: the device name ``torch_npu.npu.get_device_name()`` reports under the emulation (an Atlas A2 part by default;
#: ``install(soc="Ascend950PR")`` resolves the backend as on an Ascend 950)
DEFAULT_SOC = "Ascend910B3"


_custom_libs: list = []


class EmulationError(RuntimeError):
    """The emulation cannot be installed (the real torch_npu is present)."""


def real_torch_npu_available() -> bool:
    """Whether a real torch_npu package is importable (never imports it)."""
    mod = sys.modules.get(MODULE_NAME)
    if mod is not None:
        return not getattr(mod, _MARK, False)
    return importlib.util.find_spec(MODULE_NAME) is not None


def is_installed() -> bool:
    mod = sys.modules.get(MODULE_NAME)
    return mod is not None and getattr(mod, _MARK, False)


def build_module(soc: str = DEFAULT_SOC) -> types.ModuleType:
    """A fresh ``torch_npu`` stand-in module holding the emulated ops (and ``npu.get_device_name``)."""
    mod = types.ModuleType(MODULE_NAME)
    mod.npu = types.SimpleNamespace(get_device_name=lambda device=None: soc)
    mod.__doc__ = "CPU emulation of torch_npu ops (ascend-dsv4 atb_ops.npu.emulation); not the real torch_npu."
    setattr(mod, _MARK, True)
    mod.register_hcom = comm.register_hcom  # the emulation's stand-in for get_hccl_comm_name (not a torch_npu API)
    for name, fn in OPS.items():
        setattr(mod, name, fn)
    return mod


def install(force: bool = False, custom: bool = False, soc: str | None = None) -> types.ModuleType:
    """Make ``import torch_npu`` resolve to the emulation; returns the module. Idempotent.

    Refuses (:class:`EmulationError`) when the real torch_npu is importable, unless ``force``. ``custom``: also
    register the emulated custom-op packages. ``soc``: the device name the emulated ``torch_npu.npu`` reports
    (default :data:`DEFAULT_SOC`; changing it replaces an installed emulation). Resets the backend's op table.
    """
    if soc is not None and is_installed() and sys.modules[MODULE_NAME].npu.get_device_name() != soc:
        del sys.modules[MODULE_NAME]
    if not is_installed():
        if real_torch_npu_available() and not force:
            raise EmulationError("the real torch_npu is installed; the emulation is for machines without it")
        sys.modules[MODULE_NAME] = build_module(soc or DEFAULT_SOC)
        log.warning("torch_npu emulation installed: NPU ops run as pure-PyTorch CPU emulations (no NPU involved)")
    if custom and not _custom_libs:
        _custom_libs.extend(custom_ops.register())
    _reset_backend()
    return sys.modules[MODULE_NAME]


def uninstall() -> None:
    """Remove the emulation from ``sys.modules`` (and reset the NPU backend's op table)."""
    while _custom_libs:
        _custom_libs.pop()._destroy()
    if is_installed():
        del sys.modules[MODULE_NAME]
    _reset_backend()


def _reset_backend() -> None:
    tbl = sys.modules.get("atb_ops.npu.optable")
    if tbl is not None:
        tbl.reset()
