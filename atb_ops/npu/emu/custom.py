"""Emulated DeepSeek-V4 custom ops of the Ascend custom-op packages (registered with ``torch.library``).

* vllm-ascend ``torch.ops._C_ascend``: ``npu_hc_pre``, ``npu_hc_post`` (schemas as in vllm-ascend
  ``csrc/torch_binding.cpp``);
* cann-recipes-infer ``torch.ops.custom``: ``npu_moe_gating_top_k`` with ``norm_type=2`` = sqrt(softplus) and hash
  routing (``input_ids``/``tid2eid``) (schema and formula: cann-recipes ``ops/ascendc/docs/custom-*.md``; the
  sqrt after softplus per the vllm-ascend kernel, torch_npu_ops.md §5.24(b)).

Semantics from those documents: hc_pre = DeepSeek-V4 ``hc_pre`` with the Sinkhorn normalisation
(= torch_npu's documented ``npu_mhc_pre`` + ``npu_mhc_sinkhorn``); hc_post ``y[k] = post[k] * x + sum_j comb[j, k]
* residual[j]``; gating ``y = s[idx] / (sum + eps) * routed_scaling_factor`` (always renormalised).
These packages have no Meta kernels in the torch_npu wheel, so their calls are not contract-checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import refuse

SCHEMAS = {
    "_C_ascend": {
        "npu_hc_pre": "npu_hc_pre(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
                      "int hc_sinkhorn_iters, float norm_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
        "npu_hc_post": "npu_hc_post(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
    },
    "custom": {
        "npu_moe_gating_top_k": "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, "
                                "Tensor? tid2eid=None, int k_group=1, int group_count=1, "
                                "float routed_scaling_factor=1., float eps=9.9999999999999995e-21, "
                                "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False) "
                                "-> (Tensor, Tensor, Tensor)",
    },
}


def npu_hc_pre(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    """x [T, n, d] -> (y [T, d] x.dtype, post [T, n] f32, comb [T, n, n] f32)."""
    t, n, d = x.shape
    xf = x.reshape(t, n * d).float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mix = (xf @ hc_fn.float().T) * inv_rms
    s, b = hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    res = (mix[:, 2 * n:] * s[2] + b[2 * n:]).view(t, n, n)
    comb = torch.softmax(res, dim=-1) + hc_eps  # npu_mhc_sinkhorn
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    y = torch.einsum("tn,tnd->td", pre, x.float()).to(x.dtype)
    return y, post, comb


def npu_hc_post(x, residual, post, comb):
    """``post.unsqueeze(-1) * x.unsqueeze(-2) + sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=-3)``."""
    out = post.float().unsqueeze(-1) * x.float().unsqueeze(-2) + \
        (comb.float().unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return out.to(residual.dtype)


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         routed_scaling_factor=1.0, eps=1e-20, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False):
    """norm_type 0 softmax, 1 sigmoid, 2 sqrt(softplus); top-k of ``s + bias`` (stable) or ``tid2eid[input_ids]``;
    ``y = s[idx] / (sum + eps) * routed_scaling_factor``. Groups are not emulated (group_count must be 1)."""
    if group_count != 1 or renorm != 0:
        refuse("custom.npu_moe_gating_top_k", "group_count != 1 / renorm")
    xf = x.float()
    s = {0: lambda v: v.softmax(-1), 1: torch.sigmoid, 2: lambda v: F.softplus(v).sqrt()}[norm_type](xf)
    if tid2eid is not None:
        idx = tid2eid[input_ids.long()].long()
    else:
        sb = s if bias is None else s + bias.float()
        idx = torch.argsort(-sb, dim=-1, stable=True)[:, :k]
    y = s.gather(1, idx)
    y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), (s if out_flag else torch.zeros_like(s))


IMPLS = {"_C_ascend": {"npu_hc_pre": npu_hc_pre, "npu_hc_post": npu_hc_post},
         "custom": {"npu_moe_gating_top_k": npu_moe_gating_top_k}}


def register() -> list:
    """Define and implement the emulated custom ops; returns the ``torch.library.Library`` handles (keep them
    alive; ``handle._destroy()`` removes the ops)."""
    libs = []
    for ns, schemas in SCHEMAS.items():
        lib = torch.library.Library(ns, "DEF")
        for name, schema in schemas.items():
            lib.define(schema)
            lib.impl(name, IMPLS[ns][name], "CompositeExplicitAutograd")
        libs.append(lib)
    return libs
