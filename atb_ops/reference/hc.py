"""Manifold-constrained hyper-connections: hc_pre (with Sinkhorn), hc_post, hc_head
(ascend_dsv4/models/deepseek_v4/README.md §2.2, §2.5)."""

from __future__ import annotations

import torch

from .._registry import register


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = x.flatten(-2).float()  # [T, N*d]
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return (flat @ fn.float().t()) * r


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float):
    """mixes [T, (2+n)n] fp32 -> pre [T,n], post [T,n], comb [T,n,n] (ascend_dsv4/models/deepseek_v4/README.md §2.2
    step 2)."""
    scale = scale.float()
    base = base.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


@register("hc_pre", "reference")
def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    n = x.shape[-2]
    pre, post, comb = sinkhorn_split(_mixes(x, fn, norm_eps), scale, base, n, sinkhorn_iters, hc_eps)
    u = (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
    return u, post, comb


@register("hc_post", "reference")
def hc_post(y, x, post, comb):
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("tjk,tjd->tkd", comb, x.float())
    return out.to(x.dtype)


@register("hc_head", "reference")
def hc_head(x, fn, base, scale, hc_eps: float, norm_eps: float):
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
