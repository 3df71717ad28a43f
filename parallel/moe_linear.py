"""MoE linears over a tensor-parallel group: the per-expert RowParallelLinear / ColumnParallelLinear.

:class:`MoeRowParallelLinear` implements the op "MoeRowParallelLinear" (a RowParallelLinear applied per expert)
in its consistent reading. The op text has two slips, and this module follows its shapes instead:

1. its prose says tensor parallelism splits ``W (N, K)`` "along the N dimension", but its weight shape per
   device ``(num_experts, N, K_d)``, its input split ``(*, K) -> (*, [K^0 ... K^t])`` and the all-reduce of
   ``(*, N)`` partial results all describe a split of **K** (row parallelism): each rank multiplies its K slice
   and the all-reduce sums the partial products; the bias ``(num_experts, N)`` is not split;
2. its pseudo-code ``for i in range(1, num_expert + 1): X_flat[expert_offset[i]:expert_offset[i + 1]]`` is off
   by one (it would skip expert 0 and index past ``expert_offset``); experts are ``0 .. E-1`` and expert i owns
   rows ``expert_offset[i] : expert_offset[i + 1]`` with ``expert_offset[0] = 0`` and
   ``expert_offset[E] = rows``.

Math (rank r of a group of size P, K_r = K / P):
``Y[m] = sum_r X[m, r*K_r:(r+1)*K_r] @ W_r[e(m)]^T + B[e(m)]`` where ``e(m)`` is the expert whose offset range
holds row m. Types: float32 / float16 / bfloat16 (fp32 accumulation through ``atb_ops.grouped_matmul``, output in
the input dtype), and int8 x int8 accumulated exactly into int32 (output int32, bias int32): products of int8
are at most 2^14 in magnitude, so float64 accumulation is exact for any K < 2^39 and is cast back to int32
(an integer result outside int32 is an error, not a wrap-around).
"""

from __future__ import annotations

import torch
from torch import nn

import atb_ops

from .comm import all_reduce
from .groups import Group, ParallelError, resolve_group
from .layers import split_size

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_offsets(expert_offset: torch.Tensor, num_experts: int, rows: int, name: str) -> torch.Tensor:
    if expert_offset.dtype != torch.int64 or tuple(expert_offset.shape) != (num_experts + 1,):
        raise ParallelError(f"{name}: expert_offset must be int64 [{num_experts + 1}], got "
                            f"{expert_offset.dtype} {list(expert_offset.shape)}")
    off = expert_offset.to("cpu")
    if int(off[0]) != 0 or int(off[-1]) != rows or bool((off[1:] < off[:-1]).any()):
        raise ParallelError(f"{name}: expert_offset must rise from 0 to the number of rows {rows}, got "
                            f"{off.tolist()}")
    return off


def expert_ids_from_offsets(off: torch.Tensor, device) -> torch.Tensor:
    """int64 [rows]: the expert of each row, from an offset vector [E + 1] (on the CPU)."""
    counts = off[1:] - off[:-1]
    return torch.repeat_interleave(torch.arange(len(counts)), counts).to(device)


