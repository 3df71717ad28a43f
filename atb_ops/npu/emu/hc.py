"""Emulated torch_npu mHC ops (DeepSeek-V4 hyper-connections; the docs list them for Ascend 950PR/DT only):
npu_mhc_pre, npu_mhc_sinkhorn, npu_mhc_post. Formulas: the op-plugin goldens (``test_npu_mhc_pre.py`` ...),
torch_npu_ops.md §5.24(a)."""

from __future__ import annotations

import torch

from .common import refuse


def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps: float = 1e-6, hc_eps: float = 1e-6, out_flag: int = 0,
                inner_precise: int = 0):
    """x [T, n, D] (bf16/f16); phi f32 [n^2 + 2n, nD] (rows W_pre, W_post, W_res); alpha f32 [3]; bias f32
    [n^2 + 2n]. ``xf = x.reshape(T, nD).float()``; ``inv_rms = rsqrt(mean(xf^2) + norm_eps)``;
    ``h_mix = (xf * gamma) @ phi^T``; ``w = h_mix * inv_rms`` split [n, n, n^2];
    ``h_pre = sigmoid(w_pre * alpha0 + b_pre) + hc_eps``; ``h_post = 2 sigmoid(w_post * alpha1 + b_post)``;
    ``h_res = w_res * alpha2 + b_res`` ([T, n, n], no Sinkhorn); ``h_in = sum_i h_pre[i] * x[i]`` (x's dtype).
    Returns ``(h_in, h_post, h_res, inv_rms [T], h_mix, h_pre)``."""
    if inner_precise:
        refuse("npu_mhc_pre", "inner_precise=1 (HF32)")
    if x.dim() != 3:
        refuse("npu_mhc_pre", "4-D x")
    t, n, d = x.shape
    xf = x.reshape(t, n * d).float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1) + norm_eps)
    h_mix = (xf if gamma is None else xf * gamma.float().reshape(-1)) @ phi.float().t()
    w = h_mix * inv_rms.unsqueeze(-1)
    a, b = alpha.float(), bias.float()
    h_pre = torch.sigmoid(w[:, :n] * a[0] + b[:n]) + hc_eps
    h_post = 2.0 * torch.sigmoid(w[:, n:2 * n] * a[1] + b[n:2 * n])
    if alpha.numel() == 3:
        h_res = (w[:, 2 * n:] * a[2] + b[2 * n:]).reshape(t, n, n)
    else:
        h_res = torch.zeros(1, dtype=torch.float32, device=x.device)
    h_in = (h_pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)
    return h_in, h_post, h_res, inv_rms, h_mix, h_pre


def npu_mhc_sinkhorn(x, *, eps: float = 1e-6, num_iters: int = 20, out_flag: int = 0):
    """``y = softmax(x, -1) + eps``; ``y /= y.sum(-2) + eps``; then ``num_iters - 1`` times row- and
    column-normalisation, each with ``+ eps``. Returns ``(y, None, None)`` (the other two are backward buffers)."""
    if out_flag:
        refuse("npu_mhc_sinkhorn", "out_flag=1")
    y = torch.softmax(x.float(), dim=-1) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y.to(x.dtype), None, None


def npu_mhc_post(x, h_res, h_out, h_post):
    """``y[j] = h_post[j] * h_out + sum_i h_res[i, j] * x[i]`` (h_res used transposed); ``h_res=None`` ->
    ``x + h_post (x) h_out``. x [T, n, D]; h_out [T, D]; h_post [T, n]; h_res [T, n, n]. y in x's dtype."""
    xf = x.float()
    mixed = xf if h_res is None else torch.einsum("tij,tid->tjd", h_res.float(), xf)
    return (h_post.float().unsqueeze(-1) * h_out.float().unsqueeze(1) + mixed).to(x.dtype)
