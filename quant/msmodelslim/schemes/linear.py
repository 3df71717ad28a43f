"""One msModelSlim linear as a torch module: :class:`QuantLinear` picks, from the linear's variant, one small class
per scheme behind :data:`SCHEME_CLASSES` (float, weight-only, static W8A8, W8A8_MIX, dynamic, W4A8 per group).

``QuantLinear(qtype, tensors, ...)`` validates the tensors (:func:`~.layout.inspect_linear`) and returns an instance
of the scheme's class (every one is a ``QuantLinear``). The math of each is in :mod:`quant.msmodelslim.schemes`.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from quant.errors import QuantFormatError
from quant.msmodelslim.description import FLOAT
from quant.msmodelslim.npu_params import decode_deq_scale, detect_deq_scale_encoding, fp19_truncate, npu_antiquant_offset
from quant.msmodelslim.packing import unpack_int4_rows
from quant.msmodelslim.schemes.layout import ACT_SIMS, INT4_TYPES, PATHS, STATIC_TYPES, LinearLayout, inspect_linear
from quant.msmodelslim.schemes.numerics import (
    as_f32,
    check_int32,
    dynamic_quant_per_token,
    fake_quant_asym_per_token,
    fake_quant_sym_per_input_channel,
    integral,
    round_clamp,
)


def _layout(qtype: str, tensors: Mapping[str, torch.Tensor], name: str) -> LinearLayout:
    layout, problems = inspect_linear(qtype, {s: (t.dtype, tuple(t.shape)) for s, t in tensors.items()}, name)
    if problems:
        raise QuantFormatError("; ".join(problems))
    assert layout is not None
    return layout


class QuantLinear(nn.Module):
    """One msModelSlim linear, computed from its checkpoint tensors.

    Args:
        qtype: the description type of ``<name>.weight`` (FLOAT, W8A16, W8A8, W8A8S, W8A8_MIX, W8A8_DYNAMIC,
            W4A8_DYNAMIC, W4A16).
        tensors: suffix -> tensor (``{"weight": ..., "deq_scale": ..., ...}``).
        name: the linear's key prefix, used in error messages.
        path: ``"int"`` (integer path, what the NPU computes) or ``"float"`` (dequantised fake-quant).
        act_sim: float path of the dynamic types: ``"runtime"``, ``"msmodelslim_v0"`` or ``"msmodelslim_v1"``.
        mix_mode: W8A8_MIX only: ``"static"`` (decode) or ``"dynamic"`` (prefill).
        fixpipe_fp19: int path of the static types: use only the top 19 bits of deq (NPU fixpipe, README.md §5).

    ``forward(x)``: ``x [..., k]`` float -> ``[..., n]`` in ``x.dtype``.
    """

    def __new__(cls, *args, **kwargs):
        if cls is QuantLinear:  # pick the scheme's class from the tensors' variant (the __init__ arguments)
            qtype = args[0] if args else kwargs["qtype"]
            tensors = args[1] if len(args) > 1 else kwargs["tensors"]
            name = args[2] if len(args) > 2 else kwargs.get("name", "")
            cls = SCHEME_CLASSES[_layout(qtype, tensors, name).variant]
        return super().__new__(cls)

    def __init__(self, qtype: str, tensors: Mapping[str, torch.Tensor], name: str = "", path: str = "int",
                 act_sim: str = "runtime", mix_mode: str = "static", fixpipe_fp19: bool = False):
        super().__init__()
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if act_sim not in ACT_SIMS:
            raise ValueError(f"act_sim must be one of {ACT_SIMS}, got {act_sim!r}")
        if mix_mode not in ("static", "dynamic"):
            raise ValueError(f"mix_mode must be 'static' or 'dynamic', got {mix_mode!r}")
        layout = _layout(qtype, tensors, name)
        self.qtype, self.layout, self.name = qtype, layout, name
        self.path, self.act_sim, self.mix_mode, self.fixpipe_fp19 = path, act_sim, mix_mode, fixpipe_fp19
        self.in_features, self.out_features = layout.k, layout.n
        self.deq_encoding: Optional[str] = None
        bias = tensors.get("bias")
        self.register_buffer("bias", None if bias is None else as_f32(bias).reshape(layout.n), persistent=False)
        self._load(tensors, name or "<linear>")

    # -- what each scheme provides -------------------------------------------------------------------------------
    def _load(self, tensors: Mapping[str, torch.Tensor], label: str) -> None:
        raise NotImplementedError

    def dequant_weight(self) -> torch.Tensor:
        """The float32 ``[n, k]`` weight the float path multiplies with."""
        raise NotImplementedError

    def _int_forward(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _float_forward(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``static``, ``dynamic``, ``weight_only`` or ``float``: what forward computes."""
        v = self.layout.variant
        if v == "mix":
            return self.mix_mode
        if v in ("w4a8_per_channel", "w4a8_per_group"):
            return "dynamic"
        return v

    def extra_repr(self) -> str:
        lay = self.layout
        extra = f", group_size={lay.group_size}" if lay.groups > 1 else ""
        return (f"{self.name or '<linear>'}: {self.qtype} ({lay.variant}{extra}), in={lay.k}, out={lay.n}, "
                f"path={self.path}")

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """float32 ``[M, k]`` -> (int64 ``q [M, k]``, per-token scale ``[M]`` or None for static)."""
        if self.mode == "static":
            q = round_clamp(x2 / self.input_scale + self.input_offset).to(torch.int64)
            return q, None
        return dynamic_quant_per_token(x2)

    def int_accumulator(self, x: torch.Tensor) -> torch.Tensor:
        """The exact integer accumulator of the int path, int64.

        static: ``q_x @ W_q^T + quant_bias`` ``[M, n]``; dynamic: ``acc_g`` ``[M, n, G]`` (G = 1 per channel)
        with ``acc_g[m,n,g] = sum_{k in g} q[m,k] * (W_q[n,k] - off[n,g])``. Checked against int32.
        """
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        q, _ = self.quantize_input(x2)
        return self._accumulate(q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or '<linear>'}: input last dim {x.shape[-1]} != in_features {self.in_features}")
        out_dtype = x.dtype if x.dtype.is_floating_point else torch.float32
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        y = self._int_forward(x2) if self.path == "int" else self._float_forward(x2)
        return y.to(out_dtype).reshape(*lead, self.out_features)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


