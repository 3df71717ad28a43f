"""Linear layers used by the models.

``Linear`` holds a weight ``[out, in]`` and computes ``y = x @ W^T`` through :func:`atb_ops.linear`. The weight
is dense (model dtype, or float32 for ``compute_fp32`` layers) or kept in its checkpoint format after
:meth:`Linear.set_weight`: ``fp8_block`` (e4m3 + 128x128 block scales) or ``fp4`` (packed e2m1 + E8M0 scale per
32 inputs). With ``fp8_input=True`` the input is first rounded exactly as the official DeepSeek-V4 ``linear()``
quantises activations for its FP8/FP4 GEMMs (FP8-e4m3, power-of-two scale per 128 input channels); the models
set it for the layers whose official weights are FP8/FP4 when running in ``reference`` numerics.
Tensor-parallel variants (column / row / vocab) will subclass this with rank-local shapes; at world size 1 they
are this.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import atb_ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp8_input: bool = False,
                 compute_fp32: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8_input = fp8_input
        self.compute_fp32 = compute_fp32
        self.fmt = "dense"
        # False: a quantised checkpoint weight is dequantised at load (its consumer needs the dense matrix)
        self.keep_checkpoint_format = not compute_fp32
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.register_parameter("scale", None)

    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None, fmt: str = "dense") -> None:
        """Install a weight in one of the :func:`atb_ops.linear` formats (shapes are checked by the loader)."""
        self.fmt = fmt
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = None if scale is None else nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return atb_ops.linear(self.prepare_input(x), self.weight, self.scale, self.fmt, self.out_dtype)

    @property
    def out_dtype(self) -> torch.dtype | None:
        """float32 for ``compute_fp32`` (atb_ops.linear's float32-compute form: the input upcast exactly, or a
        kernel that takes the 16-bit input itself), else None (the input's dtype)."""
        return torch.float32 if self.compute_fp32 else None

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as this layer's GEMM takes it (FP8-rounded for ``fp8_input``; a ``compute_fp32`` layer's input
        as is, upcast by atb_ops.linear's ``out_dtype``)."""
        if self.compute_fp32:
            return x
        if self.fp8_input:
            return atb_ops.fp8_act_round(x, 128)
        return x

    def plain_output(self) -> bool:
        """Whether forward is x @ W^T and nothing else (no bias, gather or reduction): what stacking needs."""
        return True

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, fmt={self.fmt}, fp8_input={self.fp8_input}, "
                f"fp32={self.compute_fp32}")


def bf16_exact(w: torch.Tensor, rows: int = 4096) -> bool:
    """Whether every value of the float32 ``w`` is a BF16 value (its low 16 bits are zero), checked in row chunks
    (no full-size temporary)."""
    flat = w.reshape(-1, w.shape[-1]) if w.dim() > 1 else w.reshape(1, -1)
    return all(not (flat[i:i + rows].view(torch.int32) & 0xFFFF).any() for i in range(0, flat.shape[0], rows))


@torch.no_grad()
def compact_fp32_weights_(model: nn.Module) -> int:
    """Store the float32 weights of ``compute_fp32`` linears (DeepSeek-V4's head and compressor projections: BF16
    in the checkpoint, upcast to float32 parameters by the official code) as BF16 where that is exact; the layers
    still compute in float32: the reference op upcasts the weight (bitwise the same results), the CUDA op splits
    the float32 input into three BF16 parts on the BF16 tensor cores (float32 accuracy, ``atb_ops/cuda/gemm.py``
    ``_bf16x3``). Halves the bytes a decode step reads for them (the Flash head: 2.1 -> 1.1 GB per step).
    For backends whose float32 linear takes a BF16 weight so (CUDA); returns the bytes freed."""
    freed = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (isinstance(mod, Linear) and mod.compute_fp32 and mod.fmt == "dense" and w is not None
                and w.dtype == torch.float32 and bf16_exact(w)):
            mod.set_weight(w.to(torch.bfloat16))
            freed += w.numel() * 2
    return freed


@torch.no_grad()
def compact_fp8_weights_(model: nn.Module) -> int:
    """Store as FP8 (e4m3 with E8M0 128 x 128 block scales, ``fmt="fp8_block"``) the dense 16-bit weights of the
    linears marked ``fp8_compact`` whose values are exactly that: DeepSeek-V4's ``wo_a``, FP8 in the official
    checkpoint and dequantised at load for the dense ``group_linear``, which now takes either storage with the
    same results (its consumer reads ``fmt`` and ``scale``). A weight with a value off that grid (random BF16, a
    float32-scaled block) stays dense. Each block is requantised with the smallest power-of-two scale that holds
    its largest value (``quant.fp8_block.quant_fp8_block``): exact for values that are e4m3 codes times a power of
    two, which the dequantised checkpoint's are; the result is checked against the weight before it replaces it.
    For backends with an FP8 kernel for it (CUDA: half the bytes a decode step reads for ``wo_a``); returns the
    bytes freed."""
    from quant.fp8_block import dequant_fp8_block, quant_fp8_block

    freed = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not (isinstance(mod, Linear) and getattr(mod, "fp8_compact", False) and mod.fmt == "dense"
                and w is not None and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16)
                and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0 and w.numel()):
            continue
        q, s = quant_fp8_block(w, scale_fmt="ue8m0")
        if torch.equal(dequant_fp8_block(q, s, dtype=torch.float32), w.float()):
            mod.set_weight(q, s, "fp8_block")
            freed += w.numel() * (w.element_size() - 1) - s.numel()
    return freed


