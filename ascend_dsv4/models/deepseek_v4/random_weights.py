"""The tensors of a random-weight DeepSeek-V4 checkpoint in the exact real format (for tests and benchmarks).

Every tensor of :func:`.sizing.tensor_inventory` comes from its own seeded generator (so the ``official`` and ``hf``
layouts of one seed hold the same values), quantised to its checkpoint format with the codecs of :mod:`quant`
(FP8 e4m3 + E8M0 per 128x128 block, packed FP4 + E8M0 per 32 inputs).

- ``official``: official names, E8M0 scales as ``.scale`` (F8_E8M0), ``config.json`` in the inference format.
- ``hf``: transformers' module names, FP8 scales as float32 ``weight_scale_inv``, routed experts under DeepSeek's
  HF names ``model.layers.i.mlp.experts.e.{gate,up,down}_proj``, MTP under ``mtp.*``; HF ``config.json``.

:func:`ascend_dsv4.weights.random_checkpoint.write_checkpoint` writes them into shards.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from quant.fp8_block import quant_fp8_block

from ..random_values import generator, random_value
from .config import DeepseekV4Config
from .names import hf_writer_name
from .sizing import tensor_inventory

FORMATS = ("official", "hf")


def _random_fp4(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed FP4 codes (uniform over the 16 codes, RMS ~2.93) with E8M0 scales of 2^e or 2^(e+1)
    chosen so that the logical weight has std ~ 1/sqrt(in): drawn directly in the stored format, which
    writes FP4 experts far faster than quantising random floats."""
    o, half = shape
    packed = torch.randint(0, 256, (o, half), generator=g, dtype=torch.uint8).view(torch.int8)
    e = round(math.log2(1.0 / (2.93 * math.sqrt(2 * half))))
    scale = (127 + e + torch.randint(0, 2, (o, 2 * half // 32), generator=g)).to(torch.uint8)
    return packed, scale


def _tensors(cfg: DeepseekV4Config, seed: int):
    """Yield (official name, tensor in checkpoint dtype) for every tensor of the checkpoint."""
    for spec in tensor_inventory(cfg):
        if spec.scale:
            continue  # produced with their weight
        names = [spec.name.format(e=e) for e in range(spec.count)] if "{e}" in spec.name else [spec.name]
        for name in names:
            g = generator(seed, name)
            if spec.packed_fp4:
                packed, scale = _random_fp4(spec.shape, g)
                yield name, packed
                yield name[: -len(".weight")] + ".scale", scale.view(torch.float8_e8m0fnu)
            elif spec.dtype == "F8_E4M3":
                w, scale = quant_fp8_block(random_value(name, spec.shape, cfg, g), scale_fmt="ue8m0")
                yield name, w
                yield name[: -len(".weight")] + ".scale", scale.view(torch.float8_e8m0fnu)
            elif spec.dtype == "I64":
                yield name, random_value(name, spec.shape, cfg, g).to(torch.int64)
            else:
                dt = {"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype]
                yield name, random_value(name, spec.shape, cfg, g).to(dt)


def random_checkpoint(cfg: DeepseekV4Config, fmt: str, seed: int) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(config.json dict, iterator of (checkpoint name, tensor)) of a random checkpoint in layout ``fmt``."""
    def tensors():
        for name, t in _tensors(cfg, seed):
            if fmt == "hf":
                if name.endswith(".scale") and ".ffn.experts." not in name and t.dtype == torch.float8_e8m0fnu:
                    t = t.float()  # HF FP8 scales are float32 weight_scale_inv
                name = hf_writer_name(name)
            yield name, t

    return (cfg.to_official_dict() if fmt == "official" else cfg.to_hf_dict()), tensors()