class FloatLinear(QuantLinear):
    """FLOAT: ``y = x @ W^T + bias``."""

    def _load(self, tensors, label):
        self.register_buffer("weight", tensors["weight"].detach(), persistent=False)

    def dequant_weight(self) -> torch.Tensor:
        return as_f32(self.weight)

    def _int_forward(self, x2):
        return self._add_bias(x2 @ self.dequant_weight().T)

    _float_forward = _int_forward


class _IntWeightLinear(QuantLinear):
    """Base of the integer-weight schemes: ``w_q`` int8 ``[n, k]`` (int4 unpacked), per-row scale and offset."""

    def _load(self, tensors, label):
        lay = self.layout
        n = lay.n
        w = tensors["weight"].detach()
        if lay.packed:
            w = unpack_int4_rows(w, f"{label}.weight")
        elif self.qtype in INT4_TYPES and bool(((w < -8) | (w > 7)).any()):
            raise QuantFormatError(f"{label}.weight: unpacked {self.qtype} weight holds values outside int4 -8..7")
        self.register_buffer("w_q", w.to(torch.int8), persistent=False)  # [n, k]

        def rowwise(suffix: str, groups: int) -> Optional[torch.Tensor]:
            t = tensors.get(suffix)
            return None if t is None else as_f32(t).reshape(n, groups)

        # weight_scale/offset groups: G for dynamic / weight-only; 1 (per channel) for static, mix and W4A8 stage 1
        ws_groups = lay.groups if lay.variant in ("dynamic", "weight_only") else 1
        self.register_buffer("weight_scale", rowwise("weight_scale", ws_groups), persistent=False)
        off = rowwise("weight_offset", ws_groups)
        if off is None and self.weight_scale is not None:
            off = torch.zeros_like(self.weight_scale)
        self.register_buffer("weight_offset", off, persistent=False)
        self._load_scheme(tensors, label, rowwise)
        sb = tensors.get("scale_bias")
        self.register_buffer("scale_bias", None if sb is None else as_f32(sb), persistent=False)

    def _load_scheme(self, tensors, label, rowwise) -> None:
        """The scheme's own tensors (static activation parameters, W4A8's second stage)."""

    def _grouped_weight(self, offset: torch.Tensor) -> torch.Tensor:
        """``(W_q + offset) * s`` per channel or group: float32 ``[n, k]``."""
        g = self.weight_scale.shape[1]
        gs = self.in_features // g
        w = (self.w_q.to(torch.float32).reshape(self.out_features, g, gs) + offset.unsqueeze(-1)) \
            * self.weight_scale.unsqueeze(-1)
        return w.reshape(self.out_features, self.in_features)


