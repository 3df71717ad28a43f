"""Linear and grouped (per-expert) matmuls over dense, FP8-block and packed-FP4 weights
(ascend_dsv4/models/deepseek_v4/README.md §2.0, §3.2)."""

from __future__ import annotations

import torch

from .._registry import register

FORMATS = ("dense", "fp8_block", "fp4")


@register("dequantize_weight", "reference")
def dequant_weight(w: torch.Tensor, scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
    """float32 [out, in] from a stored weight (see :func:`atb_ops.linear` for the formats)."""
    if fmt == "dense":
        return w.float()
    from quant.fp4 import dequant_fp4
    from quant.fp8_block import dequant_fp8_block

    if fmt == "fp8_block":
        return dequant_fp8_block(w, scale, dtype=torch.float32)
    if fmt == "fp4":
        return dequant_fp4(w, scale, dtype=torch.float32)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


@register("linear", "reference")
def linear(x, w, w_scale=None, fmt="dense"):
    if fmt == "dense" and w.dtype == x.dtype:
        return x @ w.t()
    return (x.float() @ dequant_weight(w, w_scale, fmt).t()).to(x.dtype)


@register("grouped_matmul", "reference")
def grouped_matmul(x, w, expert_ids, w_scale=None, fmt="dense"):
    n_out = w.shape[1]
    out = x.new_zeros((x.shape[0], n_out))
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < w.shape[0]:  # id E: no expert here, a zero row
            continue
        rows = (expert_ids == e).nonzero(as_tuple=True)[0]
        we = dequant_weight(w[e], None if w_scale is None else w_scale[e], fmt)
        out[rows] = (x[rows].float() @ we.t()).to(x.dtype)
    return out


def group_weight(w, w_scale, fmt, dtype):
    """``group_linear``'s weight as a dense [G, N, K] matrix: ``fmt="fp8_block"`` dequantised per group and rounded
    to ``dtype`` (a 16-bit x's; what loading the FP8 weight dequantised gives), ``dense`` as it is."""
    if fmt == "dense":
        return w
    wd = torch.stack([dequant_weight(w[g], w_scale[g], fmt) for g in range(w.shape[0])]) if w.shape[0] else w.float()
    return wd.to(dtype) if dtype in (torch.bfloat16, torch.float16) else wd


@register("group_linear", "reference")
def group_linear(x, w, w_scale=None, fmt="dense"):
    w = group_weight(w, w_scale, fmt, x.dtype)
    if x.dtype == w.dtype:
        return torch.einsum("tgk,gnk->tgn", x, w)
    return torch.einsum("tgk,gnk->tgn", x.float(), w.float()).to(x.dtype)
