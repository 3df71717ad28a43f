"""Emulated torch_npu attention ops: npu_fused_infer_attention_score (BSND subset) and npu_lightning_indexer."""

from __future__ import annotations

import torch

from .common import refuse

_FIA_UNSUPPORTED = ("pse_shift", "atten_mask", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
                    "quant_offset2", "antiquant_scale", "antiquant_offset", "query_padding_size",
                    "kv_padding_size", "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len",
                    "key_rope_antiquant_scale")


def _lengths(v, b: int, full: int, device) -> torch.Tensor:
    if v is None:
        return torch.full((b,), full, dtype=torch.int64, device=device)
    t = torch.as_tensor(list(v) if not isinstance(v, torch.Tensor) else v, dtype=torch.int64, device=device).reshape(-1)
    if t.numel() == 1 and b > 1:
        t = t.expand(b)
    return t


def _paged_rows(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, nkv: int) -> torch.Tensor:
    """PageAttention read: ``[B, maxBlocks * block_size, N_kv, D]`` from a paged cache (BnBsH ``[block_num,
    block_size, N_kv * D]`` or BnNBsD ``[block_num, N_kv, block_size, D]``); batch b's key j is row ``j %
    block_size`` of block ``block_table[b, j // block_size]`` (torch_npu doc, "page attention")."""
    if cache.dim() == 4:  # BnNBsD -> BnBsND
        cache = cache.transpose(1, 2)
    elif cache.dim() == 3:
        cache = cache.reshape(cache.shape[0], cache.shape[1], nkv, -1)
    else:
        refuse("npu_fused_infer_attention_score", f"a {cache.dim()}-D paged key/value (NZ layouts)")
    if cache.shape[1] != block_size:
        raise RuntimeError(f"npu_fused_infer_attention_score: block_size={block_size} but the paged cache has "
                           f"{cache.shape[1]} rows per block")
    bt = block_table.long().clamp(min=0)  # unused table entries are never read (masked by the lengths)
    g = cache[bt]  # [B, maxBlocks, bs, N_kv, D]
    return g.reshape(bt.shape[0], -1, g.shape[-2], g.shape[-1])


def _antiquant(kv: torch.Tensor, scale, offset, mode: int, nkv: int, what: str) -> torch.Tensor:
    """Pseudo-quant KV (int8 key / value): ``(kv + offset) * scale`` per channel (mode 0: ``N_kv * D`` values,
    any shape of that size, e.g. ``[1, N_kv * D]`` (BSH / BnBsH) or ``[N_kv, 1, D]``); the formula is the one
    the other antiquant ops document (``npu_weight_quant_batchmatmul``, ``npu_grouped_matmul``; FIA's doc does
    not restate it)."""
    if scale is None:
        if kv.dtype == torch.int8:
            refuse("npu_fused_infer_attention_score", f"int8 {what} without {what}_antiquant_scale")
        return kv.float()
    if mode != 0:
        refuse("npu_fused_infer_attention_score", f"{what}_antiquant_mode={mode} (only per-channel, 0)")
    if kv.dtype != torch.int8:
        raise RuntimeError(f"npu_fused_infer_attention_score: {what}_antiquant_scale needs an int8 {what}, "
                           f"got {kv.dtype}")
    d = kv.shape[-1]
    if scale.numel() != nkv * d or (offset is not None and offset.numel() != nkv * d):
        raise RuntimeError(f"npu_fused_infer_attention_score: per-channel {what} antiquant parameters need "
                           f"N_kv * D = {nkv * d} values, got {scale.numel()}"
                           f"{'' if offset is None else f' / {offset.numel()}'}")
    y = kv.float()
    if offset is not None:
        y = y + offset.float().reshape(nkv, d)
    return y * scale.float().reshape(nkv, d)


