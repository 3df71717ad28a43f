"""msModelSlim linears for the NPU backend: parameters converted once at load, computed by ``atb_ops.quant_linear``.

:func:`to_npu_linear` turns a :class:`quant.msmodelslim.QuantLinear` into an :class:`NpuQuantLinear` holding only
the tensors the NPU ops take (``quant.msmodelslim.npu_params.prepare_npu_linear``: weight ``[K, N]``, deq_scale
as stored, quant_bias per rank, negated antiquant offset; W4A8 per-channel int4 values widened to int8 for
``npu_quant_matmul``), and drops the checkpoint-layout copy. Forms without an NPU parameter form (per-group
W8A8_DYNAMIC, the older per-group W4A8, non-zero dynamic offsets) keep the QuantLinear and are logged.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

import atb_ops
from quant.errors import QuantFormatError
from quant.msmodelslim.npu_params import (MAX_MATMUL_DIM, decode_deq_scale, npu_kv_cache_params, prepare_npu_linear,
                                          weight_to_npu_layout)

log = logging.getLogger("ascend_dsv4")


class _Part(nn.Module):
    """One column block of an :class:`NpuQuantLinear` (all N when N <= the NPU matmul limit)."""

    def __init__(self, **tensors):
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k, v, persistent=False)


class NpuQuantLinear(nn.Module):
    takes_model_dtype = True  # QuantLinearAdapter hands it x in the model dtype (the NPU ops quantise that)

    """``forward(x [M, K]) -> [M, N]`` through :func:`atb_ops.quant_linear` (mode, NPU-layout tensors).

    ``npu_quant_matmul`` / ``npu_weight_quant_batchmatmul`` take N <= 65535 (the torch_npu API documentation; e.g. the
    DeepSeek-V4-Pro ``wq_b`` has N = 128 x 512 = 65536): a wider linear is stored as column blocks (weight and
    per-channel tensors sliced along N at load, in multiples of 8 for int4-in-int32 weights) whose outputs are
    concatenated.
    """

    def __init__(self, name: str, mode: str, weight: torch.Tensor, scale: torch.Tensor, bias=None, offset=None,
                 input_scale=None, input_offset=None, group_size: int = 0, max_n: Optional[int] = None):
        super().__init__()
        self.name, self.mode, self.group_size = name, mode, int(group_size)
        packed = weight.dtype == torch.int32
        self.in_features = weight.shape[0]
        self.out_features = n = weight.shape[1] * (8 if packed else 1)  # int4: 8 per int32
        limit = MAX_MATMUL_DIM if max_n is None else max_n
        chunks = -(-n // limit)
        size = -(-n // chunks)
        if packed:
            size = -(-size // 8) * 8
        self.register_buffer("input_scale", input_scale, persistent=False)
        self.register_buffer("input_offset", input_offset, persistent=False)
        parts = []
        for a in range(0, n, size):
            b = min(n, a + size)

            def cols(t, a=a, b=b):
                return None if t is None else t[..., a:b].contiguous()

            w = weight[:, a // 8:b // 8].contiguous() if packed else cols(weight)
            parts.append(_Part(weight=w, scale=cols(scale), bias=cols(bias), offset=cols(offset)))
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [atb_ops.quant_linear(x, p.weight, self.mode, p.scale, p.bias, p.offset, self.input_scale,
                                     self.input_offset, self.group_size) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @property
    def weight(self) -> torch.Tensor:
        w = [p.weight for p in self.parts]
        return w[0] if len(w) == 1 else torch.cat(w, dim=-1)

    def _cat(self, attr: str) -> Optional[torch.Tensor]:
        ts = [getattr(p, attr) for p in self.parts]
        return None if ts[0] is None else (ts[0] if len(ts) == 1 else torch.cat(ts, dim=-1))

    @property
    def scale(self) -> torch.Tensor:
        return self._cat("scale")

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self._cat("bias")

    @property
    def offset(self) -> Optional[torch.Tensor]:
        return self._cat("offset")

    def dequant_weight(self) -> torch.Tensor:
        """float32 ``[N, K]`` (for consumers that need the matrix, e.g. MLA absorption)."""
        if self.weight.dtype == torch.int32:
            from quant.msmodelslim.npu_params import npu_int4_weight_values

            w = npu_int4_weight_values(self.weight).float()
        else:
            w = self.weight.float()  # [K, N]
        k, n = w.shape
        if self.mode == "weight_only":
            rep = (lambda t: t.float().reshape(-1, n).repeat_interleave(self.group_size, 0)[:k]) if self.group_size \
                else (lambda t: t.float().reshape(1, n))
            if self.offset is not None:
                w = w + rep(self.offset)
            return (w * rep(self.scale)).t().contiguous()
        if self.mode == "dynamic":
            return (w * self.scale.float().reshape(1, n)).t().contiguous()
        deq = decode_deq_scale(self.scale) if self.scale.dtype == torch.int64 else self.scale.float()
        return (w * (deq.reshape(1, n) / self.input_scale.float().reshape(()))).t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.name}: npu {self.mode}, in={self.in_features}, out={self.out_features}"


def to_npu_linear(ql: nn.Module, dtype: Optional[torch.dtype] = None,
                  max_n: Optional[int] = None) -> Optional[NpuQuantLinear]:
    """The NPU form of a QuantLinear, or None (logged) when it has none.

    ``dtype``: the activation dtype it will run in. ``npu_quant_matmul`` takes a float32/bfloat16 ``scale`` for
    bfloat16 output (int64 scales are for int8/float16 output, the torch_npu API documentation), so a static linear whose
    deq_scale is stored as int64 words gets it decoded to float32 for a bfloat16 model."""
    name = ql.name or "<linear>"
    variant = ql.layout.variant
    try:
        if variant == "w4a8_per_channel":
            if bool((ql.weight_offset != 0).any()):
                raise QuantFormatError(f"{name}.weight_offset: non-zero W4A8 offsets have no npu_quant_matmul form")
            # int4 values widened to int8: npu_quant_matmul int8 x int8 computes the same integers (the int4
            # grouped-matmul form needs scale_bias, whose kernel semantics are not documented for emulation)
            return NpuQuantLinear(name, "dynamic", weight_to_npu_layout(ql.w_q), ql.weight_scale[:, 0].contiguous(),
                                  bias=ql.bias, max_n=max_n)
        if variant in ("float",):
            return None
        deq_enc = "float32" if dtype == torch.bfloat16 and variant in ("static", "mix") else None
        p = prepare_npu_linear(ql, deq_encoding=deq_enc)
    except QuantFormatError as e:
        log.warning("msModelSlim %s stays on the CPU-layout QuantLinear path on the npu backend: %s", name, e)
        return None
    if p["op"] == "npu_weight_quant_batchmatmul":
        return NpuQuantLinear(name, "weight_only", p["weight"], p["antiquant_scale"], p["bias"],
                              p["antiquant_offset"], group_size=p["antiquant_group_size"], max_n=max_n)
    if p["op"] == "npu_quant_matmul" and "deq_scale" in p:
        return NpuQuantLinear(name, "static", p["weight"], p["deq_scale"], p["bias"], None, p["input_scale"],
                              p["input_offset"], max_n=max_n)
    if p["op"] == "npu_quant_matmul":
        return NpuQuantLinear(name, "dynamic", p["weight"], p["scale"], p["bias"], max_n=max_n)
    log.warning("msModelSlim %s: no NPU form for op %s; keeping the QuantLinear", name, p["op"])
    return None


class NpuQuantExperts(nn.Module):
    """Routed experts whose w1 / w3 / w2 are all dynamic per-channel int8 (W8A8_DYNAMIC, W4A8 per channel): the
    weights stacked ``[E, K, N]`` with scales ``[E, N]``, each projection one :func:`atb_ops.quant_grouped_matmul`
    over the routed rows (instead of a loop over experts). Same math as ``QuantExperts``."""

    def __init__(self, w: dict[str, tuple[torch.Tensor, torch.Tensor]], limit: float, weight_after_w2: bool):
        super().__init__()
        self.limit, self.weight_after_w2 = limit, weight_after_w2
        for k, (wt, sc) in w.items():
            self.register_buffer(k, wt, persistent=False)
            self.register_buffer(k + "_scale", sc, persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        y = self._rows(x[tok], flat[order], weights.reshape(-1)[order], x.dtype)
        return torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)

    def _rows(self, xs: torch.Tensor, e: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows xs [n, d] sorted by local expert id e [n], routing weights w [n] -> float32 [n, d], each row its
        expert's weighted output (what expert-parallel dispatch asks of this rank: ``ParallelQuantExperts``)."""
        h = atb_ops.swiglu(atb_ops.quant_grouped_matmul(xs, self.w1, e, self.w1_scale),
                           atb_ops.quant_grouped_matmul(xs, self.w3, e, self.w3_scale), self.limit)
        wt = w.unsqueeze(-1)
        if self.weight_after_w2:
            return atb_ops.quant_grouped_matmul(h.to(dtype), self.w2, e, self.w2_scale).float() * wt
        return atb_ops.quant_grouped_matmul((h * wt).to(dtype), self.w2, e, self.w2_scale).float()