@dataclass
class _Stack:
    """One weight (and scale) buffer of linears that read the same input; each linear holds a row slice of it."""
    mods: tuple
    weight: torch.Tensor
    scale: torch.Tensor | None
    sizes: tuple[int, ...]
    ptrs: tuple  # (weight, scale) data pointers each linear had when stacked

    def valid(self) -> bool:
        # a later set_weight or a device move gives a linear its own storage again: the stack no longer applies
        return all(_ptrs(m) == p for m, p in zip(self.mods, self.ptrs))


def _ptrs(m: nn.Module) -> tuple:
    return m.weight.data_ptr(), None if m.scale is None else m.scale.data_ptr()


def _stackable(mods: Sequence[nn.Module]) -> bool:
    a = mods[0]
    if len(mods) < 2 or not all(isinstance(m, Linear) and m.plain_output() for m in mods):
        return False
    same = all(m.fmt == a.fmt and m.weight.dtype == a.weight.dtype and m.weight.shape[1:] == a.weight.shape[1:]
               and m.weight.device == a.weight.device and m.compute_fp32 == a.compute_fp32
               and m.fp8_input == a.fp8_input and (m.scale is None) == (a.scale is None) for m in mods)
    if not same or a.fmt not in ("dense", "fp8_block", "fp4"):
        return False
    if a.scale is not None and not all(m.scale.dtype == a.scale.dtype and m.scale.shape[1:] == a.scale.shape[1:]
                                       for m in mods):
        return False
    # fp8_block scales cover 128-row blocks: a slice must start on a block edge
    return a.fmt != "fp8_block" or all(m.weight.shape[0] % 128 == 0 for m in mods[:-1])


@torch.no_grad()
def stack_linears_(mods: Sequence[nn.Module]) -> bool:
    """Give linears that read the same input (e.g. the compressor's ``wkv`` / ``wgate``, the shared expert's ``w1`` /
    ``w3``) one weight buffer [sum N_i, K] (and one scale buffer), each keeping its row slice as its weight, so that
    :func:`stacked_linear` runs them as one GEMM: one launch and one weight stream instead of two, the same
    products and sums per output (a GEMM's output column does not depend on the other columns). Same format,
    dtypes, input size and input handling required; returns whether it stacked. Done once the weights are in place
    on their device (ModelRunner): a later move gives each linear its own storage, and :func:`stacked_linear` then
    runs them one by one."""
    if not _stackable(mods):
        return False
    weight = torch.cat([m.weight for m in mods])
    scale = None if mods[0].scale is None else torch.cat([m.scale for m in mods])
    sizes = tuple(m.weight.shape[0] for m in mods)
    off, soff = 0, 0
    for m, n in zip(mods, sizes):
        sn = 0 if scale is None else m.scale.shape[0]
        m.set_weight(weight[off:off + n], None if scale is None else scale[soff:soff + sn], m.fmt)
        off, soff = off + n, soff + sn
    mods[0]._stack = _Stack(tuple(mods), weight, scale, sizes, tuple(_ptrs(m) for m in mods))
    return True


def stacked_linear(mods: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[mod(x) for mod in mods], as one GEMM over their stacked weight where :func:`stack_linears_` stacked them
    (the outputs are then column slices of one [.., sum N_i] tensor)."""
    st = getattr(mods[0], "_stack", None)
    if st is None or st.mods != tuple(mods) or not st.valid():
        return [m(x) for m in mods]
    a = mods[0]
    y = atb_ops.linear(a.prepare_input(x), st.weight, st.scale, a.fmt, a.out_dtype)
    return list(y.split(st.sizes, dim=-1))


@torch.no_grad()
def stack_model_linears_(model: nn.Module, which: str | None = None) -> int:
    """Stack the linear groups every submodule names in ``stacked_linears()``, and the weights of submodules that
    stack their own (``stack_weights_()``: the routed experts' w1 / w3); returns how many groups stacked.
    ``which`` (default: ``ASCEND_DSV4_STACK_LINEARS``, else "all"): "all", "none", or a comma list of the module
    classes whose groups to stack (e.g. "Compressor,SharedExpert,Experts")."""
    which = which if which is not None else os.environ.get("ASCEND_DSV4_STACK_LINEARS", "all")
    n = 0
    if which == "none":
        return 0
    classes = None if which == "all" else set(filter(None, which.split(",")))
    if classes is not None:
        known = {type(m).__name__ for m in model.modules() if hasattr(m, "stacked_linears")
                 or hasattr(m, "stack_weights_")}
        if classes - known:
            raise ValueError(f"ASCEND_DSV4_STACK_LINEARS={which!r}: no module class {sorted(classes - known)} in this "
                             f"model has stacked linears; expected all, none or a comma list of {sorted(known)}")
    for mod in model.modules():
        if classes is not None and type(mod).__name__ not in classes:
            continue
        groups = getattr(mod, "stacked_linears", None)
        for group in (groups() if callable(groups) else ()):
            n += stack_linears_(group)
        own = getattr(mod, "stack_weights_", None)
        if callable(own):
            n += own()
    return n
