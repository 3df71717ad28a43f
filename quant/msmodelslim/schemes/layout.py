"""The tensors each linear type has (:data:`SCHEMES`), and :func:`inspect_linear`, which checks a linear's tensors
from dtypes and shapes only and tells its variant (float, static, mix, dynamic, weight-only, W4A8 per channel or
per group). The table of types and tensors is in :mod:`quant.msmodelslim.schemes` and ``README.md`` §4."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from quant.msmodelslim.description import (
    FLOAT,
    QUANT_LINEAR_TYPES,
    RECOGNISED_UNSUPPORTED_TYPES,
    W4A16,
    W4A8_DYNAMIC,
    W8A16,
    W8A8,
    W8A8_DYNAMIC,
    W8A8_MIX,
    W8A8S,
)

__all__ = ["ACT_SIMS", "DYNAMIC_TYPES", "FLOAT_DTYPES", "INT4_TYPES", "KV_SUFFIXES", "LINEAR_SUFFIXES", "LinearLayout",
           "NORM_MODULE_SUFFIXES", "PATHS", "ParamSpec", "QUANT_LINEAR_TYPES", "SCHEMES", "STATIC_TYPES",
           "WEIGHT_ONLY_TYPES", "inspect_linear"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

LINEAR_SUFFIXES = (
    "weight",
    "bias",
    "weight_scale",
    "weight_offset",
    "input_scale",
    "input_offset",
    "quant_bias",
    "deq_scale",
    "scale_bias",
    "weight_scale_second",
    "weight_offset_second",
)
KV_SUFFIXES = ("kv_cache_scale", "kv_cache_offset")
NORM_MODULE_SUFFIXES = ("module.weight", "module.bias")

STATIC_TYPES = (W8A8, W8A8S, W8A8_MIX)
DYNAMIC_TYPES = (W8A8_DYNAMIC, W4A8_DYNAMIC)
WEIGHT_ONLY_TYPES = (W8A16, W4A16)
INT4_TYPES = (W4A8_DYNAMIC, W4A16)

ACT_SIMS = ("runtime", "msmodelslim_v0", "msmodelslim_v1")
PATHS = ("int", "float")


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of a linear: suffix, accepted dtypes, shape rule (text), required or not."""

    suffix: str
    dtypes: tuple[torch.dtype, ...]
    shape: str
    required: bool = True


_I8 = (torch.int8,)
_DEQ = (torch.int64, torch.float32) + ((torch.uint64,) if hasattr(torch, "uint64") else ())
_OFF_IN = FLOAT_DTYPES + (torch.int8,)
_INT_OFF2 = (torch.int64, torch.int32) + FLOAT_DTYPES

_STATIC = (
    ParamSpec("weight", _I8, "[n,k]"),
    ParamSpec("input_scale", FLOAT_DTYPES, "[1]"),
    ParamSpec("input_offset", _OFF_IN, "[1]"),
    ParamSpec("quant_bias", (torch.int32,), "[n]"),
    ParamSpec("deq_scale", _DEQ, "[n]"),
    ParamSpec("weight_scale", FLOAT_DTYPES, "[n,1]", required=False),
    ParamSpec("weight_offset", FLOAT_DTYPES, "[n,1]", required=False),
    ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False),
)