def to_npu_experts(experts: nn.Module) -> nn.Module:
    """``QuantExperts`` -> :class:`NpuQuantExperts` when every expert linear has an NPU dynamic per-channel form
    without bias; otherwise the experts unchanged (their linears already converted one by one)."""
    stacks: dict[str, list] = {"w1": [], "w3": [], "w2": []}
    for name in stacks:
        for adapter in getattr(experts, name):
            ql = adapter.ql
            if not isinstance(ql, NpuQuantLinear) or ql.mode != "dynamic" or ql.bias is not None \
                    or ql.weight.dtype != torch.int8:
                return experts
            stacks[name].append(ql)
    w = {n: (torch.stack([q.weight for q in qs]), torch.stack([q.scale.float() for q in qs]))
         for n, qs in stacks.items()}
    return NpuQuantExperts(w, experts.limit, experts.weight_after_w2)


class NpuKVCacheQuant(nn.Module):
    """msModelSlim C8 KV quantisation of one projection in NPU form (``quant.msmodelslim.npu_params
    .npu_kv_cache_params``): :meth:`quantize` writes int8 through :func:`atb_ops.kv_quant` (``npu_quantize`` on the
    npu backend: ``round(x * (1/s) + o)``); ``antiquant_scale`` / ``antiquant_offset`` (= s, -o, float32 ``[C]``)
    are what an int8-KV attention op reads the cache back with (``npu_fused_infer_attention_score``'s
    ``key_antiquant_scale`` / ``key_antiquant_offset``, per channel). Neither DeepSeek family reads C8 KV (MLA
    has no k_proj / v_proj; DeepSeek's MLA C8 is msModelSlim's separate ``FAKQuant``), so no model uses it yet.
    """

    def __init__(self, name: str, scale: torch.Tensor, offset: Optional[torch.Tensor] = None):
        super().__init__()
        self.name = name
        p = npu_kv_cache_params(scale, offset, name)
        for k, v in p.items():
            self.register_buffer(k, v, persistent=False)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., C]`` float -> int8 ``[..., C]``."""
        return atb_ops.kv_quant(x, self.quant_scale, self.quant_offset)

    def dequantize(self, q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The read-back an int8-KV attention op performs: ``(q + antiquant_offset) * antiquant_scale``."""
        y = q.float()
        if self.antiquant_offset is not None:
            y = y + self.antiquant_offset
        return (y * self.antiquant_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(x), x.dtype)


def to_npu_kv_cache(kvq: nn.Module) -> NpuKVCacheQuant:
    """A :class:`quant.msmodelslim.KVCacheQuant` in NPU form (zero offsets of a symmetric quantiser dropped)."""
    off = None if kvq.symmetric else kvq.offset
    return NpuKVCacheQuant(kvq.name, kvq.scale, off)
