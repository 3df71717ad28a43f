"""``quantize_model``: calibrate (static W8A8), encode every linear the recipe quantises, write the msModelSlim
folder (weights, description, config.json, tokenizer files) and report a summary."""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

import torch

from quant.msmodelslim.encode import w4a8_dynamic_tensors, w8a8_dynamic_tensors, w8a8_static_tensors
from quant.shard_writer import ShardWriter

from ..engine.model_runner import ModelRunner
from ..errors import AscendDSV4Error, ConfigError
from ..models import load_config
from .calibrate import CALIB_CHUNK, Calibration, calibrate
from .checkpoint import (
    FLOAT, W4A8_DYNAMIC, W8A8_DYNAMIC, checkpoint_tensors, inventory_dtypes, names_for, runner_of,
)

QTYPES = ("w8a8_dynamic", "w8a8", "w4a8_dynamic")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}

DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"
#: files copied from a source folder next to the weights (msModelSlim v1 copies *.json/*.py/*.txt/*.jinja)
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


def _float_dtype(name: str, t: torch.Tensor, inv: dict[str, str], model_dtype: torch.dtype) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        return t
    return t.to(torch.float32 if inv.get(name) == "F32" else model_dtype)


def _config_dict(cfg, model_dtype: torch.dtype, qtype: str) -> dict:
    name = "bfloat16" if model_dtype == torch.bfloat16 else "float32"
    d = cfg.dense().to_hf_dict()
    d.pop("quantization_config", None)
    d["torch_dtype"] = name
    if qtype == "w4a8_dynamic":  # what msModelSlim's DeepSeek adapter adds for W4A8 (quant/msmodelslim/README.md §4, DeepSeek)
        d.update(quantize="w8a8_dynamic", moe_quantize="w4a8_dynamic", mla_quantize="w8a8_dynamic",
                 mtp_quantize="w8a8_dynamic")
    return d


def _load_runner(model: str, seed: int) -> ModelRunner:
    """A float32 CPU runner of ``model`` (preset or folder) with dense weights, sized for calibration chunks."""
    cfg = load_config(model)
    return ModelRunner.create(model, cfg, device=torch.device("cpu"), dtype=torch.float32, seed=seed,
                              dequantize=True, progress=False, max_num_seqs=1,
                              max_model_len=cfg.max_position_embeddings, max_num_batched_tokens=CALIB_CHUNK)


