"""msModelSlim C8 KV (``kv_cache_scale`` / ``kv_cache_offset`` of k_proj / v_proj) on the NPU backend, under the
torch_npu emulation and the wheel's contracts, on the real msModelSlim C8 fixtures (tests/fixtures/msmodelslim).

Neither model family of the package reads C8 KV (DeepSeek MLA has no k_proj / v_proj; msModelSlim's MLA KV
quantisation is the separate ``FAKQuant``, which no fixture or reader here covers), and the C8 fixtures are
Llama models, which the package does not serve. What exists is the quantiser (``quant.msmodelslim.KVCacheQuant``)
and the Llama forward of tests/quant/test_msm_fixture_logits.py. So this test runs that forward (written again
here, the same HF-Llama math) twice:

* reference: the checkpoint's QuantLinears (int path) and ``ck.kv_cache(..., reciprocal=True)`` (quantise then
  dequantise), float causal attention;
* NPU: the linears in NPU form (``to_npu_linear`` -> ``atb_ops.quant_linear`` -> npu_quantize + npu_quant_matmul),
  K / V quantised by ``to_npu_kv_cache`` (``atb_ops.kv_quant`` -> npu_quantize) into a paged int8 cache
  ``[blocks, block_size, KV * hd]`` (BnBsH, non-contiguous pages per sequence), attention by
  ``npu_fused_infer_attention_score``'s paged form with per-channel antiquant (one query token per batch row,
  ``actual_seq_lengths_kv`` = its position + 1: the causal read of a decode step).

Logits: NPU vs reference tight <= 1e-5 (the same integers; float32 model), and the v1 cases (whose fake-quant
applies C8) vs msModelSlim's own fake-quant logits within the int-path tolerance
tests/quant/test_msm_fixture_logits.py uses (tight <= 1e-5).
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import atb_ops

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "msmodelslim")
CASES = ["w8a8_c8_sym_v0", "w8a8_c8_asym_v0", "w8a8_c8_sym_v1", "w8a8_c8_asym_v1"]
TIGHT = 1e-5
BLOCK = 32  # FIA page attention: block_size a multiple of 16 (32 for int8 KV is the safe choice)


def _tight(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _rope(T, d, theta):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = torch.arange(T).float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _paged_attention_c8(q, kq, vq, kc8, vc8, H, KV, hd, tn):
    """q [B, T, H, hd]; kq / vq NpuKVCacheQuant; kc8 / vc8 float K / V [B, T, KV * hd] -> [B, T, H * hd]."""
    B, T = q.shape[:2]
    nblk = -(-T // BLOCK)
    # sequence b's pages: blocks b*nblk .. reversed (non-contiguous order), plus a spare block
    tables = torch.tensor([[b * nblk + (nblk - 1 - i) for i in range(nblk)] for b in range(B)], dtype=torch.int32)
    kcache = torch.zeros(B * nblk + 1, BLOCK, KV * hd, dtype=torch.int8)
    vcache = torch.zeros_like(kcache)
    pos = torch.arange(T)
    for b in range(B):  # slot = page * BLOCK + offset (the pools' slot arithmetic)
        slot = tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        kcache.view(-1, KV * hd).index_copy_(0, slot, kq.quantize(kc8[b]))
        vcache.view(-1, KV * hd).index_copy_(0, slot, vq.quantize(vc8[b]))
    bt = tables.repeat_interleave(T, dim=0)  # one batch row per query token
    lens = (pos + 1).repeat(B)
    aq = lambda t: t.reshape(1, KV * hd)  # noqa: E731
    out, _ = tn.npu_fused_infer_attention_score(
        q.reshape(B * T, 1, H, hd), kcache, vcache, block_table=bt, block_size=BLOCK,
        actual_seq_lengths_kv=lens.tolist(), num_heads=H, num_key_value_heads=KV, scale=1.0 / math.sqrt(hd),
        input_layout="BSND", key_antiquant_scale=aq(kq.antiquant_scale),
        key_antiquant_offset=None if kq.antiquant_offset is None else aq(kq.antiquant_offset),
        value_antiquant_scale=aq(vq.antiquant_scale),
        value_antiquant_offset=None if vq.antiquant_offset is None else aq(vq.antiquant_offset),
        key_antiquant_mode=0, value_antiquant_mode=0)
    return out.reshape(B, T, H * hd)


def llama_logits(ck, cfg, ids, npu: bool, tn=None):
    from ascend_dsv4.weights.msm_npu import to_npu_kv_cache, to_npu_linear

    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    B, T = ids.shape

    def lin(n):
        ql = ck.linear(n, path="int")
        if not npu:
            return ql
        nl = to_npu_linear(ql, torch.float32)
        assert nl is not None, n
        return lambda x: nl(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    x = ck.tensor("model.embed_tokens.weight").float()[ids]
    cos, sin = _rope(T, hd, cfg.get("rope_theta", 10000.0))
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = ck.norm(p + "input_layernorm", eps=eps)(x)
        q = lin(p + "self_attn.q_proj")(h).view(B, T, H, hd)
        k = lin(p + "self_attn.k_proj")(h).view(B, T, KV, hd)
        v = lin(p + "self_attn.v_proj")(h).view(B, T, KV, hd)
        c, s = cos.view(1, T, 1, hd), sin.view(1, T, 1, hd)
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        kq = ck.kv_cache(p + "self_attn.k_proj", reciprocal=True)
        vq = ck.kv_cache(p + "self_attn.v_proj", reciprocal=True)
        if npu:
            a = _paged_attention_c8(q, to_npu_kv_cache(kq), to_npu_kv_cache(vq), k.reshape(B, T, KV * hd),
                                    v.reshape(B, T, KV * hd), H, KV, hd, tn)
        else:
            k = kq(k.reshape(B, T, KV * hd)).view(B, T, KV, hd).repeat_interleave(H // KV, 2)
            v = vq(v.reshape(B, T, KV * hd)).view(B, T, KV, hd).repeat_interleave(H // KV, 2)
            sc = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(hd) + mask
            a = torch.einsum("bhst,bthd->bshd", torch.softmax(sc, -1), v).reshape(B, T, H * hd)
        x = x + lin(p + "self_attn.o_proj")(a)
        h = ck.norm(p + "post_attention_layernorm", eps=eps)(x)
        act = torch.nn.functional.silu(lin(p + "mlp.gate_proj")(h)) * lin(p + "mlp.up_proj")(h)
        x = x + lin(p + "mlp.down_proj")(act)
    return ck.linear("lm_head", path="float")(ck.norm("model.norm", eps=eps)(x)).float()


@pytest.mark.parametrize("case", CASES)
def test_c8_fixture_on_npu(case, emu, checker):
    import quant.msmodelslim as msm

    folder = os.path.join(ROOT, case)
    if not os.path.isdir(folder):
        pytest.skip(f"no msModelSlim fixture {case}")
    cfg = json.load(open(os.path.join(folder, "config.json")))
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    ids = ref["input_ids"]
    with msm.load(folder) as ck:
        assert ck.kv_cache_type == "C8" and ck.layout.kv
        y_ref = llama_logits(ck, cfg, ids, npu=False)
        with atb_ops.use_backend("npu"):
            y_npu = llama_logits(ck, cfg, ids, npu=True, tn=emu)
    assert _tight(y_npu, y_ref) <= TIGHT, (case, _tight(y_npu, y_ref))
    if case.endswith("_v1"):  # v1's fake-quant applies C8; v0's single prefill does not
        assert _tight(y_npu, ref["fakequant_logits"]) <= TIGHT, (case, _tight(y_npu, ref["fakequant_logits"]))
    assert not checker.violations, checker.violations
    for op in ("npu_quantize", "npu_quant_matmul", "npu_fused_infer_attention_score"):
        assert checker.ops[op].checked > 0, op
    from atb_ops.npu import optable

    assert optable.table()["kv_quant"].kind == "torch_npu" and optable.table()["kv_quant"].calls > 0


def test_npu_kv_cache_params_round_trip():
    from quant.msmodelslim.npu_params import npu_kv_cache_params
    from quant.msmodelslim.schemes import KVCacheQuant

    g = torch.Generator().manual_seed(0)
    s, o = 0.01 + torch.rand(8, generator=g) * 0.02, torch.randint(-4, 5, (8,), generator=g).float()
    p = npu_kv_cache_params(s, o)
    kq = KVCacheQuant(s, o, reciprocal=True)
    x = torch.randn(6, 8, generator=g)
    q = kq.quantize(x)
    assert torch.equal(atb_ops.kv_quant(x, p["quant_scale"], p["quant_offset"]), q)
    assert torch.allclose((q.float() + p["antiquant_offset"]) * p["antiquant_scale"], kq.dequantize(q))
    assert torch.equal(p["antiquant_offset"], -o)
