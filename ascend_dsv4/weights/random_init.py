"""Deterministic random weights for a DeepSeek-V4 model (the embedded toy model and tests).

Scales keep activations O(1) through the depth of the toy model: linear weights ~ N(0, 1/fan_in),
norm weights near 1, non-zero biases / sinks / ape / hc bases so that every term of the math is exercised.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        if name in ("embed.weight", "embed_tokens.weight"):
            v = normal(shape, 1.0)
        elif leaf in ("w1", "w2", "w3"):  # stacked experts [E, out, in]
            v = normal(shape, shape[-1] ** -0.5)
        elif leaf == "weight" and p.dim() == 2:
            v = normal(shape, shape[-1] ** -0.5)
        elif leaf == "weight":  # norms
            v = normal(shape, 0.1, 1.0)
        elif leaf.endswith("_fn"):
            v = normal(shape, shape[-1] ** -0.5)
        elif leaf.endswith("_base"):
            v = normal(shape, 0.5)
        elif leaf.endswith("_scale"):
            v = normal(shape, 0.2, 1.0)
        elif leaf in ("attn_sink", "ape", "bias", "e_score_correction_bias"):
            v = normal(shape, 0.5)
        else:
            raise KeyError(f"init_random_: no rule for parameter {name}")
        p.copy_(v.to(p.dtype))
    # float32-compute linears (V4's head, the compressors' wkv / wgate) hold BF16 values: the official checkpoint
    # stores them in BF16 and the official code upcasts them at load; a CUDA runner then stores them as BF16
    # (parallel.linear.compact_fp32_weights_: the Flash head reads 1.1 instead of 2.1 GB a step), as for a real model
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "compute_fp32", False) and isinstance(w, torch.Tensor) and w.dtype == torch.float32:
            w.copy_(w.bfloat16().float())
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            # distinct experts per token id, as in the real tables
            b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
    return model