class WeightOnlyLinear(_IntWeightLinear):
    """W8A16 / W4A16: ``y = x @ W^T + bias`` with ``W = (W_q - off) * s`` (float path) or the NPU antiquant form
    ``(W_q + (-off)) * s`` (int path); the two are equal."""

    def dequant_weight(self) -> torch.Tensor:
        return self._grouped_weight(-self.weight_offset)

    def _int_forward(self, x2):
        return self._add_bias(x2 @ self._grouped_weight(npu_antiquant_offset(self.weight_offset)).T)

    def _float_forward(self, x2):
        return self._add_bias(x2 @ self.dequant_weight().T)


class StaticLinear(_IntWeightLinear):
    """W8A8 / W8A8S (static activation parameters): ``q_x = clamp(round(x / s_x + o_x))``; int path
    ``(q_x @ W_q^T + quant_bias) * deq``; float path ``((q_x - o_x) s_x) @ (W_q deq / s_x)^T + bias``."""

    def _load_scheme(self, tensors, label, rowwise):
        n = self.layout.n
        self.deq_encoding = detect_deq_scale_encoding(tensors["deq_scale"], f"{label}.deq_scale")
        self.register_buffer("deq_scale_raw", tensors["deq_scale"].detach().reshape(n), persistent=False)
        self.register_buffer("deq", decode_deq_scale(tensors["deq_scale"], f"{label}.deq_scale").reshape(n),
                             persistent=False)
        if not bool((self.deq > 0).all()) or not bool(torch.isfinite(self.deq).all()):
            raise QuantFormatError(f"{label}.deq_scale: decoded values must be finite and > 0")
        self.register_buffer("input_scale", as_f32(tensors["input_scale"]).reshape(()), persistent=False)
        self.register_buffer("input_offset", integral(as_f32(tensors["input_offset"]).reshape(()),
                                                      f"{label}.input_offset"), persistent=False)
        self.register_buffer("quant_bias", tensors["quant_bias"].detach().reshape(n).to(torch.int32),
                             persistent=False)
        if float(self.input_scale) <= 0:
            raise QuantFormatError(f"{label}.input_scale: must be > 0, found {float(self.input_scale)}")

    def dequant_weight(self) -> torch.Tensor:
        return self.w_q.to(torch.float32) * (self.deq / self.input_scale).unsqueeze(1)

    def _accumulate(self, q: torch.Tensor) -> torch.Tensor:
        label = self.name or "<linear>"
        acc = q @ self.w_q.to(torch.int64).T
        check_int32(acc, label)
        acc = acc + self.quant_bias.to(torch.int64)
        check_int32(acc, label)
        return acc

    def _int_forward(self, x2):
        q, _ = self.quantize_input(x2)
        deq = fp19_truncate(self.deq) if self.fixpipe_fp19 else self.deq
        return self._accumulate(q).to(torch.float32) * deq  # the FLOAT bias is inside quant_bias

    def _float_forward(self, x2):
        q, _ = self.quantize_input(x2)
        xdq = (q.to(torch.float32) - self.input_offset) * self.input_scale
        return self._add_bias(xdq @ self.dequant_weight().T)


