"""Which slice of each checkpoint tensor a tensor-/expert-parallel rank's model holds.

The parallel modules describe themselves (``parallel.layers``: ``shard_dim`` + ``tp``; modules with
``_param_shards``; stacked :class:`~ascend_dsv4.models.v4_moe.Experts` with ``shard`` / ``first_expert``):

- :func:`param_shard` gives, for one parameter of the rank's model, the dimension of the GLOBAL tensor that is
  split and this rank's part of it; the checkpoint loader reads exactly that slice (``weights.loader``);
- :func:`foreign_expert` tells the loader which checkpoint experts belong to other ranks (not read);
- :func:`copy_rank_slices` fills a rank's model from a whole model (random-weight presets, tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.experts import Experts

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<id>\d+)\.(?P<w>w[123])\.(weight|scale)$")


@dataclass(frozen=True)
class Shard:
    """Split ``dim`` of the global tensor into ``size`` equal parts; this rank holds part ``rank``."""

    dim: int
    rank: int
    size: int

    def bounds(self, n: int, what: str = "") -> tuple[int, int]:
        if n % self.size:
            raise ValueError(f"{what}: dimension {self.dim} of size {n} does not split into {self.size} equal parts")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def take(self, t: torch.Tensor, what: str = "") -> torch.Tensor:
        a, b = self.bounds(t.shape[self.dim], what)
        return t.narrow(self.dim, a, b - a)

    def global_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        s = list(local)
        s[self.dim] *= self.size
        return tuple(s)


def module_shard(mod: nn.Module, leaf: str) -> Shard | None:
    """The split of parameter ``leaf`` of ``mod`` (a dense / checkpoint-shaped parameter), None if replicated."""
    tp = getattr(mod, "tp", None)
    if tp is None or getattr(tp, "size", 1) == 1:
        return None
    if leaf in ("weight", "scale") and hasattr(mod, "shard_dim"):
        return Shard(mod.shard_dim, tp.rank, tp.size)
    if leaf == "bias" and getattr(mod, "shard_dim", None) == 0:  # column-parallel bias
        return Shard(0, tp.rank, tp.size)
    dims = getattr(mod, "_param_shards", {})
    if leaf in dims:
        return Shard(dims[leaf], tp.rank, tp.size)
    return None


def expert_shard(mod: Experts, w: str) -> Shard | None:
    """The split of one expert's [out, in] weight ``w`` inside a TP-split Experts module."""
    if not mod.shard:
        return None
    return Shard(mod.shard[w] - 1, mod.tp.rank, mod.tp.size)


def expert_modules(model: nn.Module) -> dict[str, Experts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Experts)}


def foreign_expert(name: str, experts: dict[str, Experts]) -> bool:
    """Whether checkpoint tensor ``name`` (canonical) is a routed expert that another EP rank holds."""
    m = _EXPERT.match(name)
    if not m or m.group("prefix") not in experts:
        return False
    mod = experts[m.group("prefix")]
    e = int(m.group("id"))
    return mod.ep.size > 1 and e < mod.n_total and not (mod.first_expert <= e < mod.first_expert + mod.w1.shape[0])


@torch.no_grad()
def copy_rank_slices(full: nn.Module, rank_model: nn.Module) -> nn.Module:
    """Fill ``rank_model`` (a rank's share) from ``full`` (the same model at world size 1, dense weights)."""
    full_params = dict(full.named_parameters())
    full_params.update(dict(full.named_buffers()))
    mods = dict(rank_model.named_modules())
    for name, p in list(rank_model.named_parameters()) + list(rank_model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        mod_name, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        mod, src = mods[mod_name], full_params[name]
        if isinstance(mod, Experts) and leaf in ("w1", "w2", "w3"):
            src = src[mod.first_expert:mod.first_expert + p.shape[0]]
            if mod.shard:
                src = Shard(mod.shard[leaf], mod.tp.rank, mod.tp.size).take(src, name)
        else:
            sh = module_shard(mod, leaf)
            if sh is not None:
                src = sh.take(src, name)
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"copy_rank_slices: {name}: slice {tuple(src.shape)} != rank shape {tuple(p.shape)}")
        p.copy_(src.to(p.dtype))
    return rank_model
