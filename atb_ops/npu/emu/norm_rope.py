"""Emulated torch_npu norm and RoPE ops: npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_swiglu."""

from __future__ import annotations

import torch

from .common import refuse


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """``(y, rstd)``: ``rstd = 1/sqrt(mean(x^2 over the last gamma.dim() dims) + eps)``, ``y = x * rstd * gamma``.

    Computed in float32 and cast once at the end (op-plugin golden; torch_npu doc ``npu_rms_norm``). y has x's
    dtype; rstd float32 with shape ``x.shape[:x.dim()-gamma.dim()] + [1] * gamma.dim()``.
    """
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    xf = self.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(self.dtype)
    return y, rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """``(y, rstd, x)`` with ``x = x1 + x2`` added in the input dtype first (golden), then :func:`npu_rms_norm`."""
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x.to(x1.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    # [-x1, x0, -x3, x2, ...]
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """``x * r1 + rot(x) * r2`` (torch_npu doc ``npu_rotary_mul``), r1 = cos, r2 = sin broadcast against x.

    ``rotary_mode='half'``: ``rot(x) = cat(-x[D/2:], x[:D/2])`` (cos/sin as ``[c0..c_{D/2-1}, c0..]``);
    ``'interleave'``: ``rot(x) = [-x1, x0, -x3, x2, ...]`` (cos/sin repeat-interleaved ``[c0, c0, c1, c1, ...]``),
    output stays interleaved. x 3-D or 4-D; the output has x's shape and dtype. Computed in float32.
    """
    if rotate is not None:
        refuse("npu_rotary_mul", "the rotate matrix")
    if self.dim() not in (3, 4):
        raise RuntimeError(f"npu_rotary_mul: x must be 3-D or 4-D, got {self.dim()}-D")
    xf = self.float()
    if rotary_mode == "half":
        rot = _rotate_half(xf)
    elif rotary_mode == "interleave":
        rot = _rotate_interleave(xf)
    else:
        refuse("npu_rotary_mul", f"rotary_mode={rotary_mode!r}")
    return (xf * r1.float() + rot * r2.float()).to(self.dtype)


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``A, B = chunk(x, 2, dim)``; ``silu(A) * B`` (torch_npu doc ``npu_swiglu``), in x's dtype."""
    a, b = self.chunk(2, dim=dim)
    af = a.float()
    return (af * torch.sigmoid(af) * b.float()).to(self.dtype)