class DynamicLinear(_IntWeightLinear):
    """W8A8_DYNAMIC and W4A8_DYNAMIC per channel: per-token activations ``s_t = max|x_t| / 127``; int path
    ``y = s_t * sum_g s_w[n, g] acc_g + bias``; float path ``fq(x) @ ((W_q - off) s_w)^T + bias`` with ``fq`` per
    ``act_sim``."""

    def _zero_points(self) -> torch.Tensor:
        """Integer weight zero points ``[n, G]`` (int path)."""
        return integral(self.weight_offset, f"{self.name or '<linear>'}.weight_offset")

    def dequant_weight(self) -> torch.Tensor:
        return self._grouped_weight(-self.weight_offset)

    def _accumulate(self, q: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        zp = self._zero_points().to(torch.int64)  # [n, G]
        g = zp.shape[1]
        gs = lay.k // g
        wz = self.w_q.to(torch.int64).reshape(lay.n, g, gs) - zp.unsqueeze(-1)
        acc = torch.einsum("mgs,ngs->mng", q.reshape(q.shape[0], g, gs), wz)
        check_int32(acc, self.name or "<linear>")
        return acc

    def _int_forward(self, x2):
        q, s_t = self.quantize_input(x2)  # per token (a row-parallel rank may override it: global max)
        acc = self._accumulate(q)
        if acc.shape[-1] == 1:
            y = acc[..., 0].to(torch.float32) * self.weight_scale[:, 0] * s_t.unsqueeze(-1)
        else:
            y = (acc.to(torch.float32) * self.weight_scale.unsqueeze(0)).sum(-1) * s_t.unsqueeze(-1)
        return self._add_bias(y)

    def _float_forward(self, x2):
        if self.act_sim == "runtime":
            q, s_t = dynamic_quant_per_token(x2)
            xdq = q.to(torch.float32) * s_t.unsqueeze(-1)
        elif self.act_sim == "msmodelslim_v0":
            xdq = fake_quant_asym_per_token(x2)
        else:
            xdq = fake_quant_sym_per_input_channel(x2)
        return self._add_bias(xdq @ self.dequant_weight().T)


class W4A8PerGroupLinear(DynamicLinear):
    """W4A8_DYNAMIC per group (older v0, two stages): ``W = ((q4 - off2) * s2 - off1) * s1``; int path
    ``y = s_t * s1 * (sum_g s2[n, g] acc_g - off1 * sum_k q) + bias``."""

    def _load_scheme(self, tensors, label, rowwise):
        g = self.layout.groups
        self.register_buffer("scale2", rowwise("weight_scale_second", g), persistent=False)
        self.register_buffer("offset2", integral(as_f32(tensors["weight_offset_second"]).reshape(self.layout.n, g),
                                                 f"{label}.weight_offset_second"), persistent=False)

    def _zero_points(self) -> torch.Tensor:
        return self.offset2

    def dequant_weight(self) -> torch.Tensor:
        lay = self.layout
        gs = lay.k // lay.groups
        wq = self.w_q.to(torch.float32)
        stage1 = (wq.reshape(lay.n, lay.groups, gs) - self.offset2.unsqueeze(-1)) * self.scale2.unsqueeze(-1)
        return (stage1.reshape(lay.n, lay.k) - self.weight_offset) * self.weight_scale

    def _int_forward(self, x2):
        q, s_t = self.quantize_input(x2)
        t = (self._accumulate(q).to(torch.float32) * self.scale2.unsqueeze(0)).sum(-1)  # [M, n]
        if bool((self.weight_offset != 0).any()):
            t = t - self.weight_offset[:, 0] * q.sum(-1, keepdim=True).to(torch.float32)
        return self._add_bias(t * self.weight_scale[:, 0] * s_t.unsqueeze(-1))


class MixLinear(StaticLinear):
    """W8A8_MIX: the static scheme in decode (``mix_mode="static"``), the per-token dynamic one in prefill
    (``mix_mode="dynamic"``, from its ``weight_scale`` / ``weight_offset``)."""

    def _dynamic(self) -> bool:
        return self.mix_mode == "dynamic"

    def dequant_weight(self) -> torch.Tensor:
        return DynamicLinear.dequant_weight(self) if self._dynamic() else StaticLinear.dequant_weight(self)

    def _zero_points(self) -> torch.Tensor:
        return DynamicLinear._zero_points(self)

    def _accumulate(self, q: torch.Tensor) -> torch.Tensor:
        return DynamicLinear._accumulate(self, q) if self._dynamic() else StaticLinear._accumulate(self, q)

    def _int_forward(self, x2):
        return DynamicLinear._int_forward(self, x2) if self._dynamic() else StaticLinear._int_forward(self, x2)

    def _float_forward(self, x2):
        return DynamicLinear._float_forward(self, x2) if self._dynamic() else StaticLinear._float_forward(self, x2)


#: variant (:attr:`LinearLayout.variant`) -> the class computing it
SCHEME_CLASSES: dict[str, type[QuantLinear]] = {
    "float": FloatLinear,
    "weight_only": WeightOnlyLinear,
    "static": StaticLinear,
    "mix": MixLinear,
    "dynamic": DynamicLinear,
    "w4a8_per_channel": DynamicLinear,
    "w4a8_per_group": W4A8PerGroupLinear,
}

__all__ = ["DynamicLinear", "FloatLinear", "MixLinear", "QuantLinear", "SCHEME_CLASSES", "StaticLinear",
           "W4A8PerGroupLinear", "WeightOnlyLinear"]
