"""What an Ascend NPU op needs from an msModelSlim linear: pure tensor functions, testable on CPU.

Everything here is a plain function of tensors (no torch_npu). The tests check each against an emulation of the
NPU op written from the torch_npu API documentation, and against the reference integer path of :mod:`.schemes`.

**Weight layout.** msModelSlim stores ``weight [N, K]`` (out, in); ``npu_quant_matmul`` /
``npu_weight_quant_batchmatmul`` take ``x2 [K, N]`` (vllm-ascend transposes at load, ``quantization/methods``):
:func:`weight_to_npu_layout`. (The NZ re-tiling ``npu_format_cast(w, 29)`` keeps logical shape and values,
per the torch_npu documentation of ``npu_format_cast``, so it has no CPU counterpart.)

**Offset sign** (msModelSlim's dequantisation formula, README.md §4). The checkpoint stores a *subtractive*
zero point, ``W = (w - zp) * scale``; the NPU antiquant *adds* its offset, ``W = (w + antiquant_offset) * scale``
(torch_npu documentation of ``npu_weight_quant_batchmatmul``). Hence :func:`npu_antiquant_offset` ``(zp) = -zp``, applied exactly once.

**deq_scale encodings** (README.md §5). Three encodings of one float32 ``d``:

=====================  ==========================================================================  =============
name                   int64 / float value                                                         who writes it
=====================  ==========================================================================  =============
``msmodelslim_int64``  ``int64(int32_bits(d))``: the float32 bits in the low word, sign-extended     msModelSlim
                       (high word 0 for d > 0). No mask, no flag. The grouped-matmul "raw bit-cast"  (fp16/fp32
                       scales (vllm-ascend W4A8, cann-recipes) are the same bits zero-extended.     models)
``trans_quant_param``  ``(bits(d) & 0xFFFFE000) | 1 << 46 [| (off & 0x1FF) << 37]``: 19-bit float    npu_trans_
                       (sign, exponent, 10 mantissa bits), flag bit 46, optional 9-bit signed offset quant_param
``float32``            ``d`` itself, dtype float32                                                  bf16 models
=====================  ==========================================================================  =============

Both int64 layouts decode with ``bits & 0xFFFFFFFF`` viewed as float32 (the TransQuantParam one yields the
19-bit-truncated value). :func:`detect_deq_scale_encoding` tells them apart element by element and refuses a
tensor that mixes them.

**TP rule for quant_bias** (as vllm-ascend applies it): the zero-point correction and the float bias are folded into
``quant_bias``, so a row-parallel layer (K split across ranks, partial outputs summed) adds it on rank 0 only;
a column-parallel layer adds its own slice on every rank: :func:`quant_bias_for_rank`.

**N > 65535** (``npu_quant_matmul`` documents ``k, n <= 65535``): :func:`split_output_dim`.

**C8 KV cache** (msModelSlim ``kv_cache_scale`` / ``kv_cache_offset``): the cache write's reciprocal scale and the
attention read's negated antiquant offset, :func:`npu_kv_cache_params`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from quant.errors import QuantFormatError, tensor_label
from quant.msmodelslim.packing import pack_int4_to_int32, unpack_int32_to_int4, unpack_int4_rows

#: The largest K or N ``npu_quant_matmul`` accepts (``MATMUL_MAX_AXIS_VALUE`` in cann-recipes).
MAX_MATMUL_DIM = 65535

DEQ_MSMODELSLIM_INT64 = "msmodelslim_int64"
DEQ_TRANS_QUANT_PARAM = "trans_quant_param"
DEQ_FLOAT32 = "float32"
DEQ_ENCODINGS = (DEQ_MSMODELSLIM_INT64, DEQ_TRANS_QUANT_PARAM, DEQ_FLOAT32)

_FLAG46 = 1 << 46
_FP19_MASK = 0xFFFFE000
_LOW32 = 0xFFFFFFFF
_OFFSET_SHIFT = 37
_OFFSET_MASK = 0x1FF


# ---------------------------------------------------------------------------------------------------------------
# float32 <-> bits


def float32_bits(x: torch.Tensor) -> torch.Tensor:
    """IEEE-754 bits of ``x`` (cast to float32) as int64 in ``[0, 2^32)`` (zero-extended)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & _LOW32


