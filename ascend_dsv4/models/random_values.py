"""Seeded random tensor values for random-weight checkpoints of either family (tests and benchmarks): each tensor
from its own generator, scaled as :func:`ascend_dsv4.weights.random_init.init_random_` scales them."""

from __future__ import annotations

import zlib

import torch


def generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded by ``seed`` and the tensor name (so every layout of one seed holds the same values)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def random_value(name: str, shape: tuple[int, ...], cfg, g: torch.Generator) -> torch.Tensor:
    """Logical float32 (or int64) value of one official tensor (scales as init_random_ uses them)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        return torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]]
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    if len(shape) == 2 and (leaf == "weight" or leaf.endswith("_fn")):
        return torch.randn(shape, generator=g) * shape[-1] ** -0.5
    if leaf == "weight":  # norms
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if leaf.endswith("_scale"):
        return 1 + 0.2 * torch.randn(shape, generator=g)
    return 0.5 * torch.randn(shape, generator=g)  # hc bases, ape, attn_sink, gate.bias
