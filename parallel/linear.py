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
        if self.compute_fp32:
            x = x.float()
        elif self.fp8_input:
            x = atb_ops.fp8_act_round(x, 128)
        return atb_ops.linear(x, self.weight, self.scale, self.fmt)

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

