"""NPU implementations of the dense ops: rms_norm, apply_rope, swiglu, linear, hadamard.

Each calls torch_npu through the module at call time (``torch_npu().npu_xxx(...)``, public keyword names), so
that the real torch_npu, the CPU emulation and the contract recorder are all honoured.
"""

from __future__ import annotations

import logging

import torch

from .optable import candidate, has_torch_npu, torch_npu

log = logging.getLogger("atb_ops")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


@candidate("rms_norm", "torch_npu", "torch_npu.npu_rms_norm", has_torch_npu("npu_rms_norm"))
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``npu_rms_norm(x, gamma)[0]``; gamma float32 (allowed with float16/bfloat16 x) or x's dtype; a weightless
    norm passes gamma = 1."""
    n = x.shape[-1]
    if weight is None:
        gamma = torch.ones(n, dtype=torch.float32, device=x.device)
    elif weight.dtype == x.dtype or weight.dtype == torch.float32:
        gamma = weight
    else:
        gamma = weight.float()
    if gamma.dtype == torch.float32 and x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"rms_norm on npu: unsupported x dtype {x.dtype}")
    return torch_npu().npu_rms_norm(x, gamma, epsilon=eps)[0]


def _gamma(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The norm weight as the NPU norms take it: x's dtype or float32 (allowed with float16/bfloat16 x); a
    weightless norm passes gamma = 1."""
    if weight is None:
        return torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    if weight.dtype == x.dtype or weight.dtype == torch.float32:
        return weight
    return weight.float()


@candidate("add_rms_norm", "torch_npu", "torch_npu.npu_add_rms_norm", has_torch_npu("npu_add_rms_norm"))
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """``npu_add_rms_norm(x1=x, x2=residual, gamma)`` -> ``(y, rstd, x1 + x2)`` (note the output order; the sum
    is formed in the input dtype first, as the unfused add rounds it)."""
    if residual.dtype != x.dtype:
        residual = residual.to(x.dtype)
    y, _, h = torch_npu().npu_add_rms_norm(x, residual, _gamma(x, weight), epsilon=eps)
    return y, h


@candidate("apply_rope", "torch_npu", "torch_npu.npu_rotary_mul(interleave)", has_torch_npu("npu_rotary_mul"))
def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """DeepSeek's pairwise (complex) RoPE on the last ``R`` channels = ``npu_rotary_mul`` in ``interleave`` mode
    with repeat-interleaved cos/sin ``[c0, c0, c1, c1, ...]`` (torch_npu API documentation: the output stays interleaved,
    unlike the MLA "interleave-half" ops). The rope slice runs as TND ``[T, N, R]`` with cos/sin ``[T, 1, R]``
    (the T1D broadcast the interleave mode accepts), in float32."""
    half = inv_freq.numel()
    rd = 2 * half
    t = x.shape[0]
    if t == 0 or x.numel() == 0:
        return x.clone()
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device, torch.float32)  # [T, R/2]
    cos = ang.cos().repeat_interleave(2, dim=-1).view(t, 1, rd)
    sin = ang.sin().repeat_interleave(2, dim=-1).view(t, 1, rd)
    if inverse:
        sin = -sin
    xr = x[..., -rd:].float().reshape(t, -1, rd)
    out = torch_npu().npu_rotary_mul(xr, cos, sin, rotary_mode="interleave")
    out = out.reshape(*x.shape[:-1], rd).to(x.dtype)
    if rd == x.shape[-1]:
        return out
    return torch.cat([x[..., :-rd], out], dim=-1)


@candidate("swiglu", "torch_npu", "torch_npu.npu_swiglu (+ clamp)", has_torch_npu("npu_swiglu"))
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU: clamp on the device, then ``npu_swiglu(cat(gate, up))`` = silu(gate) * up
    (its default ``dim=-1`` split: SiLU on the left half), float32."""
    g, u = gate.float(), up.float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return torch_npu().npu_swiglu(torch.cat([g, u], dim=-1), dim=-1)


def dense_weight(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """float32 ``[..., N, K]`` from an FP8-block / FP4 weight (A2/A3 have no FP8/FP4 matmul)."""
    from quant.fp4 import dequant_fp4
    from quant.fp8_block import dequant_fp8_block

    _warn_once(fmt, f"atb_ops npu: {fmt} weights are dequantised on every call; load with backend='npu' to "
                    f"dequantise them once at load (Atlas A2/A3 have no FP8/FP4 matmul)")
    if fmt == "fp8_block":
        return dequant_fp8_block(w, scale, dtype=torch.float32)
    if fmt == "fp4":
        return dequant_fp4(w, scale, dtype=torch.float32)
    raise ValueError(f"unknown weight format {fmt!r}")


@candidate("linear", "composed", "torch.matmul on the device (FP8/FP4 weights dequantised)")
def linear(x, w, w_scale=None, fmt="dense"):
    """``x @ W^T``: a plain matmul (the NPU's cube unit via aten); same dtype -> that dtype, else float32."""
    if fmt == "dense":
        if w.dtype == x.dtype:
            return torch.matmul(x, w.t())
        return torch.matmul(x.float(), w.float().t()).to(x.dtype)
    return torch.matmul(x.float(), dense_weight(w, w_scale, fmt).t()).to(x.dtype)


_HAD: dict[tuple, torch.Tensor] = {}


@candidate("hadamard", "composed", "torch.matmul with a cached Sylvester matrix")
def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two size, got {n}")
    key = (n, str(x.device))
    h = _HAD.get(key)
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = (h * n ** -0.5).to(x.device)
        _HAD[key] = h
    return torch.matmul(x.float(), h).to(x.dtype)


@candidate("dequantize_weight", "composed", "quant FP8-block / FP4 decoders on the device")
def dequantize_weight(w: torch.Tensor, w_scale: torch.Tensor | None = None, fmt: str = "dense") -> torch.Tensor:
    """float32 ``[N, K]`` of a stored weight, decoded on the device (the load-time conversion: Atlas A2/A3 have
    no FP8/FP4 matmul)."""
    from quant.fp4 import dequant_fp4
    from quant.fp8_block import dequant_fp8_block

    if fmt == "dense":
        return w.float()
    if fmt == "fp8_block":
        return dequant_fp8_block(w, w_scale, dtype=torch.float32)
    if fmt == "fp4":
        return dequant_fp4(w, w_scale, dtype=torch.float32)
    raise ValueError(f"unknown weight format {fmt!r}")
