"""Integer-path quantised linear in the NPU parameter layout (msModelSlim W8A8 / W8A8_DYNAMIC / W8A16 / W4A16)."""

from __future__ import annotations

import torch

from .._registry import register

QUANT_MODES = ("dynamic", "static", "weight_only")


def _int4_values(w: torch.Tensor) -> torch.Tensor:
    """int32 [K, N/8] (8 signed nibbles, element 0 in bits 0-3) -> int8 [K, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    v = (w.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return torch.where(v >= 8, v - 16, v).flatten(-2).to(torch.int8)


def _scale_f32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.int64:  # float32 bits in the low word (msModelSlim / npu_trans_quant_param)
        low = scale & 0xFFFFFFFF
        return torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(torch.float32)
    return scale.float()


def _check_int32(acc: torch.Tensor) -> None:
    if acc.numel() and (int(acc.max()) > 2**31 - 1 or int(acc.min()) < -(2**31)):
        raise OverflowError("quant_linear: the integer accumulator leaves the int32 range the NPU accumulates in")


@register("quant_linear", "reference")
def quant_linear(x, weight, mode, scale, bias=None, offset=None, input_scale=None, input_offset=None, group_size=0):
    if mode not in QUANT_MODES:
        raise ValueError(f"quant_linear: mode must be one of {QUANT_MODES}, got {mode!r}")
    w = _int4_values(weight) if weight.dtype == torch.int32 else weight  # [K, N] int8
    xf = x.float()
    if mode == "weight_only":
        wf = w.float()
        k, n = wf.shape
        if group_size > 0:
            rep = lambda t: t.float().reshape(-1, n).repeat_interleave(group_size, dim=0)[:k]  # noqa: E731
        else:
            rep = lambda t: t.float().reshape(1, n)  # noqa: E731
        if offset is not None:
            wf = wf + rep(offset)
        y = xf @ (wf * rep(scale))
        return (y if bias is None else y + bias.float()).to(x.dtype)
    if mode == "dynamic":
        s_t = xf.abs().amax(-1) / 127.0
        q = torch.round(xf / torch.where(s_t > 0, s_t, torch.ones_like(s_t)).unsqueeze(-1)).clamp(-128, 127)
        acc = q.to(torch.int64) @ w.to(torch.int64)
        _check_int32(acc)
        y = acc.float() * _scale_f32(scale) * s_t.unsqueeze(-1)
        return (y if bias is None else y + bias.float()).to(x.dtype)
    # static
    inv = 1.0 / input_scale.float().reshape(())
    q = torch.round(xf * inv + input_offset.float().reshape(())).clamp(-128, 127)
    acc = q.to(torch.int64) @ w.to(torch.int64)
    if bias is not None:
        acc = acc + bias.to(torch.int64)
    _check_int32(acc)
    return (acc.float() * _scale_f32(scale)).to(x.dtype)


@register("quant_grouped_matmul", "reference")
def quant_grouped_matmul(x, weight, expert_ids, scale):
    e_count, _, n = weight.shape
    m = x.shape[0]
    out = torch.zeros(m, n, dtype=x.dtype, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < weight.shape[0]:  # id E: no expert here, a zero row
            continue
        rows = (expert_ids == e).nonzero(as_tuple=True)[0]
        out[rows] = quant_linear(x[rows], weight[e], "dynamic", scale[e])
    return out
