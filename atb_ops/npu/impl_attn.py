"""NPU implementations of the attention-side ops.

``indexer_topk`` -> ``npu_lightning_indexer``; ``mla_decode`` / ``mla_prefill`` -> ``npu_fused_infer_attention_score``
(MLA split: ``query_rope`` / ``key_rope``). The op surface hands over explicit key rows per token (``idx`` /
``cand``, -1 = padding), so each token runs as one batch of the fused op: its rows are gathered (valid rows first,
order kept) and ``actual_seq_lengths_kv`` / ``actual_seq_lengths_key`` say how many are valid. DeepSeek-V4's
sparse attention with a per-head sink, the mHC mixing and the compressor pooling have no A2/A3 op in torch_npu
(the torch_npu API documentation: they live in the vllm-ascend / cann-recipes custom packages), so they are composed from
torch ops on the device.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from .optable import candidate, has_torch_npu, on_soc, torch_npu

#: most gathered elements one call materialises; longer batches run in token chunks (the per-token gathers of
#: the explicit-index op surface would otherwise grow as tokens x context)
GATHER_BUDGET = int(os.environ.get("ASCEND_DSV4_NPU_GATHER_ELEMS", str(1 << 26)))


def _chunked(token_args: tuple[int, ...], per_token: Callable[..., int]):
    """Run ``fn`` over chunks of the token dim (args ``token_args``, the first one giving T) so that one chunk
    gathers at most :data:`GATHER_BUDGET` elements; outputs are concatenated along dim 0."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            t = args[token_args[0]].shape[0]
            step = max(1, GATHER_BUDGET // max(1, per_token(*args)))
            if t <= step:
                return fn(*args)
            outs = []
            for s in range(0, t, step):
                part = [a[s:s + step] if i in token_args and a is not None else a for i, a in enumerate(args)]
                outs.append(fn(*part))
            return torch.cat(outs)

        return wrapper

    return deco


def _valid_first(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx with its valid (>= 0) entries moved to the front, order kept; number of valid entries per row)."""
    valid = idx >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    return idx.gather(-1, order), valid.sum(-1)


def _gather_zero(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows[idx] with -1 slots zeroed (an unreferenced pool row may hold NaN)."""
    g = rows[idx.clamp(min=0)]
    return g.masked_fill((idx < 0).view(*idx.shape, *([1] * (g.dim() - idx.dim()))), 0)


# ---- mHC -----------------------------------------------------------------------------------------------------


def _mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = x.flatten(-2).float()
    inv = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    return torch.matmul(flat, fn.float().t()) * inv


@candidate("hc_pre", "composed", "torch ops (mix, sigmoid, Sinkhorn) on the device")
def hc_pre(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    t, n, _ = x.shape
    m = _mix(x, fn, norm_eps)
    sc, b = scale.float(), base.float()
    pre = torch.sigmoid(m[:, :n] * sc[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[:, n:2 * n] * sc[1] + b[n:2 * n])
    c = (m[:, 2 * n:] * sc[2] + b[2 * n:]).reshape(t, n, n).softmax(-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    u = torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)
    return u, post, c


def _mhc_fits(x: torch.Tensor) -> bool:
    """npu_mhc_* limits (torch_npu docs): n in {4, 6, 8}, D % 16 == 0, float16/bfloat16 x."""
    return x.dim() == 3 and x.shape[0] > 0 and x.shape[1] in (4, 6, 8) and x.shape[2] % 16 == 0 and \
        x.dtype in (torch.float16, torch.bfloat16)


@candidate("hc_pre", "torch_npu", "torch_npu.npu_mhc_pre + npu_mhc_sinkhorn (Ascend 950; else composed)",
           on_soc("Ascend950", "npu_mhc_pre", "npu_mhc_sinkhorn"))
def hc_pre_mhc(x, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """``npu_mhc_pre`` (mix, pre/post gates, h_res logits) + ``npu_mhc_sinkhorn`` (the comb matrix)."""
    if not _mhc_fits(x) or not 0 < sinkhorn_iters <= 100:
        return hc_pre(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    tn = torch_npu()
    h_in, h_post, h_res, _, _, _ = tn.npu_mhc_pre(x, fn.float(), scale.float(), base.float(), norm_eps=norm_eps,
                                                  hc_eps=hc_eps)
    comb, _, _ = tn.npu_mhc_sinkhorn(h_res, eps=hc_eps, num_iters=int(sinkhorn_iters))
    return h_in, h_post, comb


@candidate("hc_post", "torch_npu", "torch_npu.npu_mhc_post (Ascend 950; else composed)",
           on_soc("Ascend950", "npu_mhc_post"))
def hc_post_mhc(y, x, post, comb):
    if not _mhc_fits(x):
        return hc_post(y, x, post, comb)
    return torch_npu().npu_mhc_post(x, comb.float(), y.to(x.dtype), post.float())


@candidate("hc_post", "composed", "torch.baddbmm on the device")
def hc_post(y, x, post, comb):
    out = torch.baddbmm(post.float().unsqueeze(-1) * y.float().unsqueeze(1), comb.float().transpose(1, 2), x.float())
    return out.to(x.dtype)


@candidate("hc_head", "composed", "torch ops on the device")
def hc_head(x, fn, base, scale, hc_eps: float, norm_eps: float):
    pre = torch.sigmoid(_mix(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)


# ---- compressor and indexer ----------------------------------------------------------------------------------


@candidate("compressor_pool", "composed", "torch gather + softmax on the device")
@_chunked((2,), lambda kv, sc, cand, overlap: 2 * cand.shape[1] * kv.shape[-1])
def compressor_pool(kv_state, score_state, cand, overlap: bool):
    m, k = cand.shape
    width = kv_state.shape[-1]
    c = width // 2 if overlap else width
    if m == 0:
        return kv_state.new_zeros((0, c), dtype=torch.float32)
    kv = _gather_zero(kv_state.float(), cand)  # [M, K, W]
    sc = _gather_zero(score_state.float(), cand)
    if overlap:
        r = k // 2
        kv = torch.cat([kv[:, :r, :c], kv[:, r:, c:]], dim=1)
        sc = torch.cat([sc[:, :r, :c], sc[:, r:, c:]], dim=1)
    sc = sc.masked_fill((cand < 0).unsqueeze(-1), float("-inf"))
    return (torch.softmax(sc, dim=1) * kv).sum(1)


@candidate("compressor_state_write", "composed", "index_copy_ + index_select + add on the device")
def compressor_state_write(kv_state, score_state, a, z, ape, positions, slots):
    """Two row scatters (aclnnIndexCopy) and the positional bias gathered by phase: no fused NPU op does this."""
    phase = torch.remainder(positions, ape.shape[0])
    kv_state.index_copy_(0, slots, a.to(kv_state.dtype))
    score_state.index_copy_(0, slots, (z.float() + ape.float().index_select(0, phase)).to(score_state.dtype))


#: page sizes tried when reading a key pool in place through a block table (largest first)
PAGE_SIZES = (128, 64, 32, 16)


def _as_pages(rows: torch.Tensor, counts: torch.Tensor, pool_rows: int):
    """``(page_size, block_table [T, pages] int32)`` when every token's valid rows (valid first, ``counts`` of them)
    are whole consecutive pages of a paged pool: ``rows[t, j] = table[t, j // ps] * ps + j % ps``; else None.
    Then the fused op reads the pool in place instead of a per-token gathered copy."""
    t, n = rows.shape
    if t == 0 or n == 0:
        return None
    j = torch.arange(n, device=rows.device)
    valid = j.unsqueeze(0) < counts.unsqueeze(1)
    for ps in PAGE_SIZES:
        if pool_rows % ps:
            continue
        first = rows[:, ::ps]
        if not bool(((first % ps == 0) | (first < 0)).all()):
            continue
        table = torch.where(first >= 0, first // ps, torch.zeros_like(first))
        expect = table.repeat_interleave(ps, dim=1)[:, :n] * ps + j % ps
        if bool(((expect == rows) | ~valid).all()):
            return ps, table.to(torch.int32)
    return None


@candidate("indexer_topk", "torch_npu", "torch_npu.npu_lightning_indexer (paged keys in place, else gathered)",
           has_torch_npu("npu_lightning_indexer"))
@_chunked((0, 1, 3), lambda q, w, kc, cand, topk: cand.shape[1] * kc.shape[-1])
def indexer_topk(q, weights, k_cache, cand, topk: int):
    """``npu_lightning_indexer`` with query ``[T, 1, Hi, Di]`` (BSND, a batch per token), weights ``[T, 1, Hi]``,
    ``actual_seq_lengths_key`` = valid candidates, ``sparse_mode=0`` (the candidates are already causal),
    ``sparse_count = min(topk, N)``. Keys: when the candidate rows are whole pages of ``k_cache``, the pool itself
    (``PA_BSND`` ``[P / ps, ps, 1, Di]`` with a ``block_table``); otherwise the token's rows gathered ``[T, N, 1,
    Di]`` (valid first). The returned positions map back through the candidate list (-1 stays -1)."""
    t, n = cand.shape
    k = min(topk, n)
    if t == 0 or k == 0:
        return cand.new_full((t, k), -1)
    cc, counts = _valid_first(cand)
    paged = _as_pages(cc, counts, k_cache.shape[0]) if k_cache.is_contiguous() else None
    tn = torch_npu()
    if paged is not None:
        ps, table = paged
        pos, _ = tn.npu_lightning_indexer(
            q.unsqueeze(1), k_cache.view(-1, ps, 1, k_cache.shape[-1]), weights.unsqueeze(1),
            actual_seq_lengths_key=counts.to(torch.int32), block_table=table, layout_query="BSND",
            layout_key="PA_BSND", sparse_count=k, sparse_mode=0)
    else:
        keys = _gather_zero(k_cache, cc)  # [T, N, Di]
        pos, _ = tn.npu_lightning_indexer(
            q.unsqueeze(1), keys.unsqueeze(2), weights.unsqueeze(1), actual_seq_lengths_key=counts.to(torch.int32),
            layout_query="BSND", layout_key="BSND", sparse_count=k, sparse_mode=0)
    pos = pos[:, 0, 0, :].long()
    picked = cc.gather(1, pos.clamp(min=0))
    return torch.where(pos < 0, torch.full_like(picked, -1), picked)


# ---- sparse attention with a sink (DeepSeek-V4) ---------------------------------------------------------------


@candidate("sparse_attention", "composed", "torch gather + sink softmax on the device")
@_chunked((0, 2, 6), lambda q, kv, idx, sink, scale, ekv=None, eidx=None:
          (idx.shape[1] + (0 if eidx is None else eidx.shape[1])) * kv.shape[-1])
def sparse_attention(q, kv, idx, sink, scale: float, extra_kv=None, extra_idx=None):
    rows = _gather_zero(kv, idx).float()  # [T, K, D]
    bad = idx < 0
    if extra_kv is not None and extra_idx is not None and extra_idx.shape[-1] > 0:
        rows = torch.cat([rows, _gather_zero(extra_kv, extra_idx).float()], dim=1)
        bad = torch.cat([bad, extra_idx < 0], dim=1)
    s = torch.matmul(q.float(), rows.transpose(1, 2)) * scale  # [T, H, K]
    s = s.masked_fill(bad.unsqueeze(1), float("-inf"))
    snk = sink.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    mx = torch.maximum(s.amax(-1, keepdim=True), snk)
    e = torch.exp(s - mx)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(snk - mx))
    return torch.matmul(p, rows).to(q.dtype)


# ---- MLA (DeepSeek-V3) ---------------------------------------------------------------------------------------


@candidate("mla_decode", "torch_npu", "torch_npu.npu_fused_infer_attention_score (MLA query_rope/key_rope)",
           has_torch_npu("npu_fused_infer_attention_score"))
@_chunked((0, 1, 3), lambda qa, qp, lat, idx, scale: idx.shape[1] * lat.shape[-1])
def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale: float):
    """FIA, BSND, one batch per token: query ``[T, 1, H, C]`` + query_rope ``[T, 1, H, R]``; key = value = the
    gathered latent ``c_kv`` rows ``[T, L, 1, C]`` (absorbed MLA: V = K_nope), key_rope ``[T, L, 1, R]``;
    ``num_key_value_heads=1``, ``actual_seq_lengths_kv`` = valid rows. Tokens without a row return 0."""
    t, h, c = q_nope_absorbed.shape
    if latent.shape[-1] != c + q_pe.shape[-1]:
        raise ValueError(f"mla_decode: latent last dim {latent.shape[-1]} != C + R = {c} + {q_pe.shape[-1]}")
    if t == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t, h, c)
    ii, counts = _valid_first(idx)
    rows = _gather_zero(latent, ii)  # [T, L, C + R]
    ckv = rows[..., :c].unsqueeze(2).to(q_nope_absorbed.dtype)
    kpe = rows[..., c:].unsqueeze(2).to(q_pe.dtype)
    out, _ = torch_npu().npu_fused_infer_attention_score(
        q_nope_absorbed.unsqueeze(1), ckv, ckv, query_rope=q_pe.unsqueeze(1), key_rope=kpe,
        actual_seq_lengths_kv=counts.tolist(), num_heads=h, num_key_value_heads=1, scale=float(scale),
        input_layout="BSND", sparse_mode=0)
    return out[:, 0].masked_fill((counts == 0).view(t, 1, 1), 0).to(q_nope_absorbed.dtype)


@candidate("mla_decode_split", "torch_npu", "torch_npu.npu_fused_infer_attention_score (paged MLA: nope / rope "
           "caches + block_table; else gathered)", has_torch_npu("npu_fused_infer_attention_score"))
@_chunked((0, 1, 4), lambda qa, qp, ckv, kpe, idx, scale: idx.shape[1] * (ckv.shape[-1] + kpe.shape[-1]))
def mla_decode_split(q_nope_absorbed, q_pe, c_kv, k_pe, idx, scale: float):
    """FIA's documented paged MLA form, one batch per token: query ``[T, 1, H, C]`` + query_rope ``[T, 1, H, R]``
    (BSND); key = value = the ``c_kv`` cache viewed ``[P / ps, ps, C]`` and key_rope the ``k_pe`` cache ``[P / ps,
    ps, R]`` (BnBsH, KV_N = 1: the caches themselves, no copy; FIA takes no non-contiguous key, which is why the
    pool keeps them apart), ``block_table`` [T, pages] int32 + ``block_size = ps``, ``actual_seq_lengths_kv`` =
    valid rows. Used when every token's rows (valid first) are whole consecutive pages of the pool (a sequence's
    context always is); otherwise the rows are gathered as in ``mla_decode``. The query runs in the cache dtype
    (the op takes one dtype); tokens without a row return 0."""
    t, h, c = q_nope_absorbed.shape
    r = q_pe.shape[-1]
    if c_kv.shape[-1] != c or k_pe.shape[-1] != r:
        raise ValueError(f"mla_decode_split: c_kv {list(c_kv.shape)} / k_pe {list(k_pe.shape)} vs C = {c}, R = {r}")
    if t == 0 or idx.shape[-1] == 0:
        return q_nope_absorbed.new_zeros(t, h, c)
    ii, counts = _valid_first(idx)
    contiguous = c_kv.is_contiguous() and k_pe.is_contiguous() and c_kv.dtype == k_pe.dtype
    paged = _as_pages(ii, counts, c_kv.shape[0]) if contiguous else None
    tn = torch_npu()
    if paged is not None:
        ps, table = paged
        cache = c_kv.view(-1, ps, c)
        out, _ = tn.npu_fused_infer_attention_score(
            q_nope_absorbed.to(c_kv.dtype).unsqueeze(1), cache, cache, query_rope=q_pe.to(c_kv.dtype).unsqueeze(1),
            key_rope=k_pe.view(-1, ps, r), block_table=table, block_size=ps, actual_seq_lengths_kv=counts.tolist(),
            num_heads=h, num_key_value_heads=1, scale=float(scale), input_layout="BSND", sparse_mode=0)
    else:
        ckv = _gather_zero(c_kv, ii).unsqueeze(2).to(q_nope_absorbed.dtype)  # [T, L, 1, C]
        kpe = _gather_zero(k_pe, ii).unsqueeze(2).to(q_pe.dtype)
        out, _ = tn.npu_fused_infer_attention_score(
            q_nope_absorbed.unsqueeze(1), ckv, ckv, query_rope=q_pe.unsqueeze(1), key_rope=kpe,
            actual_seq_lengths_kv=counts.tolist(), num_heads=h, num_key_value_heads=1, scale=float(scale),
            input_layout="BSND", sparse_mode=0)
    return out[:, 0].masked_fill((counts == 0).view(t, 1, 1), 0).to(q_nope_absorbed.dtype)


@candidate("mla_prefill", "torch_npu", "torch_npu.npu_fused_infer_attention_score (query_rope/key_rope)",
           has_torch_npu("npu_fused_infer_attention_score"))
@_chunked((0, 1, 5), lambda qn, qp, kn, kp, v, idx, scale:
          idx.shape[1] * kn.shape[1] * (kn.shape[-1] + v.shape[-1] + kp.shape[-1]))
def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, idx, scale: float):
    """FIA, BSND, one batch per token: query ``[T, 1, H, Dn]`` + query_rope ``[T, 1, H, R]``; key / value the
    gathered per-head rows ``[T, L, H, Dn]`` / ``[T, L, H, Dv]``; key_rope = the shared k_pe rows broadcast to
    the H kv heads; ``actual_seq_lengths_kv`` = valid rows."""
    t, h, _ = q_nope.shape
    dv = v.shape[-1]
    if t == 0 or idx.shape[-1] == 0:
        return q_nope.new_zeros(t, h, dv)
    ii, counts = _valid_first(idx)
    kn = _gather_zero(k_nope, ii).to(q_nope.dtype)  # [T, L, H, Dn]
    vv = _gather_zero(v, ii).to(q_nope.dtype)
    kp = _gather_zero(k_pe, ii).to(q_pe.dtype)  # [T, L, R]
    kp = kp.unsqueeze(2).expand(-1, -1, h, -1).contiguous()
    out, _ = torch_npu().npu_fused_infer_attention_score(
        q_nope.unsqueeze(1), kn, vv, query_rope=q_pe.unsqueeze(1), key_rope=kp,
        actual_seq_lengths_kv=counts.tolist(), num_heads=h, num_key_value_heads=h, scale=float(scale),
        input_layout="BSND", sparse_mode=0)
    return out[:, 0].masked_fill((counts == 0).view(t, 1, 1), 0).to(q_nope.dtype)
