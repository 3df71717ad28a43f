"""MTP module (ascend_dsv4/models/deepseek_v4/README.md §2.6): draft logits against a transformers decoder layer,
prefill vs decode, batching."""

from __future__ import annotations

import torch

from ascend_dsv4.models.deepseek_v4.names import official_to_hf
from v4_helpers import make_runner, rel_err, toy_cfg

T = 140


def _mtp_logits_by_steps(runner, ids, chunks):
    """Main model + MTP over ids[:T] run in the given chunks; MTP sees token t+1 at position t."""
    seq = runner.new_sequence()
    rows, pos = [], 0
    model = runner.model
    for n in chunks:
        _, streams, ctx, _ = runner.step([seq], [ids[pos:pos + n]], logits="all", return_streams=True)
        nxt = torch.tensor(ids[pos + 1:pos + n + 1])
        with torch.inference_mode():
            rows.append(model.mtp_logits(streams, nxt, ctx))
        pos += n
    runner.release(seq)
    return torch.cat(rows)


def test_mtp_prefill_equals_decode_and_depends_on_next_token():
    cfg = toy_cfg(index_topk=128)
    runner = make_runner(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    full = _mtp_logits_by_steps(runner, ids, [T])
    assert full.shape == (T, cfg.vocab_size)
    assert rel_err(_mtp_logits_by_steps(runner, ids, [50] + [1] * (T - 50)), full) < 1e-5
    assert rel_err(_mtp_logits_by_steps(runner, ids, [33, 64, 43]), full) < 1e-5
    other = list(ids)
    other[T] = (ids[T] + 1) % cfg.vocab_size  # only the last draft's next token changes
    alt = _mtp_logits_by_steps(runner, other, [T])
    assert torch.allclose(alt[:-1], full[:-1]) and not torch.allclose(alt[-1], full[-1])


@torch.no_grad()
def test_mtp_matches_a_transformers_decoder_layer():
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer, DeepseekV4HyperHead, DeepseekV4RotaryEmbedding)

    from hf_oracle import hf_config

    cfg = toy_cfg(index_topk=128)
    runner = make_runner(cfg, seed=6)
    model = runner.model
    ids = torch.randint(0, cfg.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(8)).tolist()
    ours = _mtp_logits_by_steps(runner, ids, [T])

    # an HF config whose layer n_layers is a plain sliding-window, top-k routed layer = the MTP block
    hcfg = hf_config(cfg.replace(n_layers=cfg.n_layers + 1, compress_ratios=cfg.compress_ratios + (0,)))
    hcfg._attn_implementation = "eager"
    L = cfg.n_layers
    layer = DeepseekV4DecoderLayer(hcfg, L).float().eval()
    head = DeepseekV4HyperHead(hcfg).float().eval()
    mtp = dict(model.mtp[0].named_parameters())
    hf_params = dict(layer.named_parameters()) | dict(layer.named_buffers())
    for name, p in mtp.items():
        if name.startswith(("e_proj", "h_proj", "enorm", "hnorm", "norm.", "hc_head")):
            continue
        if name.endswith("experts.w1"):
            hf_params["mlp.experts.gate_up_proj"].copy_(torch.cat([p, mtp[name[:-2] + "w3"]], 1))
            continue
        if name.endswith("experts.w3"):
            continue
        if name.endswith("experts.w2"):
            hf_params["mlp.experts.down_proj"].copy_(p)
            continue
        hf_name = official_to_hf(f"layers.{L}.{name}").removeprefix(f"model.layers.{L}.")
        hf_params[hf_name].copy_(p)
    head.hc_fn.copy_(mtp["hc_head_fn"])
    head.hc_base.copy_(mtp["hc_head_base"])
    head.hc_scale.copy_(mtp["hc_head_scale"])

    # main streams before hc_head, from our model (checked against transformers elsewhere)
    seq = runner.new_sequence()
    _, streams, _, _ = runner.step([seq], [ids[:T]], logits="none", return_streams=True)
    runner.release(seq)
    m0 = model.mtp[0]
    nxt = torch.tensor(ids[1:T + 1])
    x = m0.e_proj(m0.enorm(model.embed.weight[nxt])).unsqueeze(1) + m0.h_proj(m0.hnorm(streams))
    x = x[None]  # [1, T, N, d]
    pos = torch.arange(T)[None]
    rope = DeepseekV4RotaryEmbedding(hcfg)
    emb = {k: rope(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=hcfg, inputs_embeds=x[:, :, 0], attention_mask=None,
                                             past_key_values=None, position_ids=pos)
    y = layer(x, input_ids=nxt[None], position_embeddings=emb, position_ids=pos, attention_mask=mask)
    ref = model.head(m0.norm(head(y)))[0]
    assert rel_err(ours, ref) < 1e-4