def _int8_grouped_matmul(x: torch.Tensor, w: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """x int8 [M, K], w int8 [E, N, K] -> exact int32 [M, N] (float64 accumulation, see module doc)."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w.shape[0]):
        a, b = int(off[e]), int(off[e + 1])
        if b > a:
            out[a:b] = x[a:b].to(torch.float64) @ w[e].to(torch.float64).t()
    return out


def _to_int32(y: torch.Tensor, name: str) -> torch.Tensor:
    if y.numel() and (float(y.max()) > 2**31 - 1 or float(y.min()) < -(2**31)):
        raise ParallelError(f"{name}: int8 x int8 sum overflows int32")
    return y.to(torch.int32)


class _MoeLinearBase(nn.Module):
    def __init__(self, num_experts: int, in_local: int, out_local: int, bias_dim: int, bias_term: bool,
                 params_dtype: torch.dtype, tp: Group):
        super().__init__()
        if params_dtype not in FLOAT_DTYPES + (torch.int8,):
            raise ParallelError(f"params_dtype {params_dtype} not supported; expected float32, float16, bfloat16 "
                                f"or int8")
        self.num_experts, self.tp, self.params_dtype = num_experts, tp, params_dtype
        self.weight = nn.Parameter(torch.zeros(num_experts, out_local, in_local, dtype=params_dtype),
                                   requires_grad=False)
        bias_dtype = torch.int32 if params_dtype == torch.int8 else params_dtype
        self.bias = (nn.Parameter(torch.zeros(num_experts, bias_dim, dtype=bias_dtype), requires_grad=False)
                     if bias_term else None)

    def _matmul(self, flat: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if self.params_dtype == torch.int8:
            if flat.dtype != torch.int8:
                raise ParallelError(f"{name}: int8 weights need int8 input, got {flat.dtype}")
            return _int8_grouped_matmul(flat, self.weight, off)
        if flat.dtype not in FLOAT_DTYPES:
            raise ParallelError(f"{name}: input dtype {flat.dtype} not supported with {self.params_dtype} weights")
        ids = expert_ids_from_offsets(off, flat.device)
        return atb_ops.grouped_matmul(flat, self.weight.to(flat.dtype), ids)

    def _add_bias(self, y: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return y
        ids = expert_ids_from_offsets(off, y.device)
        return y + self.bias[ids].to(y.dtype)


class MoeRowParallelLinear(_MoeLinearBase):
    """Per-expert row-parallel linear (see the module docstring for the exact reading of the op).

    weight: [num_experts, out_features, in_features // tp] (this rank's K slice); bias: [num_experts,
    out_features] (int32 for int8 weights), added once after the all-reduce.
    forward(x [*, K] (or [*, K // tp] if ``input_is_parallel``), expert_offset int64 [E + 1]) -> [*, N]
    (input dtype for float, int32 for int8).
    """

    shard_dim = 2  # of the stacked weight [E, N, K]

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias_term: bool = True,
                 input_is_parallel: bool = False, params_dtype: torch.dtype = torch.bfloat16, group=None):
        tp = resolve_group(group)
        super().__init__(num_experts, split_size(in_features, tp, "in_features"), out_features, out_features,
                         bias_term, params_dtype, tp)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor, expert_offset: torch.Tensor) -> torch.Tensor:
        k_local = self.weight.shape[2]
        want = k_local if self.input_is_parallel else self.in_features
        if x.shape[-1] != want:
            raise ParallelError(f"MoeRowParallelLinear: input last dim {x.shape[-1]}, expected {want} "
                                f"(input_is_parallel={self.input_is_parallel}, tp={self.tp.size})")
        if not self.input_is_parallel and self.tp.size > 1:
            x = x[..., self.tp.rank * k_local:(self.tp.rank + 1) * k_local]
        lead = x.shape[:-1]
        flat = x.reshape(-1, k_local)
        off = _check_offsets(expert_offset, self.num_experts, flat.shape[0], "MoeRowParallelLinear")
        y = self._matmul(flat, off)
        if self.params_dtype == torch.int8:
            y = _to_int32(all_reduce(y, self.tp), "MoeRowParallelLinear")  # exact partial sums in float64
        else:
            y = all_reduce(y, self.tp)
        return self._add_bias(y, off).reshape(*lead, self.out_features)


class MoeColumnParallelLinear(_MoeLinearBase):
    """Per-expert column-parallel linear (gate / up projections): W [E, N, K] split on N, no communication.

    weight: [num_experts, out_features // tp, in_features]; bias: [num_experts, out_features // tp].
    forward(x [*, K], expert_offset int64 [E + 1]) -> [*, N // tp] (input dtype; int32 for int8).
    """

    shard_dim = 1  # of the stacked weight [E, N, K]

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias_term: bool = False,
                 params_dtype: torch.dtype = torch.bfloat16, group=None):
        tp = resolve_group(group)
        n_local = split_size(out_features, tp, "out_features")
        super().__init__(num_experts, in_features, n_local, n_local, bias_term, params_dtype, tp)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor, expert_offset: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ParallelError(f"MoeColumnParallelLinear: input last dim {x.shape[-1]}, expected {self.in_features}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        off = _check_offsets(expert_offset, self.num_experts, flat.shape[0], "MoeColumnParallelLinear")
        y = self._matmul(flat, off)
        if self.params_dtype == torch.int8:
            y = _to_int32(y, "MoeColumnParallelLinear")
        return self._add_bias(y, off).reshape(*lead, self.weight.shape[1])
