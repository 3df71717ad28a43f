"""Write a random-weight checkpoint of any model family in its exact real format (for tests and benchmarks).

The family produces the tensors and the ``config.json`` (``random_weights.py`` in each family folder: seeded per
tensor, quantised with the codecs of :mod:`quant`); this module writes them shard by shard with a
``model.safetensors.index.json``.
"""

from __future__ import annotations

import os

from quant.shard_writer import ShardWriter

from ..errors import ConfigError
from ..models import family_of


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
