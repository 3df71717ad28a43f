"""Write a random-weight checkpoint of any model family in its exact real format (for tests and benchmarks).

The family produces the tensors and the ``config.json`` (``random_weights.py`` in each family folder: seeded per
tensor, quantised with the codecs of :mod:`quant`); this module writes them shard by shard with a
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import ConfigError
from ..models import family_of


class ShardWriter:
    """Accumulates tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``shard_bytes``
    (one shard's tensors in memory at a time), then ``model.safetensors.index.json``."""

    def __init__(self, out_dir: str, shard_bytes: int = 1 << 30):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.shards: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.buf: dict[str, torch.Tensor] = {}
        self.size = self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size and self.size + nbytes > self.shard_bytes:
            self._flush()
        self.buf[name] = t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        path = os.path.join(self.out_dir, f"model-{len(self.shards) + 1:05d}.safetensors")
        save_file(self.buf, path, metadata={"format": "pt"})
        self.shards.append(path)
        for k in self.buf:
            self.weight_map[k] = os.path.basename(path)
        self.buf, self.size = {}, 0

    def close(self, config: dict | None = None) -> list[str]:
        self._flush()
        n = len(self.shards)
        final = []
        for i, p in enumerate(self.shards):  # the shard count is known only now
            q = os.path.join(self.out_dir, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            os.replace(p, q)
            final.append(q)
        rename = {os.path.basename(a): os.path.basename(b) for a, b in zip(self.shards, final)}
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: rename[v] for k, v in self.weight_map.items()}}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
        if config is not None:
            with open(os.path.join(self.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        self.shards = final
        return final


def write_checkpoint(cfg, out_dir: str, fmt: str | None = None, seed: int = 0, shard_bytes: int = 1 << 30,
                     progress: bool = True) -> list[str]:
    """Write a random checkpoint of ``cfg`` in layout ``fmt`` (the family's ``checkpoint_formats``; None = its
    default: "official" for DeepSeek-V4, DeepSeek's "hf" for V3); returns the shard paths. ``shard_bytes`` bounds
    each shard (and peak memory)."""
    fam = family_of(cfg)
    fmt = fam.checkpoint_formats[0] if fmt is None else fmt
    if fmt not in fam.checkpoint_formats:
        raise ConfigError(f"{fam.title} checkpoints are written in the layouts {', '.join(fam.checkpoint_formats)}; "
                          f"got {fmt!r} (use --format {fam.checkpoint_formats[0]})")
    config, tensors = fam.random_checkpoint(cfg, fmt, seed)
    writer = ShardWriter(out_dir, shard_bytes)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(s.nbytes for s in fam.tensor_inventory(cfg))
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(out_dir) or out_dir}")
    for name, t in tensors:
        writer.add(name, t)
        if bar is not None:
            bar.update(t.numel() * t.element_size())
    if bar is not None:
        bar.close()
    return writer.close(config)
