"""CPU emulations of the torch_npu ops an msModelSlim linear runs through, from the torch_npu API documentation.

Test-only (not part of the package). Each function follows the formula of its section; where the doc leaves a
detail open, the choice is stated in the docstring.
"""

from __future__ import annotations

import torch

MAX_DIM = 65535  # §5.11: "k,n <= 65535"


def _bits_low32_to_float(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int64) & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def npu_trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None, round_mode: int = 0):
    """§5.13: ``bits = float32_bits(scale) & 0xFFFFE000``; ``out = bits | (1<<46)``; with offset
    ``o = clamp(int(round(offset)), -256, 255)``, ``out = (out & 0x4000FFFFFFFF) | ((o & 0x1FF) << 37)``.
    PT equiv given there: ``scale.float().view(torch.int32).to(torch.int64) & 0xFFFFE000 | (1<<46)``."""
    assert round_mode == 0
    out = (scale.float().view(torch.int32).to(torch.int64) & 0xFFFFE000) | (1 << 46)
    if offset is not None:
        o = torch.clamp(torch.round(offset.float()), -256, 255).to(torch.int64)
        out = (out & 0x4000FFFFFFFF) | ((o & 0x1FF) << 37)
    return out


def npu_quantize(x, scales, zero_points, dtype=torch.qint8, axis=-1, div_mode=True):
    """§5.10: div_mode=True ``q = clamp(round(x/scale) + zp)``; div_mode=False ``q = round(x*scale + zp)`` clipped
    to [-128, 127]. vllm-ascend calls it with ``1/input_scale`` and ``div_mode=False`` (quant/msmodelslim/README.md
    §5)."""
    xf = x.float()
    if div_mode:
        q = torch.round(xf / scales.float()) + zero_points.float()
    else:
        q = torch.round(xf * scales.float() + zero_points.float())
    return torch.clamp(q, -128, 127).to(torch.int8)


def npu_dynamic_quant(x):
    """§5.9: per token ``scale = max|x| / 127``; ``y = round(x / scale)``; scale f32 of shape ``x.shape[:-1]``."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    y = torch.round(xf / scale.unsqueeze(-1))
    return y.to(torch.int8), scale


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float scale as is; int64 scale: the fixpipe uses the top 19 bits of the low-word float32
    (quant/msmodelslim/README.md §5 "Hardware precision", inferred; both int64 layouts decode from the low word)."""
    if scale.dtype == torch.int64:
        return _bits_low32_to_float(scale.to(torch.int64) & 0xFFFFE000)
    return scale.float()


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     check_limits=True):
    """§5.11: ``out = (x1 @ x2 [+ bias_int32]) * scale[n] * pertoken_scale[m] [+ offset] [+ bias_fp]``;
    int32 accumulation; ``output_dtype=torch.int32`` returns the raw accumulator (+ int32 bias), scale ignored.
    x1 int8 [m,k], x2 int8 [k,n]; k, n <= 65535 (raises like the op's shape check)."""
    k, n = x2.shape[-2], x2.shape[-1]
    if check_limits and (k > MAX_DIM or n > MAX_DIM):
        raise RuntimeError(f"npu_quant_matmul: k={k}, n={n} exceed {MAX_DIM}")
    acc = x1.to(torch.int64) @ x2.to(torch.int64)
    assert int(acc.abs().max()) < 2**31, "int32 accumulator overflow"
    bias_fp = None
    if bias is not None:
        if bias.dtype == torch.int32:
            acc = acc + bias.to(torch.int64)
        else:
            bias_fp = bias.float()
    if output_dtype == torch.int32:
        return acc.to(torch.int32)
    y = acc.to(torch.int32).to(torch.float32) * _scale_values(scale)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if offset is not None:
        y = y + offset.float()
    if bias_fp is not None:
        y = y + bias_fp
    return y.to(output_dtype or torch.float32)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, bias=None,
                                 antiquant_group_size=0):
    """§5.12 / §3.3: ``y = x @ ((w + offset) * scale) + bias`` (offset **added**); weight int8 [K,N];
    scale/offset per channel (N,) or per group [ceil(K/g), N]. An int32 weight [K, N/8] holds 8 int4 (§3.3)."""
    w = (unpack_int4_lsb_first_signed(weight) if weight.dtype == torch.int32 else weight).float()
    s = antiquant_scale.float()
    o = None if antiquant_offset is None else antiquant_offset.float()
    if antiquant_group_size:
        s = s.repeat_interleave(antiquant_group_size, dim=0)
        o = None if o is None else o.repeat_interleave(antiquant_group_size, dim=0)
    wd = ((w + o) if o is not None else w) * s
    y = x.float() @ wd
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def unpack_int4_lsb_first_signed(w: torch.Tensor) -> torch.Tensor:
    """§3.3: 8 signed nibbles per int32, LSB first (element 0 in bits 0-3)."""
    u = w.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(*w.shape[:-1], w.shape[-1] * 8)


def npu_grouped_matmul_w4a8(x, weight, scale, per_token_scale, bias, group_list, output_dtype=torch.float32,
                            use_scale_bias_split=True):
    """W4A8 GMM (§5.14, deployment notes c.4 step 6): x int8 [M,K], weight int4-in-int32 [E,K,N/8], scale int64
    [E,N] (raw float32 bits), per_token_scale [M], bias = scale_bias [E,N], group_list type 1 (counts).

    Per expert: ``y = (x @ w) * scale[e] * pertoken[m]``. With ``use_scale_bias_split`` the int8 activation is
    computed the way an int4 x int4 kernel must (this is an **inference**, labelled as such in
    deployment notes c.4 "int4 assistance bias"): ``x = 16*x_hi + (x_lo - 8) + 8`` with ``x_hi, x_lo - 8`` in
    -8..7, so ``(x @ w) * s = s * (16 x_hi@w + (x_lo-8)@w) + 8 * s * sum_k w`` and the last term is exactly
    ``scale_bias``; ``y = pertoken * (s * (16 x_hi@w + (x_lo-8)@w) + scale_bias)``."""
    outs = []
    start = 0
    for e, cnt in enumerate(group_list.tolist()):
        xe = x[start:start + cnt].to(torch.int64)
        we = unpack_int4_lsb_first_signed(weight[e])  # [K, N]
        s = _bits_low32_to_float(scale[e])
        if use_scale_bias_split:
            x_hi = torch.div(xe, 16, rounding_mode="floor")
            x_lo = xe - 16 * x_hi - 8
            part = (16 * (x_hi @ we) + x_lo @ we).to(torch.float32) * s + bias[e].float()
        else:
            part = (xe @ we).to(torch.float32) * s
        outs.append(part * per_token_scale[start:start + cnt].float().unsqueeze(-1))
        start += cnt
    return torch.cat(outs).to(output_dtype)
