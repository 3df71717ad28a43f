"""Per-rank loading of a DeepSeek-V4 checkpoint (official names): read only the slices of a checkpoint that one tensor-/expert-parallel rank needs.

Sharding rules (the official ``convert.py``, ascend_dsv4/models/deepseek_v4/README.md §3.3): ``embed``, ``head``,
``attn.wq_b``, ``attn.wo_a``,
``attn.attn_sink``, ``attn.indexer.wq_b`` and ``attn.indexer.weights_proj`` split on dim 0 (vocab, heads, output
groups, index heads) across the ``tp`` ranks; ``attn.wo_b`` splits on dim 1; routed experts go whole to the
expert-parallel rank that owns their index (``E / ep`` consecutive experts per rank); everything else is
replicated. An FP8 weight's 128x128 block-scale grid is split along with it (so a rank's share of a split FP8
dimension must be a multiple of 128). Slices are read with ``safe_open``'s slicing: only a rank's bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quant.safetensors_io import ShardReader, checkpoint_inventory

from ..errors import ConfigError
from ..models.deepseek_v4.config import DeepseekV4Config
from ..models.deepseek_v4.names import canonical_name

_DIM0 = re.compile(r"(^embed\.weight$|^head\.weight$|\.attn\.(wq_b|wo_a|attn_sink|indexer\.wq_b|indexer\.weights_proj)"
                   r"\.(weight|scale)$|\.attn\.attn_sink$)")
_DIM1 = re.compile(r"\.attn\.wo_b\.(weight|scale)$")
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


@dataclass(frozen=True)
class RankLayout:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def validate(self, cfg: DeepseekV4Config) -> "RankLayout":
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.ep_rank < self.ep_size):
            raise ConfigError(f"rank layout {self}: ranks must be in [0, size)")
        checks = {"n_heads": cfg.n_heads, "o_groups": cfg.o_groups, "index_n_heads": cfg.index_n_heads,
                  "vocab_size": cfg.vocab_size}
        for name, v in checks.items():
            if v % self.tp_size:
                raise ConfigError(f"{name} = {v} is not divisible by the tensor-parallel size {self.tp_size}")
        if cfg.n_routed_experts % self.ep_size:
            raise ConfigError(f"n_routed_experts = {cfg.n_routed_experts} is not divisible by the expert-parallel "
                              f"size {self.ep_size}")
        return self

    def expert_range(self, n_experts: int) -> range:
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def slice_rule(name: str) -> tuple[str, int]:
    """('split', dim) | ('expert', index) | ('replicate', -1) for an official tensor name."""
    m = _EXPERT.search(name)
    if m:
        return "expert", int(m.group(1))
    if _DIM1.search(name):
        return "split", 1
    if _DIM0.search(name):
        return "split", 0
    return "replicate", -1


def _bounds(size: int, layout: RankLayout, name: str, is_scale: bool) -> tuple[int, int]:
    if size % layout.tp_size:
        kind = "scale-grid" if is_scale else "tensor"
        raise ConfigError(f"{name}: {kind} dimension {size} cannot be split over {layout.tp_size} ranks "
                          f"(FP8 block scales need each rank's share to be a multiple of 128)")
    per = size // layout.tp_size
    return layout.tp_rank * per, (layout.tp_rank + 1) * per


def rank_tensors(folder: str, cfg: DeepseekV4Config, layout: RankLayout) -> dict[str, torch.Tensor]:
    """{official name: this rank's slice} of every tensor the rank needs (others are not read)."""
    layout.validate(cfg)
    owned = layout.expert_range(cfg.n_routed_experts)
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for ck, (shard, _info) in checkpoint_inventory(folder).items():
        by_shard.setdefault(shard, []).append((ck, canonical_name(ck) or ck))
    out: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        with ShardReader(shard) as r:
            for ck, off in names:
                rule, arg = slice_rule(off)
                if rule == "expert":
                    if arg in owned:
                        out[off] = r.get(ck)
                elif rule == "split" and layout.tp_size > 1:
                    info = r.info(ck)
                    start, stop = _bounds(info.shape[arg], layout, off, off.endswith(".scale"))
                    if info.dtype_str == "F8_E4M3" and (stop - start) % 128:
                        raise ConfigError(f"{off}: each rank's share ({stop - start}) of this FP8 weight must be a "
                                          f"multiple of the 128-wide scale blocks")
                    out[off] = r.get_slice(ck, arg, start, stop)
                else:
                    out[off] = r.get(ck)
    return out
