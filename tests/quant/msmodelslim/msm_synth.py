"""Synthetic msModelSlim-format checkpoints, built from the formulas of quant/msmodelslim/README.md §4-§6.

Written independently of ``quant.msmodelslim`` (no imports from it), so that tests compare the package
against the documented format rather than against itself. Each ``quant_*`` function takes a float weight
``w [n, k]`` and returns ``{suffix: tensor}`` for one linear, as msModelSlim would save it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

# ---------------------------------------------------------------------------------------------------------------
# per-linear quantisers (quant/msmodelslim/README.md §6 "W8A8 static formula chain", §4 tables)


def calib_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor asymmetric int8 calibration: ``(input_scale [1], input_offset [1])`` (float32, offset integral)."""
    x_max = max(float(x.max()), 0.0)
    x_min = min(float(x.min()), 0.0)
    scale = torch.tensor([(x_max - x_min) / 255.0], dtype=torch.float32)
    offset = torch.round(torch.tensor([-x_min], dtype=torch.float32) / scale) - 128
    return scale, offset


def sym_per_channel(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight_scale = max(|w_min|, w_max) / qmax`` per row; ``q = clamp(round(w / s), -qmax, qmax)``."""
    s = torch.maximum(w.amin(1).abs(), w.amax(1)) / qmax
    q = torch.clamp(torch.round(w / s[:, None]), -qmax, qmax)
    return q, s[:, None]


def asym_per_row(w: torch.Tensor, levels: int = 255, qmin: int = -128, qmax: int = 127):
    """Zero-point quantisation of each row (the calibration formula): ``(q, scale [n,1], offset [n,1])``."""
    hi = torch.clamp(w.amax(1, keepdim=True), min=0)
    lo = torch.clamp(w.amin(1, keepdim=True), max=0)
    s = (hi - lo) / levels
    off = torch.round(-lo / s) + qmin
    q = torch.clamp(torch.round(w / s + off), qmin, qmax)
    return q, s, off


def int64_deq(deq: torch.Tensor) -> torch.Tensor:
    """msModelSlim ``deqscale2int64``: ``np.frombuffer(float32 bytes, int32).astype(int64)``
    (quant/msmodelslim/README.md §5)."""
    a = np.frombuffer(deq.to(torch.float32).numpy().tobytes(), dtype=np.int32).astype(np.int64)
    return torch.from_numpy(a.copy())


def quant_w8a8_static(w, x_calib, bias=None, deq_dtype="int64", scale_dtype=torch.float32, with_weight_scale=True):
    n = w.shape[0]
    input_scale, input_offset = calib_activation(x_calib)
    q_w, ws = sym_per_channel(w)
    input_scale = input_scale.to(scale_dtype)
    deq = (input_scale.float() * ws[:, 0]).to(torch.float32)
    b = bias if bias is not None else torch.zeros(n)
    correction = q_w.sum(1) * input_offset.float()
    quant_bias = torch.round(b / deq - correction).to(torch.int32)
    out = {
        "weight": q_w.to(torch.int8),
        "input_scale": input_scale,
        "input_offset": input_offset.to(scale_dtype),
        "quant_bias": quant_bias,
        "deq_scale": int64_deq(deq) if deq_dtype == "int64" else deq,
    }
    if with_weight_scale:
        out["weight_scale"] = ws.to(scale_dtype)
        out["weight_offset"] = torch.zeros_like(ws).to(scale_dtype)
    if bias is not None:
        out["bias"] = bias.to(torch.float32)
    return out


def quant_w8a16(w, sym=True, group_size=None, bias=None):
    n, k = w.shape
    g = 1 if group_size is None else k // group_size
    wg = w.reshape(n * g, k // g)
    if sym:
        q, s = sym_per_channel(wg)
        off = torch.zeros_like(s)
    else:
        q, s, off = asym_per_row(wg)
    out = {"weight": q.reshape(n, k).to(torch.int8), "weight_scale": s.reshape(n, g), "weight_offset": off.reshape(n, g)}
    if bias is not None:
        out["bias"] = bias
    return out


def quant_w4a16(w, group_size=16, bias=None):
    """Weight-only int4 with a zero point per group, unpacked int4 values in int8 (v0 safe_tensor layout)."""
    n, k = w.shape
    g = k // group_size
    q, s, off = asym_per_row(w.reshape(n * g, group_size), levels=15, qmin=-8, qmax=7)
    out = {"weight": q.reshape(n, k).to(torch.int8), "weight_scale": s.reshape(n, g), "weight_offset": off.reshape(n, g)}
    if bias is not None:
        out["bias"] = bias
    return out


def quant_w8a8_dynamic(w, bias=None):
    q, s = sym_per_channel(w)
    out = {"weight": q.to(torch.int8), "weight_scale": s, "weight_offset": torch.zeros_like(s)}
    if bias is not None:
        out["bias"] = bias
    return out


def pack_rows_int4(q: torch.Tensor) -> torch.Tensor:
    """Notes §4: ``packed[i, j] = (q[2i+1, j] << 4) | (q[2i, j] & 0xF)`` (element by element, numpy)."""
    a = q.numpy().astype(np.int64)
    n, k = a.shape
    out = np.zeros((n // 2, k), dtype=np.int64)
    for i in range(n // 2):
        for j in range(k):
            out[i, j] = ((int(a[2 * i + 1, j]) << 4) | (int(a[2 * i, j]) & 0xF)) & 0xFF
    out = np.where(out >= 128, out - 256, out).astype(np.int8)
    return torch.from_numpy(out)


def quant_w4a8_per_channel(w, name="q_proj", packed=True, bias=None):
    q4, s = sym_per_channel(w, qmax=7)
    chunks = 16 if any(t in name for t in ("down_proj", "o_proj")) else 1
    n, k = w.shape
    sb = 8 * (q4 * s).reshape(n, chunks, k // chunks).sum(-1)
    out = {
        "weight": pack_rows_int4(q4) if packed else q4.to(torch.int8),
        "weight_scale": s,
        "weight_offset": torch.zeros_like(s),
    }
    if packed:
        out["scale_bias"] = sb
    if bias is not None:
        out["bias"] = bias
    return out


def quant_w4a8_per_group(w, group_size=16, packed=False):
    """v0 two-stage: fp -> int8 per channel (sym), then int8 -> int4 per group (zero point, int64 offsets)."""
    n, k = w.shape
    w8, s1 = sym_per_channel(w)
    g = k // group_size
    q4, s2, off2 = asym_per_row(w8.reshape(n * g, group_size), levels=15, qmin=-8, qmax=7)
    q4 = q4.reshape(n, k)
    out = {
        "weight": pack_rows_int4(q4) if packed else q4.to(torch.int8),
        "weight_scale": s1,
        "weight_offset": torch.zeros_like(s1),
        "weight_scale_second": s2.reshape(n, g),
        "weight_offset_second": off2.reshape(n, g).to(torch.int64),
    }
    if packed:
        out["scale_bias"] = 8 * (q4 * s1).sum(1, keepdim=True)
    return out


def dequant_reference(t: dict, qtype: str) -> torch.Tensor:
    """Float weight ``[n, k]`` per the notes' dequant formulas (independent of the package)."""
    if qtype in ("W8A8", "W8A8S", "W8A8_MIX"):
        deq = t["deq_scale"]
        if deq.dtype == torch.int64:
            deq = torch.from_numpy((deq.numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.float32).copy())
        return t["weight"].float() * (deq / t["input_scale"].float())[:, None]
    w = t["weight"].float()
    if qtype == "W4A8_DYNAMIC" and "scale_bias" in t:
        raise ValueError("unpack first")
    if "weight_scale_second" in t:
        n, k = w.shape
        g = t["weight_scale_second"].shape[1]
        st1 = (w.reshape(n, g, -1) - t["weight_offset_second"].float()[..., None]) * t["weight_scale_second"][..., None]
        return (st1.reshape(n, k) - t["weight_offset"]) * t["weight_scale"]
    n, k = w.shape
    g = t["weight_scale"].reshape(n, -1).shape[1]
    s = t["weight_scale"].float().reshape(n, g, 1)
    o = t["weight_offset"].float().reshape(n, g, 1)
    return ((w.reshape(n, g, -1) - o) * s).reshape(n, k)


# ---------------------------------------------------------------------------------------------------------------
# checkpoint writer and a tiny llama-like model


def write_checkpoint(folder, tensors: dict, types: dict, globals_: dict | None = None, style: str = "v1",
                     v0_type: str = "w8a8", shards: int = 1) -> str:
    """Write tensors + description the way msModelSlim names them (quant/msmodelslim/README.md §3). Returns
    ``folder``."""
    os.makedirs(folder, exist_ok=True)
    desc = dict(globals_ or {})
    desc.update(types)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if style == "v0":
        save_file(tensors, os.path.join(folder, f"quant_model_weight_{v0_type}.safetensors"))
        with open(os.path.join(folder, f"quant_model_description_{v0_type}.json"), "w") as f:
            json.dump(desc, f, indent=2)
        return folder
    if shards == 1:
        save_file(tensors, os.path.join(folder, "quant_model_weights.safetensors"))
    else:
        keys = list(tensors)
        wm = {}
        for i in range(shards):
            fn = f"quant_model_weights-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i::shards]}
            save_file(part, os.path.join(folder, fn))
            wm.update({k: fn for k in part})
        with open(os.path.join(folder, "quant_model_weights.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    with open(os.path.join(folder, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=2)
    return folder


LINEARS = {  # name -> (n, k) for hidden 32, intermediate 64, 4 heads x 8, 2 kv heads
    "self_attn.q_proj": (32, 32),
    "self_attn.k_proj": (16, 32),
    "self_attn.v_proj": (16, 32),
    "self_attn.o_proj": (32, 32),
    "mlp.gate_proj": (64, 32),
    "mlp.up_proj": (64, 32),
    "mlp.down_proj": (32, 64),
}


def quantize_linear(qtype: str, w: torch.Tensor, x_calib: torch.Tensor, name: str, **kw) -> dict:
    if qtype in ("W8A8", "W8A8S"):
        return quant_w8a8_static(w, x_calib, **kw)
    if qtype == "W8A8_MIX":
        return quant_w8a8_static(w, x_calib, with_weight_scale=True, **kw)
    if qtype == "W8A16":
        return quant_w8a16(w, **kw)
    if qtype == "W8A8_DYNAMIC":
        return quant_w8a8_dynamic(w, **kw)
    if qtype == "W4A8_DYNAMIC":
        return quant_w4a8_per_channel(w, name=name, **kw)
    if qtype == "FLOAT":
        return {"weight": w}
    raise ValueError(qtype)


def tiny_model(folder, qtype: str, layers: int = 2, seed: int = 0, style: str = "v1", kv_c8: bool = False,
               anti_outlier: bool = False, mtp: bool = False, describe_mtp: bool = True, shards: int = 1,
               **quant_kw):
    """A 2-layer llama-like checkpoint with every linear of type ``qtype``; returns (folder, float weights, x_calib).

    ``mtp=True`` adds a DeepSeek-style MTP layer ``model.layers.<layers>.*`` (float) and a config.json with
    ``num_hidden_layers=layers``; ``describe_mtp=False`` leaves it out of the description (the field failure).
    """
    g = torch.Generator().manual_seed(seed)
    tensors, types, floats = {}, {}, {}
    x_calib = torch.randn(16, 64, generator=g)
    tensors["model.embed_tokens.weight"] = torch.randn(50, 32, generator=g)
    tensors["lm_head.weight"] = torch.randn(50, 32, generator=g) * 0.1
    tensors["model.norm.weight"] = torch.ones(32)
    for i in range(layers):
        p = f"model.layers.{i}."
        for ln in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + ln + ".weight"] = 1 + 0.1 * torch.randn(32, generator=g)
            if anti_outlier:
                tensors[p + ln + ".bias"] = 0.05 * torch.randn(32, generator=g)
                tensors[p + ln + ".module.weight"] = tensors[p + ln + ".weight"].clone()
                tensors[p + ln + ".module.bias"] = tensors[p + ln + ".bias"].clone()
        for name, (n, k) in LINEARS.items():
            w = torch.randn(n, k, generator=g) / k**0.5
            floats[p + name] = w
            t = quantize_linear(qtype, w, x_calib[:, :k], name, **quant_kw)
            for s, v in t.items():
                tensors[f"{p}{name}.{s}"] = v
                types[f"{p}{name}.{s}"] = qtype if s != "bias" else "FLOAT"
        if kv_c8:
            for proj in ("k_proj", "v_proj"):
                tensors[f"{p}self_attn.{proj}.kv_cache_scale"] = 0.01 + torch.rand(16, generator=g) * 0.02
                tensors[f"{p}self_attn.{proj}.kv_cache_offset"] = torch.zeros(16)
                types[f"{p}self_attn.{proj}.kv_cache_scale"] = "C8"
                types[f"{p}self_attn.{proj}.kv_cache_offset"] = "C8"
    for k in tensors:
        if k not in types:
            types[k] = qtype if ".module." in k else "FLOAT"
    mtp_keys = []
    if mtp:
        p = f"model.layers.{layers}."
        for key, shape in (("enorm.weight", (32,)), ("hnorm.weight", (32,)), ("eh_proj.weight", (32, 64)),
                           ("shared_head.norm.weight", (32,)), ("self_attn.q_proj.weight", (32, 32))):
            tensors[p + key] = torch.randn(*shape, generator=g)
            mtp_keys.append(p + key)
            if describe_mtp:
                types[p + key] = "FLOAT"
    globals_ = {"model_quant_type": qtype}
    if style == "v1":
        globals_.update({"version": "1.0.0", "metadata": {}, "group_size": 0, "optional": {}})
    if kv_c8:
        globals_["kv_cache_type"] = "C8"
        globals_["kv_quant_type"] = "C8"
    write_checkpoint(folder, tensors, types, globals_, style=style, v0_type=qtype.lower(), shards=shards)
    if mtp:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"num_hidden_layers": layers, "num_nextn_predict_layers": 1}, f)
    return folder, floats, x_calib


