"""Custom-op package candidates (used when the package is loaded): the DeepSeek-V4 mHC and gating kernels.

* ``hc_pre`` / ``hc_post``: vllm-ascend ``torch.ops._C_ascend.npu_hc_pre`` / ``npu_hc_post`` (positional ints), or
  cann-recipes ``torch.ops.custom.npu_hc_pre`` (keyword ints). Documented for ``hc_mult = 4``, ``d = 4096``,
  bfloat16 ``x`` (cann-recipes ``custom-npu_hc_pre.md``); other shapes/dtypes run the composition.
* ``moe_gate``: cann-recipes ``torch.ops.custom.npu_moe_gating_top_k`` with ``norm_type=2`` (sqrt-softplus) for
  DeepSeek-V4's renormalised routing, hash layers included (``input_ids`` / ``tid2eid``); other scoring functions
  run the torch_npu gating / composition.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import impl_attn, impl_moe
from .optable import candidate, has_custom


def _ns(name: str) -> Optional[str]:
    for ns in ("_C_ascend", "custom"):
        if has_custom(ns, name)():
            return ns
    return None


def _hc_fits(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.shape[1] == 4 and x.shape[2] == 4096 and x.dtype == torch.bfloat16


@candidate("hc_pre", "custom", "_C_ascend|custom.npu_hc_pre (n=4, d=4096, bf16; else composed)",
           lambda: _ns("npu_hc_pre") is not None)
def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    if not _hc_fits(x) or x.shape[0] == 0:
        return impl_attn.hc_pre(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    ns = _ns("npu_hc_pre")
    op = getattr(torch.ops, ns).npu_hc_pre
    fn32, scale32, base32 = fn.float(), scale.float(), base.float()
    if ns == "_C_ascend":
        return op(x, fn32, scale32, base32, x.shape[1], int(sinkhorn_iters), float(norm_eps), float(hc_eps))
    return op(x, fn32, scale32, base32, hc_mult=x.shape[1], hc_sinkhorn_iters=int(sinkhorn_iters),
              norm_eps=float(norm_eps), hc_eps=float(hc_eps))


@candidate("hc_post", "custom", "_C_ascend.npu_hc_post (n=4, d=4096, bf16; else composed)",
           has_custom("_C_ascend", "npu_hc_post"))
def hc_post(y, x, post, comb):
    if not _hc_fits(x) or x.shape[0] == 0:
        return impl_attn.hc_post(y, x, post, comb)
    return torch.ops._C_ascend.npu_hc_post(y.to(x.dtype), x, post.float(), comb.float())


@candidate("moe_gate", "custom", "custom.npu_moe_gating_top_k norm_type=2 (V4 sqrt-softplus, hash); else torch_npu",
           has_custom("custom", "npu_moe_gating_top_k"))
def moe_gate(x, weight, bias, topk: int, route_scale: float, tid2eid=None, token_ids=None,
             score_func: str = "sqrtsoftplus", n_groups: int = 1, topk_groups: int = 1, normalize: bool = True):
    if score_func != "sqrtsoftplus" or not normalize or n_groups > 1 or x.shape[0] == 0:
        return impl_moe.moe_gate(x, weight, bias, topk, route_scale, tid2eid, token_ids, score_func, n_groups,
                                 topk_groups, normalize)
    logits = torch.matmul(x.float(), weight.float().t())
    y, idx, _ = torch.ops.custom.npu_moe_gating_top_k(
        logits, topk, bias=None if bias is None or tid2eid is not None else bias.float(),
        input_ids=token_ids if tid2eid is not None else None, tid2eid=tid2eid, k_group=1, group_count=1,
        routed_scaling_factor=float(route_scale), eps=1e-20, group_select_mode=0, renorm=0, norm_type=2,
        out_flag=False)
    return y.float(), idx.long()
