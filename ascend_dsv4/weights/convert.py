"""Convert a DeepSeek-V4 checkpoint between layouts and formats, streaming tensor by tensor.

- names: ``official`` <-> ``hf`` (see :mod:`ascend_dsv4.models.deepseek_v4.random_weights` for the two layouts);
- ``dequantize``: FP8 block and packed-FP4 weights -> BF16 (their scales dropped);
- ``experts_fp8``: packed-FP4 routed experts -> FP8 e4m3 with one E8M0 scale per 128x128 block (lossless,
  ascend_dsv4/models/deepseek_v4/README.md §3.2: "convert.py --expert-dtype fp8").
A weight and its scale may sit in different shards: whichever comes first waits (one tensor) for the other.
"""

from __future__ import annotations

import os

import torch

import atb_ops
from quant.e8m0 import float_to_e8m0
from quant.fp4_to_fp8 import fp4_to_fp8
from quant.safetensors_io import checkpoint_inventory, stream_tensors
from quant.shard_writer import ShardWriter

from ..errors import CheckpointError
from ..models import load_config
from ..models.deepseek_v4.config import DeepseekV4Config
from ..models.deepseek_v4.names import canonical_name, hf_writer_name


def _to_layout(name: str, t: torch.Tensor, layout: str) -> tuple[str, torch.Tensor]:
    if layout == "official":
        if name.endswith(".scale") and t.dtype == torch.float32:
            try:  # official scales are E8M0; keep float32 when a scale is not a power of two
                t = float_to_e8m0(t).view(torch.float8_e8m0fnu)
            except ValueError:
                pass
        return name, t
    if name.endswith(".scale") and ".ffn.experts." not in name and t.dtype in (torch.float8_e8m0fnu, torch.uint8):
        from quant.e8m0 import e8m0_to_float

        t = e8m0_to_float(t)
    return hf_writer_name(name), t


def convert_checkpoint(src: str, dst: str, layout: str = "official", dequantize: bool = False,
                       experts_fp8: bool = False, shard_bytes: int = 1 << 30, progress: bool = True) -> list[str]:
    if layout not in ("official", "hf"):
        raise ValueError(f"layout must be 'official' or 'hf', got {layout!r}")
    if dequantize and experts_fp8:
        raise ValueError("choose either dequantize or experts_fp8")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError("the output folder must differ from the input folder")

    cfg = load_config(src)
    if not isinstance(cfg, DeepseekV4Config):
        raise CheckpointError(f"{src}: convert_checkpoint converts DeepSeek-V4 checkpoints; this is {cfg.model_type}")
    inv = checkpoint_inventory(src)
    canon = {ck: canonical_name(ck) for ck in inv}
    bad = [ck for ck, off in canon.items() if off is None]
    if bad:
        raise CheckpointError(f"{src}: cannot convert unknown tensor names: {', '.join(bad[:10])}")
    scaled = {off[: -len(".scale")] for off in canon.values() if off.endswith(".scale")}
    writer = ShardWriter(dst, shard_bytes)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for _shard, ck, t in stream_tensors(src, progress=progress, desc="converting"):
        off = canon[ck]
        base = off[: -len(".scale")] if off.endswith(".scale") else off[: -len(".weight")]
        quantised_pair = base in scaled and (off.endswith(".scale") or off.endswith(".weight"))
        fp4_expert = quantised_pair and ".ffn.experts." in off and (t.dtype == torch.int8 or off.endswith(".scale"))
        if quantised_pair and (dequantize or (experts_fp8 and fp4_expert)):
            part = pending.setdefault(base, {})
            part["s" if off.endswith(".scale") else "w"] = t
            if len(part) < 2:
                continue
            w, s = part.pop("w"), pending.pop(base)["s"]
            if w.dtype == torch.int8 and experts_fp8:
                w8, s8 = fp4_to_fp8(w, s)
                outs = [(base + ".weight", w8), (base + ".scale", s8.view(torch.float8_e8m0fnu))]
            elif dequantize:
                fmt = "fp4" if w.dtype == torch.int8 else "fp8_block"
                outs = [(base + ".weight", atb_ops.dequantize_weight(w, s, fmt).to(torch.bfloat16))]
            else:
                outs = [(base + ".weight", w), (base + ".scale", s)]
            for n, v in outs:
                writer.add(*_to_layout(n, v, layout))
            continue
        writer.add(*_to_layout(off, t, layout))
    if pending:
        raise CheckpointError(f"{src}: weights without scales (or scales without weights): {', '.join(pending)}")
    if dequantize:
        cfg = cfg.replace(dtype="bf16", scale_fmt=None, expert_dtype=None)
    elif experts_fp8 and cfg.expert_dtype == "fp4":
        cfg = cfg.replace(expert_dtype="fp8")
    conf = cfg.to_official_dict() if layout == "official" else cfg.to_hf_dict()
    conf.pop("name", None)
    shards = writer.close(conf)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        p = os.path.join(src, extra)
        if os.path.isfile(p):
            with open(p, "rb") as f, open(os.path.join(dst, extra), "wb") as g:
                g.write(f.read())
    return shards