# ---------------------------------------------------------------------------------------------------------------
# tolerance between the int and float paths of a QuantLinear (used by the linear and real-fixture tests)

U = 2.0**-24


def int_float_bound(lin, x: torch.Tensor, y_int: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |int path - float path| (see test_msm_linear's docstring for the derivation).

    ``2 * ((K + 3) u sum_k |x_dq| |W| + 3 u |y|)`` (float32 rounding of both paths, u = 2^-24), plus
    ``deq / 2 (1 + 1e-6) + 1e-6 |b|`` for static linears with a float bias folded into quant_bias.
    """
    k = lin.in_features
    x2 = x.reshape(-1, k).float()
    if lin.mode == "static":
        q, _ = lin.quantize_input(x2)
        xdq = (q.float() - lin.input_offset) * lin.input_scale
    else:
        s = x2.abs().amax(-1, keepdim=True) / 127.0
        xdq = torch.clamp(torch.round(x2 / torch.where(s == 0, torch.ones_like(s), s)), -128, 127) * s
    w = lin.dequant_weight()
    bound = 2 * ((k + 3) * U * (xdq.abs() @ w.abs().T) + 3 * U * y_int.abs())
    if lin.mode == "static" and lin.bias is not None:
        bound = bound + 0.5 * lin.deq * (1 + 1e-6) + 1e-6 * lin.bias.abs()
    return bound
