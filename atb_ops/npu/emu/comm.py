"""Emulated torch_npu matmul + all-reduce: npu_mm_all_reduce_base, over a torch.distributed group.

The real op names its HCCL communicator by a string (``hcom``, from the process group's HCCL backend
``get_hccl_comm_name(rank)``, torch_npu doc ``npu_mm_all_reduce_base``). Under the emulation the group is
registered with :func:`register_hcom` (which returns the name to pass) and the reduce runs through
``torch.distributed.all_reduce`` on that group (gloo on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import refuse

_groups: dict[str, object] = {}


def register_hcom(pg) -> str:
    """A communicator name for process group ``pg`` that the emulated op resolves back to the group."""
    name = f"emulated_hcom_{id(pg)}"
    _groups[name] = pg
    return name


def npu_mm_all_reduce_base(x1, x2, hcom: str, *, reduce_op: str = "sum", bias=None, antiquant_scale=None,
                           antiquant_offset=None, x3=None, dequant_scale=None, pertoken_scale=None,
                           comm_quant_scale_1=None, comm_quant_scale_2=None, antiquant_group_size: int = 0,
                           comm_turn: int = 0, **unsupported):
    """``out = all_reduce_sum(x1 @ x2 + bias + x3)`` over the group ``hcom`` names (torch_npu doc; op-plugin
    golden ``test_mm_all_reduce_base_add``: bias and x3 are added on every rank *before* the reduce, so a caller
    passes them on one rank only). x1 ``[..., M, K]`` (2-D or 3-D), x2 ``[K, N]``, same float dtype; the product
    is accumulated in float32 and the result returned in x1's dtype. Quantised forms are not emulated."""
    bad = [k for k, v in dict(antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                               dequant_scale=dequant_scale, pertoken_scale=pertoken_scale,
                               comm_quant_scale_1=comm_quant_scale_1, comm_quant_scale_2=comm_quant_scale_2,
                               **unsupported).items() if v is not None and v != 0]
    if bad:
        refuse("npu_mm_all_reduce_base", ", ".join(sorted(bad)))
    if reduce_op != "sum":
        refuse("npu_mm_all_reduce_base", f"reduce_op={reduce_op!r}")
    pg = _groups.get(hcom)
    if pg is None:
        raise RuntimeError(f"npu_mm_all_reduce_base: unknown communicator {hcom!r} (emulation: register the "
                           f"group with register_hcom first)")
    y = torch.matmul(x1.float(), x2.float())
    if bias is not None:
        y = y + bias.float()
    if x3 is not None:
        y = y + x3.float()
    dist.all_reduce(y, group=pg)
    return y.to(x1.dtype)


__all__ = ["npu_mm_all_reduce_base", "register_hcom"]
