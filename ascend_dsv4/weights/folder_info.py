"""What is on disk in a model folder: the weight formats and bytes per parameter (for ``ascend-dsv4 info``)."""

from __future__ import annotations

import math
from collections import Counter

from .msmodelslim_loader import is_msmodelslim_folder


def describe_folder(folder: str) -> str:
    """A few lines: quantisation (msModelSlim types, or FP8 / FP4 / BF16 tensors) and stored weight bytes per
    parameter. Raises the reader's errors (CheckpointError / QuantFormatError) for a broken folder."""
    if is_msmodelslim_folder(folder):
        import quant.msmodelslim as msm

        with msm.load(folder, allow_float_mtp=True) as ck:
            kinds = Counter(t for _n, t in ck.entries())
            lines = [f"quantization msModelSlim, model_quant_type {ck.model_quant_type}"
                     + (f", KV cache {ck.kv_cache_type}" if ck.kv_cache_type else "")
                     + (f", attention {ck.fa_quant_type}" if ck.fa_quant_type else ""),
                     "  linears by type: " + ", ".join(f"{t} {n}" for t, n in sorted(kinds.items())),
                     f"  weight bytes per parameter {ck.bytes_per_param():.3f} (all tensors), "
                     f"{ck.bytes_per_param(quantized_only=True):.3f} (quantised linears)"]
        return "\n".join(lines)
    import glob
    import os

    from quant.safetensors_io import checkpoint_inventory

    if not glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
        return "weights      none in this folder (config only)"
    inv = checkpoint_inventory(folder)
    by_dtype: Counter = Counter()
    nbytes = params = 0
    for name, (_shard, info) in inv.items():
        nbytes += info.nbytes
        scale = name.endswith((".scale", "weight_scale_inv"))
        by_dtype[info.dtype_str] += 1
        if not scale and not name.endswith("tid2eid"):
            params += math.prod(info.shape) * (2 if info.dtype_str == "I8" else 1)  # packed FP4: 2 per byte
    fmt = []
    if by_dtype.get("F8_E4M3"):
        fmt.append(f"FP8 e4m3 128x128 blocks ({by_dtype['F8_E4M3']} tensors)")
    if by_dtype.get("I8"):
        fmt.append(f"packed FP4 experts ({by_dtype['I8']} tensors)")
    if not fmt:
        fmt.append("unquantised")
    hist = ", ".join(f"{k} {v}" for k, v in sorted(by_dtype.items()))
    return (f"quantization {'; '.join(fmt)}\n  tensors by dtype: {hist}\n"
            f"  weight bytes per parameter {nbytes / max(params, 1):.3f} ({nbytes / 1e9:.2f} GB stored)")