def npu_fused_infer_attention_score(query, key, value, *, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    query_rope=None, key_rope=None, num_heads: int = 1, scale: float = 1.0,
                                    pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
                                    input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
                                    inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
                                    softmax_lse_flag: bool = False, key_antiquant_mode: int = 0,
                                    value_antiquant_mode: int = 0, block_table=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, **unsupported):
    """FIA, the ``input_layout="BSND"`` unmasked form, contiguous or paged KV, float or per-channel int8 KV
    (torch_npu doc ``npu_fused_infer_attention_score``; op-plugin golden):

    ``score = scale * (q . k [+ q_rope . k_rope])`` per head (query_rope / key_rope: the MLA split, rope part
    scored separately), query head h reads kv head ``h // (N / N_kv)``; keys at positions ``>=
    actual_seq_lengths_kv[b]`` of batch b are excluded; ``out = softmax(score) @ v``. A batch with no key gets 0
    (documented for S2 = 0). ``scale`` defaults to 1.0 as in the op. q ``[B, S, N, D]``, k ``[B, S2, N_kv, D]``,
    v ``[B, S2, N_kv, Dv]``; returns ``(out [B, S, N, Dv] q.dtype, lse)``; lse ``[B, N, S, 1]`` float32 when
    ``softmax_lse_flag`` else an empty ``[0]`` placeholder.

    Paged KV (``block_table`` int32 ``[B, maxBlocks]`` + ``block_size``; ``actual_seq_lengths_kv`` required):
    key / value (and key_rope) are the caches ``[block_num, block_size, N_kv * D]`` (BnBsH; the only PA form
    with a BSND query) or ``[block_num, N_kv, block_size, D]``, read through :func:`_paged_rows`.
    int8 key / value with ``key_antiquant_scale`` / ``key_antiquant_offset`` (and the value ones), modes 0:
    dequantised per channel by :func:`_antiquant` before the scores.
    """
    bad = [k for k, v in unsupported.items() if v is not None]
    if bad:
        refuse("npu_fused_infer_attention_score", ", ".join(sorted(bad)))
    if input_layout != "BSND":
        refuse("npu_fused_infer_attention_score", f"input_layout={input_layout!r}")
    if sparse_mode != 0 or pre_tokens < 2147483647 or next_tokens < 2147483647:
        refuse("npu_fused_infer_attention_score", "masks / sparse_mode / pre_tokens / next_tokens")
    if actual_seq_lengths is not None:
        refuse("npu_fused_infer_attention_score", "actual_seq_lengths (query)")
    b, s, n, _ = query.shape
    nkv = num_key_value_heads if num_key_value_heads else n
    if block_table is not None:
        if actual_seq_lengths_kv is None or block_size <= 0:
            raise RuntimeError("npu_fused_infer_attention_score: page attention needs actual_seq_lengths_kv and "
                               "block_size")
        if block_table.shape[0] != b:
            raise RuntimeError(f"npu_fused_infer_attention_score: block_table has {block_table.shape[0]} rows for "
                               f"batch {b}")
        key = _paged_rows(key, block_table, block_size, nkv)
        value = _paged_rows(value, block_table, block_size, nkv)
        if key_rope is not None:
            key_rope = _paged_rows(key_rope, block_table, block_size, nkv)
    elif num_key_value_heads == 0:
        nkv = key.shape[2]
    s2 = key.shape[1]
    if n != num_heads or n % nkv:
        raise RuntimeError(f"npu_fused_infer_attention_score: num_heads={num_heads} vs query heads {n}, kv heads {nkv}")
    rep = n // nkv
    key = _antiquant(key, key_antiquant_scale, key_antiquant_offset, key_antiquant_mode, nkv, "key")
    value = _antiquant(value, value_antiquant_scale, value_antiquant_offset, value_antiquant_mode, nkv, "value")
    k = key.repeat_interleave(rep, dim=2)  # [B, S2, N, D]
    v = value.repeat_interleave(rep, dim=2)
    sc = torch.einsum("bsnd,btnd->bnst", query.float(), k)
    if query_rope is not None:
        kr = key_rope.float().repeat_interleave(rep, dim=2)
        sc = sc + torch.einsum("bsnd,btnd->bnst", query_rope.float(), kr)
    sc = sc * scale
    lens = _lengths(actual_seq_lengths_kv, b, s2, query.device)
    masked = torch.arange(s2, device=query.device).view(1, s2) >= lens.view(b, 1)  # [B, S2]
    sc = sc.masked_fill(masked.view(b, 1, 1, s2), float("-inf"))
    m = sc.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(sc - m)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("bnst,btnd->bsnd", p, v).to(query.dtype)
    if softmax_lse_flag:
        lse = (torch.log(den) + m).float()
    else:
        lse = torch.empty(0, dtype=torch.float32, device=query.device)
    return out, lse


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query: str = "BSND", layout_key: str = "BSND",
                          sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = 2**63 - 1,
                          next_tokens: int = 2**63 - 1, return_value: bool = False):
    """DSA lightning indexer, BSND query (torch_npu doc ``npu_lightning_indexer``; op-plugin golden).

    ``score[b, i, j] = sum_h weights[b, i, h] * relu(q[b, i, h] . k[b, j])`` (no softmax scale) over the first
    ``actual_seq_lengths_key[b]`` keys; ``sparse_mode=3`` also drops keys ``j > (Lk - Lq) + i``; the
    ``sparse_count`` best key positions in descending score order (stable: ties keep key order), ``-1`` where the
    batch has fewer keys. q ``[B, S1, N, D]``, k ``[B, S2, 1, D]`` (BSND) or the paged pool ``[blocks, block_size,
    1, D]`` with ``block_table [B, max_blocks]`` (PA_BSND), weights ``[B, S1, N]``. Returns
    ``(indices int32 [B, S1, 1, sparse_count], values)``; values are empty unless ``return_value``.
    """
    if layout_query != "BSND" or layout_key not in ("BSND", "PA_BSND") or \
            (block_table is None) != (layout_key == "BSND"):
        refuse("npu_lightning_indexer", "layouts other than BSND query with BSND or PA_BSND (+ block_table) key")
    if actual_seq_lengths_query is not None:
        refuse("npu_lightning_indexer", "actual_seq_lengths_query")
    if sparse_mode not in (0, 3) or pre_tokens < 2**63 - 1 or next_tokens < 2**63 - 1:
        refuse("npu_lightning_indexer", f"sparse_mode={sparse_mode} / pre_tokens / next_tokens")
    b, s1, n, _ = query.shape
    if block_table is not None:  # PageAttention: key [blocks, block_size, 1, D]; batch b's j-th key is in
        ps = key.shape[1]      # block block_table[b, j // ps] at offset j % ps
        s2 = block_table.shape[1] * ps
        j = torch.arange(s2, device=key.device)
        rows = block_table.long().repeat_interleave(ps, dim=1) * ps + j % ps  # [B, S2]
        key = key.reshape(-1, key.shape[-2], key.shape[-1])[rows]  # [B, S2, 1, D]
    s2 = key.shape[1]
    dots = torch.einsum("bihd,bjd->bihj", query.float(), key[:, :, 0].float()).relu()
    score = (dots * weights.float().unsqueeze(-1)).sum(2)  # [B, S1, S2]
    lens = _lengths(actual_seq_lengths_key, b, s2, query.device)
    j = torch.arange(s2, device=query.device)
    invalid = j.view(1, 1, s2) >= lens.view(b, 1, 1)
    if sparse_mode == 3:
        i = torch.arange(s1, device=query.device).view(1, s1, 1)
        invalid = invalid | (j.view(1, 1, s2) > (lens.view(b, 1, 1) - s1) + i)
    score = score.masked_fill(invalid, float("-inf"))
    order = torch.argsort(-score, dim=-1, stable=True)
    vals = score.gather(-1, order)
    kk = min(sparse_count, s2)
    idx = torch.where(torch.isneginf(vals[..., :kk]), torch.full_like(order[..., :kk], -1), order[..., :kk])
    out = torch.full((b, s1, 1, sparse_count), -1, dtype=torch.int32, device=query.device)
    out[:, :, 0, :kk] = idx.to(torch.int32)
    if return_value:
        values = torch.full((b, s1, 1, sparse_count), float("-inf"), dtype=query.dtype, device=query.device)
        values[:, :, 0, :kk] = vals[..., :kk].to(query.dtype)
    else:
        values = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, values


__all__ = ["npu_fused_infer_attention_score", "npu_lightning_indexer"]