#: type -> the tensors a linear of that type has.
SCHEMES: dict[str, tuple[ParamSpec, ...]] = {
    FLOAT: (ParamSpec("weight", FLOAT_DTYPES, "[n,k]"), ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False)),
    W8A16: (
        ParamSpec("weight", _I8, "[n,k]"),
        ParamSpec("weight_scale", FLOAT_DTYPES, "[n,1] or [n,k/gs]"),
        ParamSpec("weight_offset", FLOAT_DTYPES, "as weight_scale"),
        ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False),
    ),
    W4A16: (
        ParamSpec("weight", _I8, "[n,k] int4 values (unpacked)"),
        ParamSpec("weight_scale", FLOAT_DTYPES, "[n,1] or [n,k/gs]"),
        ParamSpec("weight_offset", FLOAT_DTYPES, "as weight_scale"),
        ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False),
    ),
    W8A8: _STATIC,
    W8A8S: _STATIC,
    W8A8_MIX: tuple(
        ParamSpec(p.suffix, p.dtypes, p.shape, True) if p.suffix in ("weight_scale", "weight_offset") else p
        for p in _STATIC
    ),
    W8A8_DYNAMIC: (
        ParamSpec("weight", _I8, "[n,k]"),
        ParamSpec("weight_scale", FLOAT_DTYPES, "[n,1] or [n,k/gs]"),
        ParamSpec("weight_offset", FLOAT_DTYPES, "as weight_scale"),
        ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False),
    ),
    W4A8_DYNAMIC: (
        ParamSpec("weight", _I8, "[n/2,k] packed, or [n,k] unpacked"),
        ParamSpec("weight_scale", FLOAT_DTYPES, "[n,1]"),
        ParamSpec("weight_offset", FLOAT_DTYPES, "[n,1]"),
        ParamSpec("scale_bias", FLOAT_DTYPES, "[n,1] or [n,16]", required=False),
        ParamSpec("weight_scale_second", FLOAT_DTYPES, "[n,k/gs]", required=False),
        ParamSpec("weight_offset_second", _INT_OFF2, "[n,k/gs]", required=False),
        ParamSpec("bias", FLOAT_DTYPES, "[n]", required=False),
    ),
}


@dataclass(frozen=True)
class LinearLayout:
    """What :func:`inspect_linear` learned about one linear from dtypes and shapes.

    ``variant`` is one of ``float``, ``static``, ``mix``, ``dynamic``, ``weight_only``, ``w4a8_per_channel``,
    ``w4a8_per_group``. ``groups`` is the number of scale groups along k (1 = per channel); ``packed`` is True for
    int4 weights stored two per byte ([n/2,k]).
    """

    qtype: str
    variant: str
    n: int
    k: int
    groups: int = 1
    packed: bool = False
    has_bias: bool = False

    @property
    def group_size(self) -> Optional[int]:
        return None if self.groups == 1 else self.k // self.groups


