"""msModelSlim checkpoints under tensor / expert parallelism: each rank's share of every described linear.

A column-parallel linear (split output channels n) takes its rows of the weight and of every per-channel tensor
(``weight_scale``, ``weight_offset``, ``deq_scale``, ``quant_bias``, ``bias``, second-stage W4A8 scales; packed
int4 rows by pairs); per-tensor input scales are shared. A row-parallel linear (split input channels k) takes its
columns of the weight and of per-group scales, keeps per-channel scales whole, and adds ``quant_bias`` / ``bias``
on rank 0 only (they are added to the partial sum before the all-reduce, so once in total). Dynamic (per-token)
activation quantisation of a row-parallel input uses the token's max over ALL ranks (an all-reduce of the local
maxima), so that every rank quantises with the single-device scale and the integer sums add up to the
single-device result. Routed experts: EP ranks build only their own experts (rows dispatched to them by
all-to-all, or an all-reduce of partial sums: :class:`ParallelQuantExperts`); TP ranks split each expert's w1 / w3
by columns and w2 by rows. Only the integer path (``msmodelslim_path="int"``, what the NPU runs) is split.

These tensors are read whole and sliced on the rank (the msModelSlim reader has no partial reads): a rank holds
only its share, but reads every described linear of the layers it needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel.comm import all_reduce
from parallel.groups import Group

from ..errors import CheckpointError
from ..layers.experts import ep_dispatch_combine, ep_local_rows, ep_mode, ep_static_gather, ep_static_rows
from ..layers.quantized import QuantLinearAdapter

_PER_CHANNEL = ("weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second", "deq_scale",
                "quant_bias", "bias", "scale_bias")


def _part(t: torch.Tensor, dim: int, g: Group, what: str) -> torch.Tensor:
    n = t.shape[dim]
    if n % g.size:
        raise CheckpointError(f"{what}: dimension {dim} of size {n} does not split over {g.size} ranks")
    per = n // g.size
    return t.narrow(dim, g.rank * per, per).contiguous()


def sliced_tensors(tensors: dict[str, torch.Tensor], kind: str, g: Group, name: str) -> dict[str, torch.Tensor]:
    """This rank's tensors of one described linear (``kind``: 'column' | 'row')."""
    w = tensors["weight"]
    n = tensors["weight_scale"].shape[0] if "weight_scale" in tensors else (
        tensors["deq_scale"].reshape(-1).shape[0] if "deq_scale" in tensors else w.shape[0])
    out = {}
    for s, t in tensors.items():
        what = f"{name}.{s}"
        if kind == "column":
            if s == "weight" or (s in _PER_CHANNEL and t.dim() >= 1 and t.shape[0] in (n, w.shape[0])):
                out[s] = _part(t, 0, g, what)
            else:
                out[s] = t
        else:
            if s == "weight":
                out[s] = _part(t, 1, g, what)
            elif s in ("quant_bias", "bias"):
                out[s] = t if g.rank == 0 else torch.zeros_like(t)
            elif s in ("weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second") \
                    and t.dim() == 2 and t.shape[1] > 1:
                out[s] = _part(t, 1, g, what)  # per-group scales follow the columns
            else:
                out[s] = t
    return out


def _global_dynamic_quant(ql: nn.Module, g: Group):
    """quantize_input of a row-parallel dynamic QuantLinear: per-token scale from the max over all ranks."""
    from quant.msmodelslim.schemes.numerics import round_clamp as _round_clamp

    def quantize_input(x2: torch.Tensor):
        if ql.mode == "static":
            return type(ql).quantize_input(ql, x2)
        amax = x2.abs().amax(dim=-1)
        if g.size > 1:
            amax = amax.contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g.pg)
        s = amax / 127.0
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = _round_clamp(x2 / safe.unsqueeze(-1)).to(torch.int64)  # as dynamic_quant_per_token, global max
        return q, s

    ql.quantize_input = quantize_input
    return ql


class ParallelQuantLinearAdapter(QuantLinearAdapter):
    """A rank's share of a described linear in place of a column- / row-parallel linear (row: reduced over ``tp``
    unless the replaced linear had ``reduce=False``)."""

    def __init__(self, ql: nn.Module, out_dtype: torch.dtype, kind: str, tp: Group, reduce: bool = True):
        super().__init__(ql, out_dtype)
        self.kind, self.tp, self.reduce = kind, tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.kind == "row" and self.reduce:
            y = all_reduce(y, self.tp)
        return y


def linear_kind(mod: nn.Module) -> str | None:
    """'column' | 'row' for a split parallel linear, None for a whole one."""
    tp = getattr(mod, "tp", None)
    if tp is None or tp.size == 1:
        return None
    return {0: "column", 1: "row"}.get(getattr(mod, "shard_dim", None))


