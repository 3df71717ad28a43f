"""Fused forms of the hyper-connection collapse with the RMSNorm after it (public functions, not registry entries,
like :func:`atb_ops.rms_norm_rope`): one launch fewer where the backend's hc_pre / hc_head kernel has the epilogue
(``impl.norm_epilogue``: the CUDA split kernel), the two ops in sequence otherwise (the specification)."""

from __future__ import annotations

import torch

from ._dispatch import resolve
from .ops import rms_norm


def _check_norm_weight(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The fused collapse-and-norm forms read ``weight`` [d] inside the kernel: refuse another shape up front."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} must be [d] = [{x.shape[-1]}] (the RMSNorm over the "
                         f"collapsed row; x {tuple(x.shape)})")


def hc_pre_norm(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float, weight: torch.Tensor,
                eps: float):
    """:func:`hc_pre` then RMSNorm of its u: ``(rms_norm(u, weight, eps), post, comb)`` (the block's collapse and the
    attention / FFN input norm; u rounded to x.dtype in between). weight: [d] float32. A backend whose hc_pre kernel
    has this fused form (``impl.norm_epilogue``) runs it in one launch fewer; otherwise the ops run in sequence."""
    _check_norm_weight("hc_pre_norm", x, weight)
    impl = resolve("hc_pre", x)
    fused = getattr(impl, "norm_epilogue", None)
    if fused is not None:
        return fused(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, weight, eps)
    u, post, comb = impl(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(u, weight, eps), post, comb


def hc_head_norm(x, fn, base, scale, hc_eps: float, norm_eps: float, weight: torch.Tensor, eps: float):
    """:func:`hc_head` then RMSNorm: ``rms_norm(hc_head(x, ...), weight, eps)`` (the collapse before the LM head;
    rounded to x.dtype in between). One launch fewer where the backend's hc_head kernel has the fused form
    (``impl.norm_epilogue``); otherwise the ops in sequence."""
    _check_norm_weight("hc_head_norm", x, weight)
    impl = resolve("hc_head", x)
    fused = getattr(impl, "norm_epilogue", None)
    if fused is not None:
        return fused(x, fn, base, scale, hc_eps, norm_eps, weight, eps)
    return rms_norm(impl(x, fn, base, scale, hc_eps, norm_eps), weight, eps)
