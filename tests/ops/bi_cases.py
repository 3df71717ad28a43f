"""Shared cases for the batch-invariance tests: every atb_ops op with row-indexable random inputs.

A case is ``(name, call, rows)``: ``call(sel)`` runs the op on the batch made of rows ``sel`` (an int64 index
tensor over the case's T rows; key lists and pools are shared), ``rows`` is T. Invariance: the output rows of
``call(sel)`` equal, bitwise, the same rows of ``call(all)``, for any ``sel`` (one row, a subset, a permutation).
"""

from __future__ import annotations

import torch

import atb_ops
from quant.fp8_block import quant_fp8_block


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pick(t, sel):
    return t.index_select(0, sel.to(t.device))


def cases(device: str = "cpu", seed: int = 0, T: int = 37):
    """All op cases on ``device`` (inputs bfloat16 where the model uses it)."""
    g = _g(seed)
    bf = torch.bfloat16

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def ri(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g).to(device)

    out = []
    x256 = r(T, 256, dtype=bf)
    out.append(("rms_norm", lambda s: atb_ops.rms_norm(_pick(x256, s), w_n, 1e-6)))
    w_n = r(256).abs()
    q3 = r(T, 4, 128, dtype=bf)
    out.append(("rms_norm_noweight", lambda s: atb_ops.rms_norm(_pick(q3, s), None, 1e-6)))
    pos = ri(0, 5000, T)
    inv = atb_ops.rope_inv_freq(64, 160000.0, 16.0, 4096, 32.0, 1.0)
    out.append(("apply_rope", lambda s: atb_ops.apply_rope(_pick(q3, s), _pick(pos, s), inv)))
    w_bf, w_f = r(96, 256, dtype=bf), r(96, 256)
    out.append(("linear_bf16", lambda s: atb_ops.linear(_pick(x256, s), w_bf)))
    out.append(("linear_fp32", lambda s: atb_ops.linear(_pick(x256, s).float(), w_f)))
    w8, s8 = quant_fp8_block(r(160, 256).cpu())
    w8, s8 = w8.to(device), s8.to(device)
    out.append(("linear_fp8_block", lambda s: atb_ops.linear(_pick(x256, s), w8, s8, "fp8_block")))
    out.append(("dequantize_weight", lambda s: atb_ops.dequantize_weight(_pick(w_bf, s))))
    wq = torch.randint(-127, 128, (256, 80), generator=g, dtype=torch.int8).to(device)  # [K, N] x2 layout
    qs, qoff, qb = r(80).abs() * 0.01, r(80), r(80)
    out.append(("quant_linear_weight_only", lambda s: atb_ops.quant_linear(_pick(x256, s), wq, "weight_only", qs,
                                                                           qb, qoff)))
    out.append(("quant_linear_dynamic", lambda s: atb_ops.quant_linear(_pick(x256, s), wq, "dynamic", qs, qb)))
    qis, qio, qbi = torch.tensor(0.02, device=device), torch.tensor(3.0, device=device), ri(-500, 500, 80)
    out.append(("quant_linear_static", lambda s: atb_ops.quant_linear(_pick(x256, s), wq, "static", qs, qbi,
                                                                      input_scale=qis, input_offset=qio)))
    wqe = torch.randint(-127, 128, (4, 256, 80), generator=g, dtype=torch.int8).to(device)
    qse, qeid = r(4, 80).abs() * 0.01, ri(0, 4, T)
    out.append(("quant_grouped_matmul", lambda s: atb_ops.quant_grouped_matmul(_pick(x256, s), wqe, _pick(qeid, s), qse)))
    we = r(6, 64, 256, dtype=bf)
    eid = ri(0, 6, T)
    out.append(("grouped_matmul", lambda s: atb_ops.grouped_matmul(_pick(x256, s), we, _pick(eid, s))))
    og, woa = r(T, 2, 64, dtype=bf), r(2, 48, 64, dtype=bf)
    out.append(("group_linear", lambda s: atb_ops.group_linear(_pick(og, s), woa)))
    wuk = r(4, 128, 40, dtype=bf)  # V3 W_UK [H, Dn, C] used transposed
    out.append(("group_linear_transposed", lambda s: atb_ops.group_linear(_pick(q3, s), wuk.transpose(1, 2))))
    out.append(("hadamard", lambda s: atb_ops.hadamard(_pick(q3, s))))
    xs = r(T, 4, 64, dtype=bf)
    fn, base, scale = r(24, 256) * 0.1, r(24), r(3)
    out.append(("hc_pre", lambda s: atb_ops.hc_pre(_pick(xs, s), fn, base, scale, 20, 1e-6, 1e-6)))
    y64, post, comb = r(T, 64, dtype=bf), r(T, 4).sigmoid(), r(T, 4, 4).softmax(-1)
    out.append(("hc_post", lambda s: atb_ops.hc_post(_pick(y64, s), _pick(xs, s), _pick(post, s), _pick(comb, s))))
    out.append(("hc_head", lambda s: atb_ops.hc_head(_pick(xs, s), fn[:4], base[:4], scale[:1], 1e-6, 1e-6)))
    gw, gb = r(16, 256, dtype=bf), r(16) * 0.1
    out.append(("moe_gate", lambda s: atb_ops.moe_gate(_pick(x256, s), gw, gb, 2, 1.5)))
    out.append(("moe_gate_grouped_sigmoid", lambda s: atb_ops.moe_gate(
        _pick(x256, s), gw, gb, 4, 2.5, score_func="sigmoid", n_groups=4, topk_groups=2)))
    out.append(("moe_gate_softmax", lambda s: atb_ops.moe_gate(_pick(x256, s), gw, None, 3, 1.0,
                                                                score_func="softmax", normalize=False)))
    tid2eid, toks = ri(0, 16, 50, 2), ri(0, 50, T)
    out.append(("moe_gate_hash", lambda s: atb_ops.moe_gate(_pick(x256, s), gw, None, 2, 1.5, tid2eid, _pick(toks, s))))
    gate, up = r(T, 64, dtype=bf) * 4, r(T, 64, dtype=bf) * 4
    out.append(("swiglu", lambda s: atb_ops.swiglu(_pick(gate, s), _pick(up, s), 7.0)))
    out.append(("fp8_act_round", lambda s: atb_ops.fp8_act_round(_pick(x256, s), 128)))
    out.append(("fp4_act_round", lambda s: atb_ops.fp4_act_round(_pick(x256, s), 32)))
    # compressor: one entry per row (the op's rows are entries)
    # width 64 without a GPU: the interpreter runs one program per (entry, column) reduction (256: 70 s of CI)
    cw = 256 if str(device).startswith("cuda") else 64
    kv_state, sc_state = r(200, cw), r(200, cw)
    cand8 = ri(0, 200, T, 8)
    cand8[:, :4][torch.rand(T, 4, generator=g).to(device) < 0.2] = -1
    out.append(("compressor_pool_overlap", lambda s: atb_ops.compressor_pool(kv_state, sc_state, _pick(cand8, s), True)))
    cand128 = ri(0, 200, T, 128)
    out.append(("compressor_pool", lambda s: atb_ops.compressor_pool(kv_state, sc_state, _pick(cand128, s), False)))
    # the state write: each token's rows land at its own slot; the case returns the rows written for the batch
    a_w, z_w, ape4 = r(T, 256), r(T, 256), r(4, 256)
    slots_w = torch.randperm(200, generator=g)[:T].to(device)

    def state_write(s):
        kv_p, sc_p = torch.zeros(200, 256, device=device), torch.zeros(200, 256, device=device)
        sl = _pick(slots_w, s)
        atb_ops.compressor_state_write(kv_p, sc_p, _pick(a_w, s), _pick(z_w, s), ape4, _pick(pos, s), sl)
        return torch.cat([kv_p[sl], sc_p[sl]], dim=1)

    out.append(("compressor_state_write", state_write))
    # indexer / attention: key lists with -1 holes; rows sharing pools
    kc = r(90, 128, dtype=bf)
    cand = ri(-1, 90, T, 40)
    wts = r(T, 4)
    out.append(("indexer_topk", lambda s: atb_ops.indexer_topk(_pick(q3, s), _pick(wts, s), kc, _pick(cand, s), 16)))
    kv = r(300, 128, dtype=bf)
    win = ri(-1, 300, T, 32)
    ekv = r(60, 128, dtype=bf)
    eidx = ri(-1, 60, T, 11)
    sink = r(4)
    out.append(("sparse_attention", lambda s: atb_ops.sparse_attention(_pick(q3, s), kv, _pick(win, s), sink, 0.09)))
    out.append(("sparse_attention_extra", lambda s: atb_ops.sparse_attention(
        _pick(q3, s), kv, _pick(win, s), sink, 0.09, ekv, _pick(eidx, s))))
    qa, qpe = r(T, 4, 64, dtype=bf), r(T, 4, 16, dtype=bf)
    latent = r(120, 80, dtype=bf)
    lidx = ri(-1, 120, T, 50)
    out.append(("mla_decode", lambda s: atb_ops.mla_decode(_pick(qa, s), _pick(qpe, s), latent, _pick(lidx, s), 0.1)))
    kn, kpe, vv = r(120, 4, 32, dtype=bf), r(120, 16, dtype=bf), r(120, 4, 24, dtype=bf)
    qn = r(T, 4, 32, dtype=bf)
    out.append(("mla_prefill", lambda s: atb_ops.mla_prefill(_pick(qn, s), _pick(qpe, s), kn, kpe, vv, _pick(lidx, s), 0.1)))
    c = qa.shape[-1]
    out.append(("mla_decode_split", lambda s: atb_ops.mla_decode_split(_pick(qa, s), _pick(qpe, s), latent[:, :c],
                                                                       latent[:, c:], _pick(lidx, s), 0.1)))
    res = r(T, 256, dtype=bf)
    out.append(("add_rms_norm", lambda s: atb_ops.add_rms_norm(_pick(x256, s), _pick(res, s), w_n, 1e-6)))
    kinv, koff = r(256).abs() + 0.5, torch.round(r(256))
    out.append(("kv_quant", lambda s: atb_ops.kv_quant(_pick(x256, s), kinv, koff)))
    rids = ri(0, 8, T, 3)

    def permute_roundtrip(s):  # grouped by expert, then summed back per token: per-token rows
        xs, _ids, order = atb_ops.moe_permute(_pick(x256, s), _pick(rids, s), 8)
        return atb_ops.moe_unpermute(xs.float() * 1.5, order, len(s))

    skip = r(T, 256, dtype=bf)

    def unpermute_skip(s):  # + the shared expert's output, rounded once
        xs, _ids, order = atb_ops.moe_permute(_pick(x256, s), _pick(rids, s), 8)
        return atb_ops.moe_unpermute(xs.float() * 1.5, order, len(s), _pick(skip, s), bf)

    out.append(("moe_permute_roundtrip", permute_roundtrip))
    out.append(("moe_unpermute", permute_roundtrip))
    out.append(("moe_unpermute skip", unpermute_skip))
    return out, T