def bits_to_float32(bits: torch.Tensor) -> torch.Tensor:
    """float32 whose bits are the low 32 bits of the int64 ``bits`` (higher bits ignored)."""
    b = bits.to(torch.int64) & _LOW32
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def fp19_truncate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with the low 13 mantissa bits cleared: what the NPU fixpipe uses of an int64 scale."""
    return bits_to_float32(float32_bits(x) & _FP19_MASK)


# ---------------------------------------------------------------------------------------------------------------
# deq_scale encodings


def encode_deq_scale_msmodelslim(deq: torch.Tensor) -> torch.Tensor:
    """float ``[N]`` -> int64 ``[N]``: ``int64(int32_bits(float32(deq)))``, sign-extended (msModelSlim §5)."""
    return deq.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def decode_deq_scale_msmodelslim(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` (msModelSlim or raw bit-cast) -> float32 ``[N]`` from the low 32 bits."""
    return bits_to_float32(t)


def encode_deq_scale_trans_quant_param(
    scale: torch.Tensor, offset: Optional[torch.Tensor] = None, round_mode: int = 0
) -> torch.Tensor:
    """``npu_trans_quant_param(scale, offset, round_mode=0)`` (torch_npu documentation; README.md §5).

    ``out = (bits(scale) & 0xFFFFE000) | 1 << 46``; with an offset,
    ``o = clamp(round(offset), -256, 255)`` and ``out = (out & 0x4000FFFFFFFF) | ((o & 0x1FF) << 37)``.
    ``scale`` float ``[N]`` / ``[1, N]``; ``offset`` broadcastable to it. Returns int64.

    ``round_mode=1`` (rounding to FP19 instead of truncating) is refused: its exact rounding is not documented.
    """
    if round_mode != 0:
        raise ValueError("npu_trans_quant_param round_mode=1 is not emulated (its FP19 rounding is undocumented)")
    out = (float32_bits(scale) & _FP19_MASK) | _FLAG46
    if offset is not None:
        o = offset.to(torch.float32).round().clamp(-256, 255).to(torch.int64)
        out, o = torch.broadcast_tensors(out, o)
        out = (out & 0x4000FFFFFFFF) | ((o & _OFFSET_MASK) << _OFFSET_SHIFT)
    return out