def quantize_model(model, qtype: str, out: str, calib_tokens: int = 64, seed: int = 0, dtype: str = "bfloat16",
                   shard_gb: float = 4.0, log: Optional[Callable[[str], None]] = print) -> dict:
    """Quantise ``model`` (preset name, model folder, a :class:`ModelRunner` or an ``LLM``) to ``out`` in msModelSlim
    format.

    ``qtype``: ``w8a8_dynamic`` | ``w8a8`` | ``w4a8_dynamic`` (module docstring). ``calib_tokens`` random tokens
    (seed ``seed``) calibrate static W8A8; ``seed`` also seeds a preset's random weights. ``dtype``: serving dtype
    written to config.json (``bfloat16`` | ``float32``). Returns the summary dict (also printed through ``log``).
    """
    if qtype not in QTYPES:
        raise ConfigError(f"--type must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of bfloat16, float32, got {dtype!r}")
    if qtype == "w8a8" and calib_tokens < 1:
        raise ConfigError(f"--calib-tokens must be >= 1 for static W8A8, got {calib_tokens}")
    if os.path.isdir(out) and os.listdir(out):
        raise AscendDSV4Error(f"--out {out} exists and is not empty; refusing to overwrite")
    model_dtype = DTYPES[dtype]
    src_dir = model if isinstance(model, str) and os.path.isdir(model) else None
    runner = _load_runner(model, seed) if isinstance(model, str) else runner_of(model)
    cfg = runner.cfg
    names = names_for(cfg)
    inv = inventory_dtypes(cfg)
    qtype_of = lambda prefix: names.qtype_of(prefix, qtype)  # noqa: E731

    cal = calibrate(runner, names, qtype_of, calib_tokens, seed) if qtype == "w8a8" else Calibration()

    os.makedirs(out, exist_ok=True)
    writer = ShardWriter(out, int(shard_gb * (1 << 30)), stem=WEIGHTS_STEM, single_file=True)
    desc: dict[str, object] = {}
    stats: dict[str, dict[str, int]] = {}

    def put(key: str, t: torch.Tensor, typ: str) -> None:
        writer.add(key, t)
        desc[key] = typ

    with torch.no_grad():
        for key, t, ek in checkpoint_tensors(runner, names):
            prefix = key[: -len(".weight")] if key.endswith(".weight") else None
            typ = qtype_of(prefix) if prefix is not None and t.dim() == 2 else FLOAT
            if typ == FLOAT:
                ft = _float_dtype(key, t, inv, model_dtype)
                put(key, ft, FLOAT)
                s = stats.setdefault(FLOAT, {"tensors": 0, "linears": 0, "params": 0, "bytes": 0})
                s["tensors"] += 1
                s["params"] += ft.numel()
                s["bytes"] += ft.numel() * ft.element_size()
                continue
            if typ == W8A8_DYNAMIC:
                parts = w8a8_dynamic_tensors(t)
            elif typ == W4A8_DYNAMIC:
                w = ek[2] if ek is not None else prefix.rsplit(".", 1)[-1]
                parts = w4a8_dynamic_tensors(t, 16 if w in ("w2", "down_proj") else 1)
            else:
                r = cal.ranges.get(prefix)
                if r is None:
                    raise AscendDSV4Error(f"{prefix}: no calibration data reached this linear; raise --calib-tokens")
                parts = w8a8_static_tensors(t, r[0], r[1], model_dtype)
            s = stats.setdefault(typ, {"tensors": 0, "linears": 0, "params": 0, "bytes": 0})
            s["linears"] += 1
            s["params"] += t.numel()
            for suffix, v in parts.items():
                put(f"{prefix}.{suffix}", v, typ)
                s["tensors"] += 1
                s["bytes"] += v.numel() * v.element_size()
    files = writer.close()

    desc_out = {"model_quant_type": qtype.upper(), "version": "1.0.0", "group_size": 0, "metadata": {}, "optional": {}}
    desc_out.update(desc)
    with open(os.path.join(out, DESCRIPTION_NAME), "w") as f:
        json.dump(desc_out, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(_config_dict(cfg, model_dtype, qtype), f, indent=2)
    copied = []
    if src_dir:
        for fn in COPY_FILES:
            p = os.path.join(src_dir, fn)
            if os.path.isfile(p):
                shutil.copyfile(p, os.path.join(out, fn))
                copied.append(fn)

    total_bytes = sum(s["bytes"] for s in stats.values())
    total_params = sum(s["params"] for s in stats.values())
    summary = {
        "model": model if isinstance(model, str) else (cfg.name or "model"), "family": names.family.title, "type": qtype,
        "model_quant_type": qtype.upper(),
        "dtype": "bfloat16" if model_dtype == torch.bfloat16 else "float32", "out": out,
        "files": [os.path.basename(p) for p in files], "copied": copied, "per_type": stats,
        "bytes": total_bytes, "params": total_params,
        "bytes_per_param": total_bytes / total_params if total_params else float("nan"),
        "calib_tokens": cal.tokens, "calib_fallbacks": cal.fallbacks,
    }
    if log is not None:
        log(format_summary(summary))
    return summary


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_summary(s: dict) -> str:
    lines = [f"wrote {s['model']} ({s['family']}) as msModelSlim {s['model_quant_type']} ({s['dtype']}) to {s['out']}: "
             f"{', '.join(s['files'])}"]
    for typ in sorted(s["per_type"], key=lambda t: (t == FLOAT, t)):
        st = s["per_type"][typ]
        what = f"{st['linears']} linears, {st['tensors']} tensors" if typ != FLOAT else f"{st['tensors']} tensors"
        bpp = st["bytes"] / st["params"] if st["params"] else float("nan")
        lines.append(f"  {typ:<13} {what:<32} {st['params']:>14,} params  {_fmt_bytes(st['bytes']):>11}  "
                     f"{bpp:.3f} bytes/param")
    lines.append(f"  total         {s['params']:,} params, {_fmt_bytes(s['bytes'])}, "
                 f"{s['bytes_per_param']:.3f} bytes/param")
    if s["calib_tokens"]:
        fb = s["calib_fallbacks"]
        lines.append(f"  calibration   {s['calib_tokens']} random tokens; {len(fb)} expert linear(s) without routed "
                     f"tokens used the layer-wide range" + (f" (e.g. {fb[0]})" if fb else ""))
    if s["copied"]:
        lines.append(f"  copied        {', '.join(s['copied'])}")
    return "\n".join(lines)
