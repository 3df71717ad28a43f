"""Device-generic batch-invariant variants of every atb_ops op (registered as ``reference`` variants).

Each variant computes the math of the reference op (``atb_ops.reference``; numerically close, not bitwise
equal: sums are ordered differently) using only the primitives of :mod:`.primitives` for every reduction
that is longer than a handful of elements, explicit in-order additions for the short ones (hyper-connection
streams, top-k weights), and elementwise or exact operations otherwise (max, comparisons, gathers, stable
sorts). Ops that are elementwise already and use only correctly rounded or vector-consistent functions (RoPE,
activation rounding) reuse the reference function; sigmoid, softplus and SiLU go through :func:`rowwise`.
Padded slots (-1 indices) contribute exact zeros at the END of a reduction, which the primitives ignore
bitwise: that is what makes a ragged batch's padding invisible to each row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register
from ..reference import quant_linear as ref_qlinear
from ..reference import quant_sim as ref_quant
from ..reference import rope as ref_rope
from ..reference.linear import dequant_weight, group_weight
from ..reference.quant_sim import _hadamard_matrix
from .primitives import BLOCK_N, bmm, matmul, row_sum

for _name, _fn in (("apply_rope", ref_rope.apply_rope), ("fp8_act_round", ref_quant.fp8_act_round),
                   ("fp4_act_round", ref_quant.fp4_act_round), ("dequantize_weight", dequant_weight)):
    register(_name, "reference", batch_invariant=True)(_fn)  # elementwise, exact maxima or exact sums: as is

VEC = 64


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise ``fn``, computed on rows padded to a multiple of ``VEC`` elements.

    PyTorch's CPU kernels compute the last (numel mod vector-width) elements of a contiguous run with a
    scalar function that rounds differently from the vectorised one for sigmoid, softplus, SiLU and log1p
    (measured); which elements fall in that tail depends on the batch size. Padded rows put every element
    at a fixed place in whole vectors.
    """
    n = x.shape[-1]
    extra = -n % VEC
    xp = F.pad(x, (0, extra)) if extra else x.contiguous()
    return fn(xp)[..., :n]