def decode_deq_scale_trans_quant_param(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 TransQuantParam words -> (float32 19-bit scale, int32 offset in -256..255; 0 when none was packed)."""
    t = t.to(torch.int64)
    scale = bits_to_float32(t)
    o = (t >> _OFFSET_SHIFT) & _OFFSET_MASK
    o = torch.where(o >= 256, o - 512, o)
    return scale, o.to(torch.int32)


def encode_deq_scale(deq: torch.Tensor, encoding: str, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encode float ``deq`` in one of :data:`DEQ_ENCODINGS`."""
    if encoding == DEQ_MSMODELSLIM_INT64:
        return encode_deq_scale_msmodelslim(deq)
    if encoding == DEQ_TRANS_QUANT_PARAM:
        return encode_deq_scale_trans_quant_param(deq, offset)
    if encoding == DEQ_FLOAT32:
        return deq.to(torch.float32)
    raise ValueError(f"unknown deq_scale encoding {encoding!r}; expected one of {', '.join(DEQ_ENCODINGS)}")


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        return t
    if t.dtype == getattr(torch, "uint64", None):
        return t.view(torch.int64)
    raise TypeError(t.dtype)


def detect_deq_scale_encoding(t: torch.Tensor, name: str = "") -> str:
    """Which of :data:`DEQ_ENCODINGS` the tensor ``t`` holds.

    * float32 / float16 / bfloat16 -> ``"float32"`` (decoded by a cast);
    * int64 (or uint64): each element is classified as

      - msModelSlim / raw bit-cast: ``-2^31 <= v < 2^32`` (32-bit pattern, sign- or zero-extended);
      - TransQuantParam: bits 47..63 zero, bit 46 set, bits 32..36 zero, bits 0..12 zero.

      The classes are disjoint (bit 46). Every element must fall in one class, all in the same one.

    Raises :class:`QuantFormatError` naming ``name`` for: other dtypes, an empty tensor or one of only zero
    words (no value and no flag: ambiguous), elements of neither layout, and a tensor mixing the two layouts.
    """
    label = tensor_label(name)
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        if t.numel() == 0:
            raise QuantFormatError(f"{label}: empty deq_scale; cannot tell its encoding")
        return DEQ_FLOAT32
    try:
        v = _as_int64(t).reshape(-1)
    except TypeError:
        raise QuantFormatError(
            f"{label}: deq_scale dtype {t.dtype} is none of int64 (msModelSlim / npu_trans_quant_param) "
            f"and float32 (bf16 models)"
        ) from None
    if v.numel() == 0:
        raise QuantFormatError(f"{label}: empty deq_scale; cannot tell its encoding")
    if bool((v == 0).all()):
        raise QuantFormatError(
            f"{label}: every deq_scale word is 0, which carries neither a value nor the TransQuantParam flag "
            f"(ambiguous encoding; a zero dequant scale would also zero the output)"
        )
    is_msm = (v >= -(2**31)) & (v < 2**32)
    is_tqp = ((v >> 46) == 1) & (((v >> 32) & 0x1F) == 0) & ((v & 0x1FFF) == 0)
    neither = ~(is_msm | is_tqp)
    if bool(neither.any()):
        i = int(neither.nonzero()[0, 0])
        raise QuantFormatError(
            f"{label}: deq_scale element {i} = {int(v[i]):#x} is neither an msModelSlim int64 (float32 bits in "
            f"the low word, sign-extended) nor an npu_trans_quant_param word "
            f"((bits & 0xFFFFE000) | 1<<46 [| offset<<37])"
        )
    n_msm, n_tqp = int(is_msm.sum()), int(is_tqp.sum())
    if n_msm and n_tqp:
        i = int(is_tqp.nonzero()[0, 0])
        j = int(is_msm.nonzero()[0, 0])
        raise QuantFormatError(
            f"{label}: deq_scale mixes encodings: {n_msm} msModelSlim int64 word(s) (e.g. element {j} = "
            f"{int(v[j]):#x}) and {n_tqp} npu_trans_quant_param word(s) (e.g. element {i} = {int(v[i]):#x}); "
            f"never mix them -- re-encode the whole tensor one way"
        )
    return DEQ_TRANS_QUANT_PARAM if n_tqp else DEQ_MSMODELSLIM_INT64


def decode_deq_scale(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """float32 value of a deq_scale in any of the three encodings (detected with :func:`detect_deq_scale_encoding`)."""
    enc = detect_deq_scale_encoding(t, name)
    if enc == DEQ_FLOAT32:
        return t.to(torch.float32)
    if enc == DEQ_TRANS_QUANT_PARAM:
        return decode_deq_scale_trans_quant_param(_as_int64(t))[0]
    return decode_deq_scale_msmodelslim(_as_int64(t))


# ---------------------------------------------------------------------------------------------------------------
# grouped-matmul scale bit-cast (W4A8 / MC2): raw float32 bits, zero-extended, no flag


def scale_to_int64_bits(scale: torch.Tensor) -> torch.Tensor:
    """float scale -> int64 holding its float32 bits zero-extended (vllm-ascend ``np.uint32`` view; no bit 46)."""
    return float32_bits(scale)


def int64_bits_to_scale(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`scale_to_int64_bits`."""
    return bits_to_float32(t)


# ---------------------------------------------------------------------------------------------------------------
# weights and offsets


def weight_to_npu_layout(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` (checkpoint) -> contiguous ``[..., K, N]`` (``x2`` of the NPU matmuls)."""
    return weight.transpose(-1, -2).contiguous()


def npu_antiquant_offset(zero_point: torch.Tensor) -> torch.Tensor:
    """The NPU antiquant offset for a checkpoint zero point: ``-zp``.

    checkpoint: ``W = (w - zp) * scale``; NPU: ``W = (w + antiquant_offset) * scale``.
    """
    return -zero_point


def npu_antiquant_params(
    weight_scale: torch.Tensor, weight_offset: Optional[torch.Tensor], name: str = ""
) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
    """W8A16 / W4A16 scale and offset in ``npu_weight_quant_batchmatmul`` layout.

    ``weight_scale`` / ``weight_offset`` ``[N, 1]`` or ``[N]`` (per channel) -> ``[N]``; ``[N, G]`` (per group)
    -> ``[G, N]``. The offset is negated (:func:`npu_antiquant_offset`). Returns
    ``(antiquant_scale, antiquant_offset, G)``; ``G == 1`` means per channel (``antiquant_group_size=0``).
    """
    s = weight_scale.reshape(weight_scale.shape[0], -1)
    g = s.shape[1]
    scale = s[:, 0].contiguous() if g == 1 else s.transpose(0, 1).contiguous()
    if weight_offset is None:
        return scale, None, g
    o = weight_offset.reshape(weight_offset.shape[0], -1)
    if o.shape != s.shape:
        raise QuantFormatError(
            f"{tensor_label(name)}: weight_offset shape {list(weight_offset.shape)} does not match weight_scale "
            f"{list(weight_scale.shape)}"
        )
    off = npu_antiquant_offset(o[:, 0] if g == 1 else o.transpose(0, 1)).contiguous()
    return scale, off, g


def npu_kv_cache_params(scale: torch.Tensor, offset: Optional[torch.Tensor] = None,
                        name: str = "") -> dict[str, Optional[torch.Tensor]]:
    """C8 KV-cache parameters (``kv_cache_scale`` s, ``kv_cache_offset`` o, ``[num_kv_heads * head_dim]``) in the
    forms the NPU ops take, all float32 ``[C]``:

    * ``quant_scale = 1 / s``, ``quant_offset = o``: the cache write ``npu_quantize(k, 1/s, o, qint8,
      div_mode=False)`` = ``round(k * (1/s) + o)`` (vllm-ascend ``_quantize_kv_to_int8``);
    * ``antiquant_scale = s``, ``antiquant_offset = -o``: the attention read, ``(k_int8 + antiquant_offset) *
      antiquant_scale`` = ``(k_int8 - o) * s`` (the antiquant ops add their offset: same negation as weights,
      :func:`npu_antiquant_offset`). ``quant_offset`` / ``antiquant_offset`` are None when o is None.
    """
    s = scale.detach().float().reshape(-1)
    if not bool((s > 0).all()):
        raise QuantFormatError(f"{tensor_label(name + '.kv_cache_scale' if name else '')}: scales must be > 0")
    o = None
    if offset is not None:
        o = offset.detach().float().reshape(-1)
        if o.shape != s.shape:
            raise QuantFormatError(f"{tensor_label(name + '.kv_cache_offset' if name else '')}: shape "
                                   f"{list(o.shape)} != kv_cache_scale {list(s.shape)}")
    return {"quant_scale": 1.0 / s, "quant_offset": o, "antiquant_scale": s,
            "antiquant_offset": None if o is None else npu_antiquant_offset(o)}


def w4a8_weight_to_npu(packed: torch.Tensor, name: str = "") -> torch.Tensor:
    """msModelSlim packed W4A8 ``[..., N/2, K]`` int8 -> NPU int4-in-int32 ``[..., K, N/8]`` (LSB first)."""
    q = unpack_int4_rows(packed, name)  # [..., N, K]
    return pack_int4_to_int32(q.transpose(-1, -2), name)


def npu_int4_weight_values(w: torch.Tensor) -> torch.Tensor:
    """NPU int4-in-int32 ``[..., K, N/8]`` -> int4 values ``[..., K, N]`` (int8)."""
    return unpack_int32_to_int4(w)


def scale_bias_to_npu(scale_bias: torch.Tensor) -> torch.Tensor:
    """W4A8 ``scale_bias`` ``[..., N, c]`` (c = 1, or 16 for o/down) -> ``[..., N]`` summed over c (c.4 step 3)."""
    return scale_bias.reshape(*scale_bias.shape[:-1], -1).sum(-1) if scale_bias.dim() > 1 else scale_bias


def compute_scale_bias(q4: torch.Tensor, weight_scale: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """``scale_bias = 8 * sum_k q4[n, k] * weight_scale[n]`` over ``chunks`` equal k-chunks -> float32 ``[N, chunks]``.

    ``chunks=1`` for q/k/v/gate/up, 16 for o/down (msModelSlim ``process_scale(..., tp_num=16)``).
    """
    n, k = q4.shape[-2], q4.shape[-1]
    if k % chunks:
        raise ValueError(f"k={k} is not divisible into {chunks} chunks")
    d = q4.to(torch.float32) * weight_scale.reshape(*q4.shape[:-1], 1).to(torch.float32)
    return 8 * d.reshape(*q4.shape[:-1], chunks, k // chunks).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# tensor parallelism and the 65535 limit


def quant_bias_for_rank(quant_bias: torch.Tensor, tp_rank: int, row_parallel: bool) -> Optional[torch.Tensor]:
    """The ``bias=`` of ``npu_quant_matmul`` on ``tp_rank``.

    Row-parallel (K split, partial outputs all-reduced): ``quant_bias`` on rank 0, ``None`` elsewhere -- it holds
    the full-K zero-point correction and the float bias, which must enter the sum once. Column-parallel (N split):
    every rank adds its own shard (pass the rank's ``quant_bias`` slice).
    """
    if tp_rank < 0:
        raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
    if row_parallel and tp_rank != 0:
        return None
    return quant_bias


def split_output_dim(
    weight: torch.Tensor, *per_channel: Optional[torch.Tensor], max_n: int = MAX_MATMUL_DIM
) -> list[tuple[Optional[torch.Tensor], ...]]:
    """Split an NPU quant matmul along N so that every chunk has ``N_i <= max_n``.

    ``weight`` is in NPU layout ``[..., K, N]``; each ``per_channel`` tensor (deq_scale, quant_bias,
    weight_scale, antiquant scale ``[G, N]``, ...) has N as its **last** dim, or is None. N is cut into
    ``c = ceil(N / max_n)`` contiguous chunks of ``ceil(N / c)`` columns (the last may be shorter). Returns one
    tuple ``(weight_i, *per_channel_i)`` per chunk; concatenating the chunk outputs along the last dim gives the
    unsplit output because every output column depends only on its own weight column and scales.
    """
    n = weight.shape[-1]
    for i, t in enumerate(per_channel):
        if t is not None and (t.dim() == 0 or t.shape[-1] != n):
            raise ValueError(
                f"split_output_dim: per-channel tensor #{i} has shape {list(t.shape)}; its last dim must be N={n}"
            )
    chunks = max(1, math.ceil(n / max_n))
    size = math.ceil(n / chunks)
    out = []
    for start in range(0, n, size):
        stop = min(n, start + size)
        out.append(
            (weight[..., start:stop].contiguous(),)
            + tuple(None if t is None else t[..., start:stop].contiguous() for t in per_channel)
        )
    return out


# ---------------------------------------------------------------------------------------------------------------
# one linear, all at once


def prepare_npu_linear(
    linear, tp_rank: int = 0, row_parallel: bool = False, deq_encoding: Optional[str] = None
) -> dict:
    """The arguments an NPU op needs for one :class:`~quant.msmodelslim.schemes.QuantLinear`.

    Returns a dict whose ``"op"`` names the torch_npu op and whose other keys are its tensor arguments:

    * W8A8 / W8A8S / W8A8_MIX (static part) -> ``npu_quantize`` + ``npu_quant_matmul`` (deployment notes c.2):
      ``weight`` int8 [K,N]; ``deq_scale`` as stored (msModelSlim int64 passed unchanged, as vllm-ascend and
      MindIE do; float32 for bf16 models) or re-encoded when ``deq_encoding`` is given; ``bias`` =
      :func:`quant_bias_for_rank`; ``input_scale``, ``input_scale_reciprocal`` (``npu_quantize`` multiplies by
      it), ``input_offset`` int8. W8A8_MIX also gets ``weight_scale`` f32 [N] for its per-token prefill path.
    * W8A8_DYNAMIC per channel -> ``npu_dynamic_quant`` + ``npu_quant_matmul`` (c.3): ``weight`` [K,N],
      ``scale`` f32 [N], ``bias`` (float, may be None). A non-zero weight offset is refused (the op has none).
    * W8A16 / W4A16 -> ``npu_weight_quant_batchmatmul``: ``weight`` [K,N] (int8, or int4-in-int32 [K,N/8]),
      ``antiquant_scale`` / ``antiquant_offset`` (negated zero point) [N] or [G,N], ``antiquant_group_size``.
    * W4A8_DYNAMIC per channel -> ``npu_grouped_matmul`` (c.4): ``weight`` int32 [K,N/8] (8 int4, LSB first),
      ``scale`` int64 [N] (raw float32 bits, no flag), ``scale_bias`` f32 [N] (summed over its 1 or 16 columns;
      computed as ``8 * sum_k q4 * s`` when the checkpoint has none), ``bias``.
    * W4A8_DYNAMIC per group (``weight_scale_second``) is **refused**: vllm-ascend rejects that older format.
    * FLOAT -> ``matmul`` with ``weight`` [K,N].
    """
    from quant.msmodelslim.packing import pack_int4_to_int32 as _pack

    lay = linear.layout
    label = linear.name or "<linear>"
    if lay.variant in ("static", "mix"):
        deq = linear.deq_scale_raw
        if deq_encoding is not None and deq_encoding != linear.deq_encoding:
            deq = encode_deq_scale(linear.deq, deq_encoding)
        out = {
            "op": "npu_quant_matmul",
            "weight": weight_to_npu_layout(linear.w_q),
            "deq_scale": deq,
            "bias": quant_bias_for_rank(linear.quant_bias, tp_rank, row_parallel),
            "input_scale": linear.input_scale.reshape(1),
            "input_scale_reciprocal": (1.0 / linear.input_scale).reshape(1),
            "input_offset": linear.input_offset.to(torch.int8).reshape(1),
        }
        if lay.variant == "mix":
            out["weight_scale"] = linear.weight_scale[:, 0].contiguous()
        return out
    if lay.variant == "dynamic":
        if linear.weight_scale.shape[1] != 1:
            raise QuantFormatError(
                f"{label}: per-group W8A8_DYNAMIC (group_size={lay.group_size}) has no npu_quant_matmul form here"
            )
        if bool((linear.weight_offset != 0).any()):
            raise QuantFormatError(f"{label}.weight_offset: non-zero offsets cannot be passed to npu_quant_matmul")
        return {
            "op": "npu_quant_matmul",
            "weight": weight_to_npu_layout(linear.w_q),
            "scale": linear.weight_scale[:, 0].contiguous(),
            "bias": linear.bias if (not row_parallel or tp_rank == 0) else None,
        }
    if lay.variant == "weight_only":
        scale, offset, g = npu_antiquant_params(linear.weight_scale, linear.weight_offset, label)
        w = weight_to_npu_layout(linear.w_q)
        if linear.qtype == "W4A16":
            w = _pack(w, f"{label}.weight")
        return {
            "op": "npu_weight_quant_batchmatmul",
            "weight": w,
            "antiquant_scale": scale,
            "antiquant_offset": offset,
            "antiquant_group_size": 0 if g == 1 else lay.k // g,
            "bias": linear.bias if (not row_parallel or tp_rank == 0) else None,
        }
    if lay.variant == "w4a8_per_channel":
        s = linear.weight_scale[:, 0]
        sb = linear.scale_bias
        sb = compute_scale_bias(linear.w_q, s)[:, 0] if sb is None else scale_bias_to_npu(sb)
        return {
            "op": "npu_grouped_matmul",
            "weight": _pack(weight_to_npu_layout(linear.w_q), f"{label}.weight"),
            "scale": scale_to_int64_bits(s),
            "scale_bias": sb,
            "bias": linear.bias if (not row_parallel or tp_rank == 0) else None,
        }
    if lay.variant == "w4a8_per_group":
        raise QuantFormatError(
            f"{label}: the older per-group W4A8 format ({label}.weight_scale_second / {label}.weight_offset_second) "
            f"is refused for the NPU path (vllm-ascend rejects it); re-quantise with msModelSlim's per-channel W4A8 "
            f"(v1 linear_quant, int4 per_channel), which writes weight_scale + scale_bias. The CPU int/float paths "
            f"still compute it."
        )
    if lay.variant == "float":
        return {"op": "matmul", "weight": weight_to_npu_layout(linear.dequant_weight()), "bias": linear.bias}
    raise QuantFormatError(f"{label}: no NPU parameter form for variant {lay.variant!r}")  # pragma: no cover


__all__ = [
    "DEQ_ENCODINGS",
    "DEQ_FLOAT32",
    "DEQ_MSMODELSLIM_INT64",
    "DEQ_TRANS_QUANT_PARAM",
    "MAX_MATMUL_DIM",
    "bits_to_float32",
    "compute_scale_bias",
    "decode_deq_scale",
    "decode_deq_scale_msmodelslim",
    "decode_deq_scale_trans_quant_param",
    "detect_deq_scale_encoding",
    "encode_deq_scale",
    "encode_deq_scale_msmodelslim",
    "encode_deq_scale_trans_quant_param",
    "float32_bits",
    "fp19_truncate",
    "int64_bits_to_scale",
    "npu_antiquant_offset",
    "npu_antiquant_params",
    "npu_int4_weight_values",
    "prepare_npu_linear",
    "quant_bias_for_rank",
    "scale_bias_to_npu",
    "scale_to_int64_bits",
    "split_output_dim",
    "w4a8_weight_to_npu",
    "weight_to_npu_layout",
]
