"""NPU implementations of routing and the expert matmul: moe_gate, grouped_matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .impl_dense import dense_weight
from .optable import candidate, has_torch_npu, torch_npu


def _stable_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    return torch.argsort(v, dim=-1, descending=True, stable=True)[..., :k]


def _npu_gating_applies(score_func: str, tid2eid, normalize: bool, e: int, topk: int, n_groups: int,
                        topk_groups: int) -> bool:
    """Whether ``npu_moe_gating_top_k`` computes this routing exactly (its documented numpy reference):
    sigmoid with renormalisation (norm_type 1) or softmax without (norm_type 0); groups with ``E/G > 2``
    scored by their two best biased scores (group_select_mode 1)."""
    if tid2eid is not None:
        return False
    if not ((score_func == "sigmoid" and normalize) or (score_func == "softmax" and not normalize)):
        return False
    if n_groups > 1 and (e % n_groups or e // n_groups <= 2 or topk_groups > n_groups):
        return False
    return topk <= e


def _composed_gate(logits, bias, topk, route_scale, tid2eid, token_ids, score_func, n_groups, topk_groups, normalize):
    """Sqrt-softplus (DeepSeek-V4), hash routing and the forms npu_moe_gating_top_k does not cover."""
    if score_func == "sqrtsoftplus":
        s = F.softplus(logits).sqrt()
    elif score_func == "sigmoid":
        s = torch.sigmoid(logits)
    elif score_func == "softmax":
        s = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown score_func {score_func!r}")
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        sel = s if bias is None else s + bias.float()
        if n_groups > 1:
            t, e = sel.shape
            g = sel.view(t, n_groups, e // n_groups)
            gscore = g.gather(-1, _stable_topk(g, min(2, e // n_groups))).sum(-1)
            drop = torch.ones(t, n_groups, dtype=torch.bool, device=sel.device)
            drop.scatter_(1, _stable_topk(gscore, topk_groups), False)
            sel = g.masked_fill(drop.unsqueeze(-1), float("-inf")).view(t, e)
        ids = _stable_topk(sel, topk)
    w = s.gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, ids


@candidate("moe_gate", "torch_npu", "torch_npu.npu_moe_gating_top_k (V3 sigmoid groups); composed sqrt-softplus / "
           "hash (V4)", has_torch_npu("npu_moe_gating_top_k"))
def moe_gate(x, weight, bias, topk: int, route_scale: float, tid2eid=None, token_ids=None,
             score_func: str = "sqrtsoftplus", n_groups: int = 1, topk_groups: int = 1, normalize: bool = True):
    """Router logits by a float32 matmul, then ``npu_moe_gating_top_k`` where it applies exactly (see
    :func:`_npu_gating_applies`), else the composed form. Returns (weights [T, k] float32, ids [T, k] int64)."""
    logits = torch.matmul(x.float(), weight.float().t())
    e = logits.shape[-1]
    if logits.shape[0] == 0 or not _npu_gating_applies(score_func, tid2eid, normalize, e, topk, n_groups, topk_groups):
        return _composed_gate(logits, bias, topk, route_scale, tid2eid, token_ids, score_func, n_groups, topk_groups,
                              normalize)
    grouped = n_groups > 1
    y, idx, _ = torch_npu().npu_moe_gating_top_k(
        logits, topk, bias=None if bias is None else bias.float(), k_group=topk_groups if grouped else 1,
        group_count=n_groups if grouped else 1, group_select_mode=1, renorm=0,
        norm_type=1 if score_func == "sigmoid" else 0, out_flag=False, routed_scaling_factor=float(route_scale),
        eps=1e-20)
    return y.float(), idx.long()


@candidate("grouped_matmul", "torch_npu", "torch_npu.npu_grouped_matmul (group_list counts)",
           has_torch_npu("npu_grouped_matmul"))
def grouped_matmul(x, w, expert_ids, w_scale=None, fmt="dense"):
    """Rows sorted by expert (stable), one ``npu_grouped_matmul`` over ``x=[X (M, K)]``, ``weight=[W^T (E, K, N)]``
    (a transposed view of the [E, N, K] stack), ``group_list`` = per-expert row counts (group_list_type 1),
    ``group_type=0``, ``split_item=3``; rows scattered back, those of id E (past every group: undefined in the
    op's output) set to zero. FP8/FP4 stacks are dequantised first."""
    m = x.shape[0]
    e, n = w.shape[0], w.shape[1]
    if m == 0:
        return x.new_zeros((0, n))
    if fmt != "dense":
        w = dense_weight(w, w_scale, fmt)
    order = torch.argsort(expert_ids, stable=True)  # rows of id E (no expert here) last, past every group
    counts = torch.bincount(expert_ids, minlength=e + 1)[:e].to(torch.int64)
    xs = x[order]
    wt = w.transpose(1, 2)
    if xs.dtype != wt.dtype:
        xs = xs.to(wt.dtype)
    y = torch_npu().npu_grouped_matmul([xs], [wt], group_list=counts, split_item=3, group_type=0,
                                       group_list_type=1)[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out[order] = y.to(x.dtype)
    return out.masked_fill_((expert_ids >= e).unsqueeze(-1), 0)  # rows past the last group are undefined


@candidate("moe_permute", "torch_npu", "torch_npu.npu_moe_init_routing_v2 (dropless, row_idx_type 1)",
           has_torch_npu("npu_moe_init_routing_v2"))
def moe_permute(x, ids, num_experts: int):
    """``npu_moe_init_routing_v2(x, ids int32, active_num=T*k, expert_num=E, expert_tokens_num_type=1,
    expert_tokens_num_flag=True, row_idx_type=1)``: expanded_x = the permuted rows, expanded_row_idx = ``order``
    (row_idx_type 1: the scatter index), expert_tokens = per-expert counts, from which the sorted expert ids are
    ``repeat_interleave(arange(E), counts)`` (``output_size`` given: no host sync)."""
    t, k = ids.shape
    if t == 0 or k == 0:
        return x.new_zeros((0, x.shape[1])), ids.new_zeros(0, dtype=torch.int64), ids.new_zeros(0, dtype=torch.int64)
    e = int(num_experts)
    xs, order, counts, _ = torch_npu().npu_moe_init_routing_v2(
        x, ids.to(torch.int32), active_num=t * k, expert_num=e, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, row_idx_type=1)
    sorted_ids = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=t * k)
    return xs, sorted_ids, order.long()


@candidate("moe_unpermute", "torch_npu", "torch_npu.npu_moe_finalize_routing (drop_pad_mode 2, unit scales)",
           has_torch_npu("npu_moe_finalize_routing"))
def moe_unpermute(y, order, num_tokens: int, skip=None, out_dtype=None):
    """``npu_moe_finalize_routing(y, skip1=skip, None, None, scales=ones [T, k], expanded_src_to_dst_row, None,
    drop_pad_mode=2)``: ``out[t] = skip[t] + sum_j y[src2dst[t * k + j]]`` (drop_pad_mode 2: source position
    ``t * k + j``; the shared expert's output as ``skip1``, as the DeepSeek-V4 recipe passes it), ``src2dst`` the
    inverse of ``order`` (scattered on the device); float32 rows and skip in, float32 out, then ``out_dtype``.
    The op's documented formula adds skip1 before the rows (the reference: after): float32 rounding order only."""
    if num_tokens == 0 or y.shape[0] == 0:
        out = torch.zeros(num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
        out = out if skip is None else out + skip.float()
    else:
        k = y.shape[0] // num_tokens
        src2dst = torch.empty_like(order, dtype=torch.int32)
        src2dst[order] = torch.arange(order.numel(), dtype=torch.int32, device=order.device)
        ones = torch.ones(num_tokens, k, dtype=torch.float32, device=y.device)
        out = torch_npu().npu_moe_finalize_routing(y.float(), None if skip is None else skip.float(), None, None,
                                                   ones, src2dst, None, drop_pad_mode=2)
    return out if out_dtype is None else out.to(out_dtype)