Meta = tuple  # (torch.dtype, tuple[int, ...])


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def inspect_linear(qtype: str, metas: Mapping[str, Meta], name: str = "") -> tuple[Optional[LinearLayout], list[str]]:
    """Check a linear's tensors against :data:`SCHEMES` from dtypes and shapes only.

    ``metas`` maps suffix -> ``(dtype, shape)``. Returns ``(layout, problems)``; ``layout`` is None when the
    problems make n/k unknowable. Every problem names ``<name>.<suffix>``.
    """
    label = name or "<linear>"
    if qtype in RECOGNISED_UNSUPPORTED_TYPES:
        return None, [f"{label}: type {qtype} is recognised but not supported by this loader"]
    if qtype not in SCHEMES:
        return None, [f"{label}: {qtype!r} is not a linear quantisation type"]
    specs = SCHEMES[qtype]
    problems: list[str] = []
    known = {p.suffix for p in specs}
    for p in specs:
        if p.required and p.suffix not in metas:
            problems.append(f"{label}.{p.suffix}: missing (a {qtype} linear needs it, {p.shape})")
    for suffix, (dtype, _shape) in metas.items():
        if suffix not in known:
            problems.append(f"{label}.{suffix}: not a tensor of a {qtype} linear (expected {', '.join(sorted(known))})")
            continue
        spec = next(p for p in specs if p.suffix == suffix)
        if dtype not in spec.dtypes:
            problems.append(
                f"{label}.{suffix}: dtype {dtype} not allowed for {qtype} (expected one of "
                f"{', '.join(str(d).replace('torch.', '') for d in spec.dtypes)})"
            )
    if "weight" not in metas:
        return None, problems
    wshape = tuple(metas["weight"][1])
    if len(wshape) != 2:
        problems.append(f"{label}.weight: expected a 2-D [n,k] tensor, found shape {list(wshape)}")
        return None, problems
    rows, k = wshape
    n = rows
    packed = False
    if qtype in INT4_TYPES and "weight_scale" in metas:
        ws = tuple(metas["weight_scale"][1])
        n_s = ws[0] if ws else 1
        if n_s == 2 * rows:
            n, packed = n_s, True
        elif n_s != rows:
            problems.append(
                f"{label}.weight: {list(wshape)} is neither [n,k] nor packed [n/2,k] for weight_scale rows n={n_s}"
            )
            return None, problems
    if qtype == W4A16 and packed:
        problems.append(
            f"{label}.weight: packed W4A16 weights ([n/2,k]) are not supported (their packing is not verified); "
            f"use the unpacked v0 safe_tensor output"
        )

    def per_row(suffix: str, allow_groups: bool) -> int:
        """Check a [n], [n,1] or [n,G] tensor; return G (1 = per channel)."""
        if suffix not in metas:
            return 1
        shape = tuple(metas[suffix][1])
        if len(shape) == 1 and shape[0] == n:
            return 1
        if len(shape) == 2 and shape[0] == n and shape[1] >= 1:
            g = shape[1]
            if g == 1:
                return 1
            if allow_groups and k % g == 0:
                return g
        want = "[n] or [n,1]" + (" or [n,G] with k % G == 0" if allow_groups else "")
        problems.append(f"{label}.{suffix}: shape {list(shape)} does not fit n={n}, k={k} (expected {want})")
        return 1

    groups = 1
    variant = "float"
    if qtype in STATIC_TYPES:
        variant = "mix" if qtype == W8A8_MIX else "static"
        for s in ("input_scale", "input_offset"):
            if s in metas and _numel(metas[s][1]) != 1:
                problems.append(f"{label}.{s}: expected one value ([1]), found shape {list(metas[s][1])}")
        for s in ("quant_bias", "deq_scale"):
            if s in metas and _numel(metas[s][1]) != n:
                problems.append(f"{label}.{s}: expected [n] with n={n}, found shape {list(metas[s][1])}")
        per_row("weight_scale", False)
        per_row("weight_offset", False)
    elif qtype in WEIGHT_ONLY_TYPES or qtype == W8A8_DYNAMIC:
        variant = "weight_only" if qtype in WEIGHT_ONLY_TYPES else "dynamic"
        groups = per_row("weight_scale", True)
        g2 = per_row("weight_offset", True)
        if "weight_offset" in metas and g2 != groups:
            problems.append(f"{label}.weight_offset: shape {list(metas['weight_offset'][1])} differs from weight_scale")
    elif qtype == W4A8_DYNAMIC:
        per_row("weight_scale", False)
        per_row("weight_offset", False)
        two_stage = [s for s in ("weight_scale_second", "weight_offset_second") if s in metas]
        if len(two_stage) == 1:
            other = ({"weight_scale_second", "weight_offset_second"} - set(two_stage)).pop()
            problems.append(f"{label}.{other}: missing (per-group W4A8 has both *_second tensors)")
        if two_stage:
            variant = "w4a8_per_group"
            groups = per_row("weight_scale_second", True)
            if "weight_offset_second" in metas and per_row("weight_offset_second", True) != groups:
                problems.append(f"{label}.weight_offset_second: shape differs from weight_scale_second")
        else:
            variant = "w4a8_per_channel"
        if "scale_bias" in metas:
            sb = tuple(metas["scale_bias"][1])
            if not (sb and sb[0] == n and len(sb) <= 2):
                problems.append(f"{label}.scale_bias: expected [n,1] or [n,16] with n={n}, found {list(sb)}")
    elif qtype == FLOAT:
        variant = "float"
    if "bias" in metas and tuple(metas["bias"][1]) not in ((n,), (n, 1)):
        problems.append(f"{label}.bias: expected [n] with n={n}, found shape {list(metas['bias'][1])}")
    return LinearLayout(qtype, variant, n, k, groups, packed, "bias" in metas), problems