def seq_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over a SHORT dim as explicit additions in index order (x_0 + x_1) + x_2 ...: one order on any device."""
    n = x.shape[dim]
    if n == 0:
        out = x.sum(dim, keepdim=True) * 0
    else:
        out = x.narrow(dim, 0, 1)
        for i in range(1, n):
            out = out + x.narrow(dim, i, 1)
    return out if keepdim else out.squeeze(dim)


def last_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of any-rank x through :func:`row_sum`: float32, shape x.shape[:-1]."""
    return row_sum(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


def mean_sq(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last dim, keepdim, float32."""
    xf = x.float()
    return (last_sum(xf * xf) / xf.shape[-1]).unsqueeze(-1)


def softmax_last(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (exact max, :func:`row_sum` denominator)."""
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / last_sum(e).unsqueeze(-1)


def softmax_short(s: torch.Tensor, dim: int) -> torch.Tensor:
    e = torch.exp(s - s.amax(dim, keepdim=True))
    return e / seq_sum(e, dim, keepdim=True)


@register("swiglu", "reference", batch_invariant=True)
def swiglu(gate, up, limit):
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return rowwise(F.silu, g) * u


@register("rms_norm", "reference", batch_invariant=True)
def rms_norm(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(mean_sq(xf) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


# ---- linear ------------------------------------------------------------------------------------------
@register("linear", "reference", batch_invariant=True)
def linear(x, w, w_scale=None, fmt="dense"):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if fmt == "dense" and w.dtype == x.dtype:
        y = matmul(x2, w)
    else:
        y = matmul(x2.float(), dequant_weight(w, w_scale, fmt)).to(x.dtype)
    return y.view(*lead, y.shape[-1])


@register("group_linear", "reference", batch_invariant=True)
def group_linear(x, w, w_scale=None, fmt="dense"):
    w = group_weight(w, w_scale, fmt, x.dtype)
    if x.dtype != w.dtype:
        x, w = x.float(), w.float()
    if x.shape[0] == 0:
        return x.new_zeros((0, w.shape[0], w.shape[1]))
    return torch.stack([matmul(x[:, g], w[g]) for g in range(w.shape[0])], dim=1).to(x.dtype)


@register("quant_linear", "reference", batch_invariant=True)
def quant_linear(x, weight, mode, scale, bias=None, offset=None, input_scale=None, input_offset=None, group_size=0):
    if mode not in ref_qlinear.QUANT_MODES:
        raise ValueError(f"quant_linear: mode must be one of {ref_qlinear.QUANT_MODES}, got {mode!r}")
    w = ref_qlinear._int4_values(weight) if weight.dtype == torch.int32 else weight  # [K, N]
    if mode != "weight_only":
        # integer products summed in float64: exact (|sum| < 2^53), so the same in any order and on any device
        xf = x.float()
        if mode == "dynamic":
            s_t = xf.abs().amax(-1) / 127.0
            q = torch.round(xf / torch.where(s_t > 0, s_t, torch.ones_like(s_t)).unsqueeze(-1)).clamp(-128, 127)
        else:
            q = torch.round(xf * (1.0 / input_scale.float().reshape(())) + input_offset.float().reshape(()))
            q = q.clamp(-128, 127)
        acc = q.double() @ w.double()
        if mode == "static" and bias is not None:
            acc = acc + bias.double()
        ref_qlinear._check_int32(acc)
        if mode == "static":
            return (acc.float() * ref_qlinear._scale_f32(scale)).to(x.dtype)
        y = acc.float() * ref_qlinear._scale_f32(scale) * s_t.unsqueeze(-1)
        return (y if bias is None else y + bias.float()).to(x.dtype)
    k, n = w.shape
    if group_size > 0:
        def rep(t):
            return t.float().reshape(-1, n).repeat_interleave(group_size, dim=0)[:k]
    else:
        def rep(t):
            return t.float().reshape(1, n)
    wf = w.float() if offset is None else w.float() + rep(offset)
    x2 = x.reshape(-1, k).float()
    y = matmul(x2, (wf * rep(scale)).t())
    y = y if bias is None else y + bias.float()
    return y.view(*x.shape[:-1], n).to(x.dtype)


@register("quant_grouped_matmul", "reference", batch_invariant=True)
def quant_grouped_matmul(x, weight, expert_ids, scale):
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < weight.shape[0]:  # id E: no expert here, a zero row
            continue
        rows = (expert_ids == e).nonzero(as_tuple=True)[0]
        out[rows] = quant_linear(x[rows], weight[e], "dynamic", scale[e])
    return out


@register("grouped_matmul", "reference", batch_invariant=True)
def grouped_matmul(x, w, expert_ids, w_scale=None, fmt="dense"):
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for e in torch.unique(expert_ids).tolist():
        if not 0 <= e < w.shape[0]:  # id E: no expert here, a zero row
            continue
        rows = (expert_ids == e).nonzero(as_tuple=True)[0]
        we = dequant_weight(w[e], None if w_scale is None else w_scale[e], fmt)
        out[rows] = matmul(x[rows].float(), we).to(x.dtype)
    return out


@register("hadamard", "reference", batch_invariant=True)
def hadamard(x):
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two size, got {n}")
    h = _hadamard_matrix(n, x.device)  # symmetric: x @ H = x @ H^T
    y = matmul(x.reshape(-1, n).float(), h) * n**-0.5
    return y.view(x.shape).to(x.dtype)


# ---- hyper-connections ---------------------------------------------------------------------------------
def _mixes(x, fn, norm_eps):
    flat = x.flatten(-2).float()
    return matmul(flat, fn.float()) * torch.rsqrt(mean_sq(flat) + norm_eps)


def _sinkhorn_split(mixes, scale, base, n, iters, eps):
    scale, base = scale.float(), base.float()
    pre = rowwise(torch.sigmoid, mixes[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * rowwise(torch.sigmoid, mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = (mixes[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n)
    comb = softmax_short(comb, -1) + eps
    comb = comb / (seq_sum(comb, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (seq_sum(comb, -1, keepdim=True) + eps)
        comb = comb / (seq_sum(comb, -2, keepdim=True) + eps)
    return pre, post, comb


@register("hc_pre", "reference", batch_invariant=True)
def hc_pre(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    n = x.shape[-2]
    pre, post, comb = _sinkhorn_split(_mixes(x, fn, norm_eps), scale, base, n, sinkhorn_iters, hc_eps)
    return seq_sum(pre.unsqueeze(-1) * x.float(), -2).to(x.dtype), post, comb


@register("hc_post", "reference", batch_invariant=True)
def hc_post(y, x, post, comb):
    mixed = seq_sum(comb.float().unsqueeze(-1) * x.float().unsqueeze(2), 1)  # [T, N(k), d]: sum_j comb[j,k] x_j
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


@register("hc_head", "reference", batch_invariant=True)
def hc_head(x, fn, base, scale, hc_eps, norm_eps):
    pre = rowwise(torch.sigmoid, _mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return seq_sum(pre.unsqueeze(-1) * x.float(), -2).to(x.dtype)


# ---- MoE -----------------------------------------------------------------------------------------------
@register("moe_gate", "reference", batch_invariant=True)
def moe_gate(x, weight, bias, topk, route_scale, tid2eid=None, token_ids=None, score_func="sqrtsoftplus",
             n_groups=1, topk_groups=1, normalize=True):
    logits = matmul(x.float(), weight.float())
    if score_func == "sqrtsoftplus":
        scores = rowwise(F.softplus, logits).sqrt()
    elif score_func == "sigmoid":
        scores = rowwise(torch.sigmoid, logits)
    elif score_func == "softmax":
        scores = softmax_last(logits)
    else:
        raise ValueError(f"unknown score_func {score_func!r}")
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        sel = scores if bias is None else scores + bias.float()
        if n_groups > 1:
            t, e = sel.shape
            grouped = sel.view(t, n_groups, e // n_groups)
            group_score = seq_sum(grouped.topk(min(2, e // n_groups), dim=-1).values, -1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
            sel = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        ids = sel.topk(topk, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / seq_sum(w, -1, keepdim=True)
    return w * route_scale, ids


# ---- compressor / indexer ------------------------------------------------------------------------------
@register("compressor_pool", "reference", batch_invariant=True)
def compressor_pool(kv_state, score_state, cand, overlap):
    m, n_cand = cand.shape
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    if m == 0:
        return kv_state.new_zeros((0, c), dtype=torch.float32)
    valid = (cand >= 0).unsqueeze(-1)
    rows = cand.clamp(min=0)
    kv, sc = kv_state[rows].float(), score_state[rows].float()  # [M, K, width]
    if overlap:
        r = n_cand // 2
        kv = torch.cat([kv[:, :r, :c], kv[:, r:, c:]], dim=1)
        sc = torch.cat([sc[:, :r, :c], sc[:, r:, c:]], dim=1)
    sc = sc.masked_fill(~valid, float("-inf"))
    e = torch.exp(sc - sc.amax(1, keepdim=True))  # [M, K, c]
    num = last_sum((e * kv.masked_fill(~valid, 0.0)).transpose(1, 2))  # [M, c]
    return num / last_sum(e.transpose(1, 2))


@register("indexer_topk", "reference", batch_invariant=True)
def indexer_topk(q, weights, k_cache, cand, topk):
    t, n = cand.shape
    k = min(topk, n)
    if t == 0 or k == 0:
        return cand.new_full((t, k), -1)
    valid = cand >= 0
    keys = _gather(k_cache, _pad_keys(cand))  # [T, N', Di]
    dots = bmm(q.float(), keys)[:, :, :n].relu()  # [T, H, N]
    score = last_sum((dots * weights.float().unsqueeze(-1)).transpose(1, 2))  # [T, N]: sum over heads
    score = score.masked_fill(~valid, float("-inf"))
    vals, order = torch.sort(score, dim=-1, descending=True, stable=True)
    vals, order = vals[:, :k], order[:, :k]
    picked = cand.gather(1, order)
    return torch.where(torch.isneginf(vals), torch.full_like(picked, -1), picked)


# ---- attention -----------------------------------------------------------------------------------------
def _pad_keys(idx: torch.Tensor) -> torch.Tensor:
    """idx [T, L] padded with -1 to a whole number of key chunks (the primitives' blocks): the gathered rows
    then need no further copy."""
    extra = -idx.shape[-1] % BLOCK_N
    return F.pad(idx, (0, extra), value=-1) if extra else idx


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] in float32, padded (-1) slots zeroed: [T, L, ...]."""
    rows = x[idx.clamp(min=0)].float()
    return rows.masked_fill((idx < 0).view(*idx.shape, *([1] * (rows.dim() - 2))), 0.0)


def _attend(s: torch.Tensor, pad: torch.Tensor, v_t: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax(s) over the last dim (padded slots excluded, optional per-head sink in the denominator)
    times values: s [T, H, L] float32, pad [T, L], v_t [T, Dv, L] (values transposed, padded slots zero).
    Returns [T, H, Dv] float32; a row with no valid key and no sink gives 0."""
    s = s.masked_fill(pad.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.full_like(s[..., :1], float("-inf"))
    if sink is not None:
        sk = sink.float().view(1, -1, 1).expand_as(m)
        m = torch.maximum(m, sk)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # padded slots: exp(-inf) = 0
    denom = last_sum(e).unsqueeze(-1)
    if sink is not None:
        denom = denom + torch.exp(sk - m)
    o = bmm(e, v_t)
    return o / torch.where(denom > 0, denom, torch.ones_like(denom))


@register("sparse_attention", "reference", batch_invariant=True)
def sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    if extra_kv is not None and extra_idx is not None and extra_idx.shape[-1] > 0:
        # window keys first, then the compressed entries (a prefix of valid entries, -1 after them)
        idx, extra_idx = _pad_keys(idx), _pad_keys(extra_idx)
        rows = torch.cat([_gather(kv, idx), _gather(extra_kv, extra_idx)], dim=1)
        pad = torch.cat([idx < 0, extra_idx < 0], dim=1)
    else:
        idx = _pad_keys(idx)
        rows, pad = _gather(kv, idx), idx < 0
    s = bmm(q.float(), rows) * scale  # [T, H, K]
    return _attend(s, pad, rows.transpose(1, 2), sink).to(q.dtype)


@register("mla_decode", "reference", batch_invariant=True)
def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
    t, h, c = q_nope_absorbed.shape
    r = q_pe.shape[-1]
    if latent.shape[-1] != c + r:
        raise ValueError(f"mla_decode: latent last dim {latent.shape[-1]} != C + R = {c} + {r}")
    if t == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t, h, c)
    idx = _pad_keys(idx)
    rows = _gather(latent, idx)
    ckv, kpe = rows[..., :c], rows[..., c:]
    s = bmm(q_nope_absorbed.float(), ckv) + bmm(q_pe.float(), kpe)
    return _attend(s * scale, idx < 0, ckv.transpose(1, 2), None).to(q_nope_absorbed.dtype)


@register("mla_prefill", "reference", batch_invariant=True)
def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, idx, scale):
    t, h, dn = q_nope.shape
    dv = v.shape[-1]
    if t == 0 or idx.shape[-1] == 0:
        return q_nope.new_zeros(t, h, dv)
    idx = _pad_keys(idx)
    pad = idx < 0
    lk = idx.shape[-1]
    kn = _gather(k_nope, idx).permute(0, 2, 1, 3).reshape(t * h, lk, dn)  # [T*H, L, Dn]
    s = bmm(q_nope.float().reshape(t * h, 1, dn), kn).view(t, h, lk) + bmm(q_pe.float(), _gather(k_pe, idx))
    vt = _gather(v, idx).permute(0, 2, 3, 1)  # [T, H, Dv, L]
    s = (s * scale).masked_fill(pad.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = last_sum(e).unsqueeze(-1)
    o = bmm(e.reshape(t * h, 1, lk), vt.reshape(t * h, dv, lk)).view(t, h, dv)
    return (o / torch.where(denom > 0, denom, torch.ones_like(denom))).to(q_nope.dtype)
