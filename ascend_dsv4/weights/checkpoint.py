"""Load a DeepSeek-V4 checkpoint folder into a model: validated first, then streamed tensor by tensor.

Formats (ascend_dsv4/models/deepseek_v4/README.md §3): official names (FP8 e4m3 weights with E8M0 ``.scale`` per
128x128 block, routed experts
packed FP4 with an E8M0 scale per 32 inputs, ``tid2eid`` int64, ``mtp.0.*``), transformers' names (module
names, or what ``save_pretrained`` writes), DeepSeek's HF names (``mlp.experts.e.gate_proj``,
``weight_scale_inv`` float32 scales), and BF16/FP16/FP32 checkpoints of all of them.

Quantised linears stay in their checkpoint format (the ops dequantise per call; a kernel backend uses them
directly) unless ``dequantize=True``; ``wo_a`` and the float32-compute layers are always dequantised at load
(ascend_dsv4/models/deepseek_v4/README.md §3.3). Every problem found — missing / unexpected tensors, shapes, dtypes,
scale grids, NaN scales,
tid2eid out of range, mixed expert formats — is collected and reported at once in a :class:`CheckpointError`
naming shard, tensor, expected and found. Header problems are found before any tensor data is read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from torch import nn

from parallel.linear import Linear
from quant.safetensors_io import TensorInfo, checkpoint_inventory

from ..errors import CheckpointError
from ..layers.experts import Experts
from ..models import family_of
from ..models.deepseek_v4.names import expert_key
from .tp_shards import Shard, expert_modules, expert_shard, foreign_expert, module_shard

log = logging.getLogger("ascend_dsv4")

FLOAT = ("BF16", "F16", "F32")
SCALE_DTYPES = ("F8_E8M0", "U8", "F32")


@dataclass
class Target:
    """One logical checkpoint weight of the model (official name -> where it goes)."""

    param: str  # model parameter (stacked experts: 'layers.2.ffn.experts.w1')
    shape: tuple[int, ...]  # logical dense shape (one expert)
    expert: int | None = None
    linear: bool = False  # may come quantised, with a `.scale` sibling
    keep_quant: bool = False  # the module can hold the quantised format
    index: bool = False  # integer table (tid2eid)
    shard: "Shard | None" = None  # tensor-parallel rank: the split of the global tensor this rank reads


@dataclass
class Found:
    weight: tuple[str, str, TensorInfo] | None = None  # (shard, checkpoint name, info)
    scale: tuple[str, str, TensorInfo] | None = None
    fmt: str = "dense"


@dataclass
class Plan:
    targets: dict[str, Target]
    found: dict[str, Found]
    fused: dict[str, tuple[str, str, TensorInfo]] = field(default_factory=dict)  # transformers gate_up_proj
    skip_mtp: bool = False
    bytes_read: int = 0  # set by the loader: checkpoint bytes this rank read


def model_targets(model: nn.Module) -> dict[str, Target]:
    """Official checkpoint names of every weight the model needs, with GLOBAL shapes (a tensor-parallel rank's
    split parameters carry the :class:`Shard` it reads; routed experts of other EP ranks are not targets)."""
    out: dict[str, Target] = {}
    linear_params: set[str] = set()
    mods = dict(model.named_modules())
    for mod_name, mod in mods.items():
        if isinstance(mod, Linear):
            keep = mod.keep_checkpoint_format
            out[f"{mod_name}.weight"] = Target(f"{mod_name}.weight", (mod.out_features, mod.in_features),
                                               linear=True, keep_quant=keep, shard=module_shard(mod, "weight"))
            linear_params.update({f"{mod_name}.weight", f"{mod_name}.scale"})
        elif isinstance(mod, Experts):
            for w in ("w1", "w2", "w3"):
                p = getattr(mod, w)
                sh = expert_shard(mod, w)
                shape = sh.global_shape(tuple(p.shape[1:])) if sh else tuple(p.shape[1:])
                for e in range(p.shape[0]):
                    out[f"{mod_name}.{mod.first_expert + e}.{w}.weight"] = Target(
                        f"{mod_name}.{w}", shape, expert=e, linear=True, keep_quant=True, shard=sh)
                linear_params.update({f"{mod_name}.{w}", f"{mod_name}.{w}_scale"})
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name in linear_params or name.endswith("inv_freq"):
            continue
        mod_name, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        sh = module_shard(mods[mod_name], leaf)
        shape = sh.global_shape(tuple(p.shape)) if sh else tuple(p.shape)
        out[name] = Target(name, shape, index=name.endswith("tid2eid"), shard=sh)
    return out


def _fmt_of(info: TensorInfo) -> str:
    if info.dtype_str in FLOAT:
        return "dense"
    if info.dtype_str == "F8_E4M3":
        return "fp8_block"
    if info.dtype_str in ("I8", "U8"):
        return "fp4"
    return "?"


def _expected_stored(fmt: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    o, i = shape
    if fmt == "fp8_block":
        return (o, i), (-(-o // 128), -(-i // 128))
    if fmt == "fp4":
        return (o, i // 2), (o, i // 32)
    return (o, i), None


def plan_load(model: nn.Module, folder: str) -> Plan:
    """Match checkpoint headers against the model; raise one CheckpointError listing every problem."""
    targets = model_targets(model)
    inv = checkpoint_inventory(folder)
    fam, n_layers = family_of(model.cfg), model.cfg.n_layers

    def canon(name: str) -> str | None:
        return fam.canonical_name(name, n_layers)

    found: dict[str, Found] = {}
    fused: dict[str, tuple[str, str, TensorInfo]] = {}
    problems: list[str] = []
    experts = expert_modules(model)
    parallel = any(t.shard is not None for t in targets.values()) or any(m.ep.size > 1 for m in experts.values())

    def where(shard: str, name: str) -> str:
        return f"{os.path.basename(shard)}: {name}"

    for ck_name, (shard, info) in inv.items():
        off = canon(ck_name)
        if off == "":
            continue  # a stored duplicate (e.g. V3's MTP copies of the embedding and head)
        if off is None:
            problems.append(f"{where(shard, ck_name)}: unknown tensor name")
            continue
        if off.endswith((".experts.gate_up_proj", ".experts.w2")) and expert_key(off) is None:
            if parallel:
                problems.append(f"{where(shard, ck_name)}: transformers' fused experts cannot be loaded per rank "
                                f"yet (tensor / expert parallelism); convert the folder to official names")
                continue
            fused[off] = (shard, ck_name, info)  # transformers' fused experts [E, 2I, d] / [E, d, I]
            continue
        if foreign_expert(off, experts):
            continue  # another expert-parallel rank's expert: not read here
        is_scale = off.endswith(".scale") and off[: -len(".scale")] + ".weight" in targets
        key = off[: -len(".scale")] + ".weight" if is_scale else off
        if key not in targets or (is_scale and not targets[key].linear):
            problems.append(f"{where(shard, ck_name)}: unexpected tensor (the model has no {off})")
            continue
        slot = found.setdefault(key, Found())
        setattr(slot, "scale" if is_scale else "weight", (shard, ck_name, info))

    for off, (shard, ck, info) in fused.items():
        layer = off.rsplit(".", 2)[0]  # layers.i.ffn
        w_names = ("w1", "w3") if off.endswith("gate_up_proj") else ("w2",)
        t = targets.get(f"{layer}.experts.0.{w_names[0]}.weight")
        if t is None:
            problems.append(f"{where(shard, ck)}: unexpected tensor")
            continue
        E = sum(1 for k in targets if k.startswith(f"{layer}.experts.") and k.endswith(f".{w_names[0]}.weight"))
        want = (E, t.shape[0] * len(w_names), t.shape[1])
        if info.dtype_str not in FLOAT or tuple(info.shape) != want:
            problems.append(f"{where(shard, ck)}: fused experts expected {want} float, found {info.dtype_str} {list(info.shape)}")
            continue
        for w in w_names:
            for e in range(E):
                found.setdefault(f"{layer}.experts.{e}.{w}.weight", Found(weight=(shard, ck, info), fmt="fused"))

    skip_mtp = not any(k.startswith("mtp.") for k in found)
    expert_fmts: dict[str, set[str]] = {}
    for key, t in targets.items():
        f = found.get(key)
        if f is None or f.weight is None:
            if not (skip_mtp and key.startswith("mtp.")):
                problems.append(f"{key}: missing from the checkpoint in {folder}" + (
                    f" (its scale is in {os.path.basename(f.scale[0])})" if f and f.scale else ""))
            continue
        if f.fmt == "fused":
            continue
        shard, ck, info = f.weight
        w = where(shard, ck)
        if t.index:
            if info.dtype_str not in ("I64", "I32") or tuple(info.shape) != t.shape:
                problems.append(f"{w}: expected int64 {list(t.shape)}, found {info.dtype_str} {list(info.shape)}")
            continue
        fmt = _fmt_of(info) if t.linear else ("dense" if info.dtype_str in FLOAT else "?")
        if fmt == "?":
            problems.append(f"{w}: dtype {info.dtype_str} is not a supported weight dtype")
            continue
        f.fmt = fmt
        if fmt == "fp4" and t.expert is None:
            problems.append(f"{w}: packed FP4 is only supported for routed experts")
            continue
        want_w, want_s = _expected_stored(fmt, t.shape) if t.linear else (t.shape, None)
        if tuple(info.shape) != tuple(want_w):
            problems.append(f"{w}: shape {list(info.shape)} ({info.dtype_str}), expected {list(want_w)} for {key}")
        if want_s is None and f.scale is not None:
            problems.append(f"{where(f.scale[0], f.scale[1])}: unexpected scale for a {info.dtype_str} weight")
        if want_s is not None:
            if f.scale is None:
                problems.append(f"{w}: {info.dtype_str} weight without its scale tensor")
            else:
                s_shard, s_ck, s_info = f.scale
                if s_info.dtype_str not in SCALE_DTYPES or (fmt == "fp4" and s_info.dtype_str == "F32"):
                    problems.append(f"{where(s_shard, s_ck)}: scale dtype {s_info.dtype_str} not supported")
                if tuple(s_info.shape) != tuple(want_s):
                    problems.append(f"{where(s_shard, s_ck)}: scale grid {list(s_info.shape)} does not fit the "
                                    f"weight {list(info.shape)}: expected {list(want_s)}")
        if t.expert is not None:
            expert_fmts.setdefault(t.param, set()).add(fmt)
    for param, fmts in expert_fmts.items():
        if len(fmts) > 1:
            problems.append(f"{param}: routed experts mix formats {sorted(fmts)}; one layer's experts must share one")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match the model ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(problems[:60]) + ("\n  ..." if len(problems) > 60 else ""))
    return Plan(targets, found, fused, skip_mtp)