def padded_key_cases(device: str = "cpu", seed: int = 1, T: int = 9, pad: int = 23):
    """(name, call(pad_cols)) for ops whose key / candidate list a ragged batch pads with -1 at the end:
    the result must not change, bitwise, with the number of padding columns."""
    g = _g(seed)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def padded(idx, n):
        return torch.cat([idx, torch.full((idx.shape[0], n), -1, dtype=idx.dtype, device=idx.device)], 1)

    q = r(T, 4, 128)
    kv, ekv, sink = r(300, 128), r(60, 128), r(4, dtype=torch.float32)
    win = torch.randint(-1, 300, (T, 32), generator=g).to(device)
    eidx = torch.randint(0, 60, (T, 7), generator=g).to(device)
    kc = r(90, 128)
    cand = torch.randint(0, 90, (T, 30), generator=g).to(device)
    wts = r(T, 4, dtype=torch.float32)
    qa, qpe, latent = r(T, 4, 64), r(T, 4, 16), r(120, 80)
    lidx = torch.randint(0, 120, (T, 21), generator=g).to(device)
    qn, kn, kpe, vv = r(T, 4, 32), r(120, 4, 32), r(120, 16), r(120, 4, 24)
    return [
        ("sparse_attention_extra", lambda n: atb_ops.sparse_attention(q, kv, win, sink, 0.09, ekv, padded(eidx, n))),
        ("indexer_topk", lambda n: atb_ops.indexer_topk(q, wts, kc, padded(cand, n), 16)),
        ("mla_decode", lambda n: atb_ops.mla_decode(qa, qpe, latent, padded(lidx, n), 0.1)),
        ("mla_prefill", lambda n: atb_ops.mla_prefill(qn, qpe, kn, kpe, vv, padded(lidx, n), 0.1)),
    ]
