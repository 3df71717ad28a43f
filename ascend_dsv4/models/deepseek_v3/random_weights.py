"""The tensors of a random-weight DeepSeek-V3 checkpoint in DeepSeek's HF format (for tests and benchmarks).

``model.layers.N...`` names, FP8 e4m3 linears with float32 ``weight_scale_inv`` per 128x128 block (unaligned
edge blocks padded), the MTP module at layer ``num_hidden_layers`` with its stored copies of the embedding and
head, HF ``config.json`` with ``quantization_config`` (``cfg.dtype == "bf16"``: plain BF16 weights instead).

:func:`ascend_dsv4.weights.random_checkpoint.write_checkpoint` writes them into shards.
"""

from __future__ import annotations

from typing import Iterator

import torch

from quant.fp8_block import quant_fp8_block

from ..random_values import generator, random_value
from .config import DeepseekV3Config
from .sizing import tensor_inventory

FORMATS = ("hf",)


def random_checkpoint(cfg: DeepseekV3Config, fmt: str, seed: int) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(config.json dict, iterator of (checkpoint name, tensor)) of a random checkpoint (``fmt``: "hf")."""
    def tensors():
        specs = tensor_inventory(cfg)
        for spec in specs:
            if spec.scale:
                continue
            names = [spec.name.format(e=e) for e in range(spec.count)] if "{e}" in spec.name else [spec.name]
            for name in names:
                # the MTP layer stores copies of the embedding and head: same values as the originals
                src = name
                if spec.copy:
                    src = "model.embed_tokens.weight" if name.endswith("embed_tokens.weight") else "lm_head.weight"
                v = random_value("embed.weight" if src == "model.embed_tokens.weight" else src, spec.shape, cfg,
                                 generator(seed, src))
                if spec.dtype == "F8_E4M3":
                    w, s = quant_fp8_block(v, scale_fmt=None)
                    yield name, w
                    yield name[: -len("weight")] + "weight_scale_inv", s.float()
                else:
                    yield name, v.to({"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype])

    return cfg.to_hf_dict(), tensors()
