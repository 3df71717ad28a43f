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

    def normal(shape, std, mean=0.0, out=None):  # randn * std + mean, in place (into ``out`` when float32)
        v = torch.randn(shape, generator=g, dtype=torch.float32, out=out).mul_(std)
        return v.add_(mean) if mean else v

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        if name in ("embed.weight", "embed_tokens.weight"):
            std, mean = 1.0, 0.0
        elif leaf in ("w1", "w2", "w3"):  # stacked experts [E, out, in]
            std, mean = shape[-1] ** -0.5, 0.0
        elif leaf == "weight" and p.dim() == 2:
            std, mean = shape[-1] ** -0.5, 0.0
        elif leaf == "weight":  # norms
            std, mean = 0.1, 1.0
        elif leaf.endswith("_fn"):
            std, mean = shape[-1] ** -0.5, 0.0
        elif leaf.endswith("_base"):
            std, mean = 0.5, 0.0
        elif leaf.endswith("_scale"):
            std, mean = 0.2, 1.0
        elif leaf in ("attn_sink", "ape", "bias", "e_score_correction_bias"):
            std, mean = 0.5, 0.0
        else:
            raise KeyError(f"init_random_: no rule for parameter {name}")
        if p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu":  # (the generator's device)
            normal(shape, std, mean, out=p.data)
        else:
            p.copy_(normal(shape, std, mean))  # rounds to p's dtype as .to(p.dtype) does
    # float32-compute linears (V4's head, the compressors' wkv / wgate) hold BF16 values: the official checkpoint
    # stores them in BF16 and the official code upcasts them at load; a CUDA runner then stores them as BF16
    # (parallel.linear.compact_fp32_weights_: the Flash head reads 1.1 instead of 2.1 GB a step), as for a real model
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "compute_fp32", False) and isinstance(w, torch.Tensor) and w.dtype == torch.float32:
            _round_to_bf16_(w.data)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            # distinct experts per token id, as in the real tables
            b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
    return model


def _round_to_bf16_(w: torch.Tensor) -> None:
    """w (float32, finite) <- its values rounded to bfloat16 (nearest, ties to even), in place: the
    float32 bits plus 0x7FFF plus the kept part's lowest bit, the low 16 bits cleared (= w.bfloat16().float(), a
    few times faster on the CPU than the two conversions of a 2 GB head)."""
    if not w.is_contiguous():  # (the view below needs one block of memory)
        w.copy_(w.bfloat16().float())
        return
    bits = w.view(torch.int32)
    for part in bits.view(-1).split(1 << 24):  # bounded temporaries
        part.add_(((part >> 16) & 1).add_(0x7FFF)).bitwise_and_(-65536)  # -65536 = 0xFFFF0000