def quant_linear(ck, key: str, kind: str | None, tp: Group, path: str, kw: dict, dtype, reduce: bool = True,
                 npu: bool = False):
    """The adapter of described linear ``key`` for this rank (whole when ``kind`` is None).

    ``npu`` (the NPU backend, integer path): the rank's share gets its NPU parameter form (``msm_npu.to_npu_linear``:
    ``atb_ops.quant_linear`` on ``npu_quant_matmul`` / ``npu_weight_quant_batchmatmul``) where that computes the
    single-device integers: whole and column-split linears, and row-split static W8A8 ones (one per-tensor input
    scale on every rank). A row split with dynamic (per-token) activation quantisation keeps the CPU layout: its
    per-token scale must come from the max over all ranks (:func:`_global_dynamic_quant`), which
    ``npu_dynamic_quant`` (the rank's own max) does not give; so do weight-only row splits (their NPU form would
    be ``npu_weight_quant_batchmatmul`` over per-group scales cut at the split, not tested here: no weight-only
    DeepSeek checkpoint among the fixtures)."""
    from quant.msmodelslim.schemes import QuantLinear

    from .msm_npu import to_npu_linear

    def npu_form(ql):
        return (to_npu_linear(ql, dtype) or ql) if npu and path == "int" else ql

    if kind is None:
        return QuantLinearAdapter(npu_form(ck.linear(key, path=path, **kw)), dtype)
    if path != "int":
        raise CheckpointError(f"{key}: msModelSlim linears are split over tensor-parallel ranks on the integer path "
                              f"only (msmodelslim_path='int')")
    entry = ck.layout.linears[key]
    tensors = {suffix: ck.weights.get(k) for suffix, k in entry.tensors.items()}
    ql = QuantLinear(entry.qtype, sliced_tensors(tensors, kind, tp, key), name=key, path=path, **kw)
    if kind == "row":
        if ql.mode == "static":
            ql = npu_form(ql)
        else:
            _global_dynamic_quant(ql, tp)  # a no-op for weight-only schemes (no activation quantisation)
    else:
        ql = npu_form(ql)
    return ParallelQuantLinearAdapter(ql, dtype, kind, tp, reduce)


class ParallelQuantExperts(nn.Module):
    """Routed msModelSlim experts of one rank: EP (experts ``first_expert .. first_expert + n_local - 1`` only) or
    TP (every expert split), around ``local``: this rank's experts as a world-size-1 module with ``_rows``
    (``layers.quantized.QuantExperts``, or on the NPU backend ``msm_npu.NpuQuantExperts``: one grouped matmul per
    projection).

    EP follows the dense experts' ``ep_comm`` (``layers.experts.Experts``): ``'alltoall'`` sends each (token,
    expert) row to the expert's rank and back (``layers.experts.ep_dispatch_combine``; complete rows; the only
    mode under data-parallel attention, whose replicas hold different tokens: ``split`` is then the replica's TP
    group), ``'allreduce'`` computes this rank's experts for all tokens and returns a partial sum that the MoE
    reduces; inside a captured step (``layers.experts.static_shape_moe``) the all-reduce form with static shapes
    (``ep_static_rows``), under data-parallel attention the all-gather / reduce-scatter one (``ep_static_gather``). TP: partial sums, reduced by the MoE. ``dim``: the model width, for
    :meth:`zero_token_step`."""

    def __init__(self, local: nn.Module, n_local: int, first_expert: int, ep: Group, tp: Group,
                 ep_comm: str = "allreduce", split: Group | None = None, dim: int | None = None):
        super().__init__()
        self.local, self.n_local = local, n_local
        self.first_expert, self.ep, self.tp = first_expert, ep, tp
        self.split = split or ep
        self.ep_comm = ep_comm if ep.size > 1 else "allreduce"
        if self.split is not ep and self.ep_comm != "alltoall":
            raise ValueError("data-parallel attention needs ASCEND_DSV4_EP_COMM=alltoall (the replicas hold different "
                             "tokens, an all-reduce of expert outputs would mix them)")
        self.dim = dim

    def zero_token_step(self, dtype: torch.dtype) -> None:
        """One forward on zero tokens: this layer's EP collectives, for a data-parallel replica with no work."""
        if self.dim is None:
            raise ValueError("ParallelQuantExperts.zero_token_step: built without the model width (dim)")
        dev = next((t.device for t in self.buffers()), torch.device("cpu"))
        self(torch.empty(0, self.dim, dtype=dtype, device=dev), torch.empty(0, 1, device=dev),
             torch.empty(0, 1, dtype=torch.long, device=dev))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mode = ep_mode(self)
        if mode == "none":
            return self.local(x, weights, ids)
        if mode == "alltoall":
            return ep_dispatch_combine(x, weights, ids, self.ep, self.split, self.n_local, self.first_expert,
                                       self.local._rows)
        if mode == "static_dp":  # a captured step under data-parallel attention: complete rows, static shapes
            return ep_static_gather(x, weights, ids, self.ep, self.split, self.n_local, self.first_expert,
                                    self.local._rows)
        local_rows = ep_static_rows if mode == "static" else ep_local_rows
        return local_rows(x, weights, ids, self.n_local, self.first_expert, self.local._rows)  # partial sums
