"""A row-parallel matmul fused with its all-reduce on Ascend: ``torch_npu.npu_mm_all_reduce_base``.

``out = all_reduce_sum(x1 @ x2 + bias + x3)`` over the HCCL communicator ``hcom`` (torch_npu doc
``npu_mm_all_reduce_base``). The op adds ``bias`` and ``x3`` on every rank *before* the reduce, so a bias that
the unfused layer adds once after the reduce is passed on rank 0 only. The communicator name comes from the
group's HCCL backend (``pg._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``, the torch_npu docs'
recipe); under the torch_npu CPU emulation (``atb_ops.npu.emulation``) its ``register_hcom`` stands in.

:class:`parallel.layers.RowParallelLinear` calls :func:`try_matmul_all_reduce` first: when the ops run on the
NPU backend, the weight is dense and the group has more than one rank, the fused op replaces ``linear`` +
``all_reduce``. No NPU was used: verified on the emulation (world 2, the ``hccl`` test backend and gloo) and
the wheel's contracts.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .groups import Group, ParallelError


def _torch_npu():
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    try:
        return importlib.import_module("torch_npu")
    except Exception:
        return None


def fused_available(g: Group) -> bool:
    """Whether :func:`matmul_all_reduce` can run: torch_npu (real or emulated) has the op and the group has > 1
    rank."""
    tn = _torch_npu()
    return g.size > 1 and tn is not None and hasattr(tn, "npu_mm_all_reduce_base")


def hccl_comm_name(g: Group) -> str:
    """The HCCL communicator name of group ``g`` for this rank."""
    tn = _torch_npu()
    if tn is None:
        raise ParallelError("hccl_comm_name: torch_npu is not importable")
    if hasattr(tn, "register_hcom"):  # the CPU emulation
        return tn.register_hcom(g.pg if g.pg is not None else dist.group.WORLD)
    pg = g.pg if g.pg is not None else dist.group.WORLD
    return pg._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank(pg))


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, g: Group,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``all_reduce_sum(x @ weight^T) + bias`` in one ``npu_mm_all_reduce_base`` call.

    x: [M, K_local] or [B, M, K_local] (this rank's slice of the input features); weight: [N, K_local] (this
    rank's columns); bias: [N] or None (added once: passed on rank 0 only). Returns [..., N] in x.dtype.
    """
    x2 = weight.t()  # [K_local, N]
    if x2.dtype != x.dtype:
        x2 = x2.to(x.dtype)
    b = None if bias is None or g.rank != 0 else bias.to(x.dtype)
    return _torch_npu().npu_mm_all_reduce_base(x, x2, hccl_comm_name(g), reduce_op="sum", bias=b)


def try_matmul_all_reduce(layer, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The fused form of a row-parallel ``layer`` (``parallel.layers.RowParallelLinear``) on ``x`` (already this
    rank's input slice), or None when it does not apply: not the npu op backend for ``x``, a group of one rank,
    a non-dense / float32-compute / FP8-rounded-input layer, a float32 reduce, or x not 2-D / 3-D."""
    import atb_ops

    g = layer.tp
    if (g.size == 1 or layer.fmt != "dense" or layer.compute_fp32 or layer.fp8_input or layer.reduce_fp32
            or x.dim() not in (2, 3) or atb_ops.selected_backend(x) != "npu" or not fused_available(g)):
        return None
    return matmul_all_reduce(x, layer.weight, g, layer.bias)
