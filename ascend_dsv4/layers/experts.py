"""The routed experts of one MoE layer, stacked (both families; the loaders fill them in checkpoint format).

Under tensor parallelism (a :class:`parallel.groups.ParallelState`) the routed experts are either split inside
every expert (TP: w1 / w3 on N, w2 on K, i.e. the math of ``parallel.MoeColumnParallelLinear`` +
``parallel.MoeRowParallelLinear`` over stacked weights in any checkpoint format, with the reduction deferred to
the MoE) or partitioned whole over the expert-parallel ranks (EP). Every rank holds the same tokens (attention
is TP), so EP either computes its experts' share for all tokens and all-reduces (``allreduce``) or splits the
tokens over the ranks, sends each (token, expert) row to the expert's rank and back (``alltoall``: dispatch /
combine) and all-gathers the combined rows. ``ASCEND_DSV4_EP_COMM`` picks one (default ``alltoall``).

Under data parallelism (``parallel/dp_groups.py``) the EP group spans every rank of every replica while the
replicas hold different tokens: the tokens are then split over the ``split`` group (the replica's TP group, whose
ranks hold the same tokens), dispatched / combined over the whole EP group, and all-gathered over ``split``.
Without DP ``split`` has the EP group's ranks, so the two readings agree. A replica with no work in a step calls
the experts with zero tokens (:func:`dummy_moe_step`) so that every EP collective is met.

Captured decode steps (CUDA graphs; NPU graph mode needs the same) cannot hold either form as is: the all-to-all
takes its counts through the host and the all-reduce form selects this rank's rows by a data-dependent count.
Inside :func:`static_shape_moe` (``engine/cuda_graphs.py`` runs every graph step in it) expert parallelism takes
a static-shape form instead, :func:`ep_static_rows`: every (token, expert) row, those of other ranks' experts
given the id one past this rank's last (a zero row in ``grouped_matmul``), then the all-reduce. Under data
parallelism, where the replicas hold different tokens (every replica's graph step padded to one batch bucket),
:func:`ep_static_gather`: each rank's share of its replica's tokens all-gathered over the EP group, every rank's
experts over all of them in the static form, the partial sums reduce-scattered back and all-gathered over the
replica (vLLM's all-gather / reduce-scatter "naive" all-to-all; the shapes depend on the bucket only).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
from torch import nn

import atb_ops
from parallel.comm import all_gather, all_reduce, all_to_all, exchange_counts, reduce_scatter
from parallel.groups import Group

EP_COMM = ("alltoall", "allreduce")

_STATIC = contextvars.ContextVar("ascend_dsv4_static_shape_moe", default=False)


@contextlib.contextmanager
def static_shape_moe(on: bool = True):
    """Within: expert parallelism takes its static-shape form (:func:`ep_mode` 'static'), which a captured graph
    can hold; ``engine/cuda_graphs.py`` runs every graph step (warm-up, capture, the replay off CUDA) in it."""
    token = _STATIC.set(on)
    try:
        yield
    finally:
        _STATIC.reset(token)


def ep_mode(experts: nn.Module) -> str:
    """How a routed-experts module (:class:`Experts`, msModelSlim's ``ParallelQuantExperts``) runs expert
    parallelism in this call: 'none' (one EP rank), inside :func:`static_shape_moe` 'static' ('static_dp' where the
    replicas of data-parallel attention hold different tokens), else its ``ep_comm`` ('alltoall' | 'allreduce').
    'alltoall' and 'static_dp' return complete rows; 'static' and 'allreduce' partial sums that the MoE all-reduces
    (:func:`reduce_moe`)."""
    ep = getattr(experts, "ep", None)
    if ep is None or ep.size == 1:
        return "none"
    if _STATIC.get():
        return "static" if getattr(experts, "split", ep) is ep else "static_dp"
    return getattr(experts, "ep_comm", "allreduce")


def complete_rows(mode: str) -> bool:
    """Whether routed experts in :func:`ep_mode` ``mode`` return complete sums (no all-reduce of the routed part)."""
    return mode in ("alltoall", "static_dp")


class Experts(nn.Module):
    """Routed experts stacked: ``w1``, ``w3`` [E, inter, dim] and ``w2`` [E, dim, inter] (dense), or kept in
    the checkpoint format (``fmt`` 'fp4': int8 [E, out, in/2] with E8M0 ``w*_scale`` [E, out, in/32];
    'fp8_block': e4m3 [E, out, in] with ``w*_scale`` [E, out/128, in/128]) after :meth:`set_weights`.

    Parallel: ``tp`` (size > 1) splits every expert (``inter`` is this rank's inter / tp; forward returns partial
    sums to reduce over ``tp``); ``ep`` (size > 1) holds experts ``first_expert .. first_expert + E - 1`` of
    ``n_total`` (forward returns partial sums over ``ep`` with ``ep_comm='allreduce'``, complete rows with
    ``'alltoall'``). ``shard`` names the split per weight for the loader: ``{name: dim of the [E, out, in]
    stack}``."""

    def __init__(self, n_experts: int, inter: int, dim: int, limit: float, dtype: torch.dtype, reference: bool,
                 tp: Group | None = None, ep: Group | None = None, n_total: int | None = None,
                 split: Group | None = None):
        super().__init__()
        self.tp, self.ep = tp or Group(), ep or Group()
        self.split = split or self.ep  # the group whose ranks share the tokens (see the module docstring)
        if self.tp.size > 1 and self.ep.size > 1:
            raise ValueError("experts are split either inside (tp) or over the ranks (ep), not both")
        E, d = n_experts, dim
        I = inter // self.tp.size
        self.n_total = n_total or E
        self.first_expert = self.ep.rank * E
        self.limit, self.reference = limit, reference
        self.ep_comm = os.environ.get("ASCEND_DSV4_EP_COMM", "alltoall")
        if self.ep_comm not in EP_COMM:
            raise ValueError(f"ASCEND_DSV4_EP_COMM must be one of {EP_COMM}, got {self.ep_comm!r}")
        if self.split is not self.ep and self.ep_comm != "alltoall":
            raise ValueError("data-parallel attention needs ASCEND_DSV4_EP_COMM=alltoall (the replicas hold different "
                             "tokens, an all-reduce of expert outputs would mix them)")
        self.shard = {"w1": 1, "w3": 1, "w2": 2} if self.tp.size > 1 else {}
        self.fmt = "dense"
        self.w1 = nn.Parameter(torch.empty(E, I, d, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(E, I, d, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, d, I, dtype=dtype), requires_grad=False)
        for n in ("w1_scale", "w2_scale", "w3_scale"):
            self.register_parameter(n, None)
        self._w13 = None  # (w13, scale13, inter, the pointers w1 / w3 / scales had) once stack_weights_ stacked

    def set_weights(self, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
        """Install stacked weights ``w1, w2, w3`` (and ``w1_scale, ...`` for quantised formats)."""
        self.fmt = fmt
        for n in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
            t = tensors.get(n)
            setattr(self, n, None if t is None else nn.Parameter(t, requires_grad=False))
        self._w13 = None

    def _gate_up_ptrs(self) -> tuple:
        return tuple(None if t is None else t.data_ptr() for t in (self.w1, self.w3, self.w1_scale, self.w3_scale))

    @torch.no_grad()
    def stack_weights_(self) -> int:
        """One buffer for w1 and w3 (and one for their scales), [E, 2 * inter, ...], each keeping its half as a view,
        so that the gate and up projections run as one grouped GEMM over the same rows (one launch, twice the weight
        tiles per expert; a GEMM's output column does not depend on the others, so the results are the same).
        Called once by :func:`parallel.linear.stack_model_linears_` (ModelRunner, CUDA); a later
        :meth:`set_weights` or device move gives w1 / w3 their own storage and the halves run one by one again.
        Returns 1 if it stacked."""
        w1, w3, s1, s3 = self.w1, self.w3, self.w1_scale, self.w3_scale
        if (w1 is None or w3 is None or w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device
                or (s1 is None) != (s3 is None) or (s1 is not None and (s1.shape != s3.shape or s1.dtype != s3.dtype))
                or self.fmt not in ("dense", "fp8_block", "fp4") or w1.shape[1] == 0):
            return 0
        if self.fmt == "fp8_block" and w1.shape[1] % 128:  # a 128-row scale block would straddle the halves
            return 0
        inter = w1.shape[1]
        w13 = torch.cat([w1, w3], dim=1)
        s13 = None if s1 is None else torch.cat([s1, s3], dim=1)
        si = 0 if s1 is None else s1.shape[1]
        self.w1, self.w3 = (nn.Parameter(w13[:, :inter], requires_grad=False),
                            nn.Parameter(w13[:, inter:], requires_grad=False))
        if s13 is not None:
            self.w1_scale, self.w3_scale = (nn.Parameter(s13[:, :si], requires_grad=False),
                                            nn.Parameter(s13[:, si:], requires_grad=False))
        self._w13 = (w13, s13, inter, self._gate_up_ptrs())
        return 1

    def _gate_up(self, xs: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(xs @ w1[e]^T, xs @ w3[e]^T): one grouped GEMM over the stacked buffer where :meth:`stack_weights_`
        made one (column views of its output), else two."""
        st = self._w13
        if st is not None:
            if st[3] == self._gate_up_ptrs():
                gu = atb_ops.grouped_matmul(xs, st[0], e, st[1], self.fmt)
                return gu[:, :st[2]], gu[:, st[2]:]
            self._w13 = None  # stale (w1 / w3 moved or replaced): let its buffer go
        return (atb_ops.grouped_matmul(xs, self.w1, e, self.w1_scale, self.fmt),
                atb_ops.grouped_matmul(xs, self.w3, e, self.w3_scale, self.fmt))

    def _rows(self, xs: torch.Tensor, e: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows xs [n, d] of local experts e [n] (sorted), routing weights w [n] -> [n, d] in the GEMM's output dtype
        (the callers sum them in float32: moe_unpermute upcasts as it adds, saving a cast launch)."""
        if self.reference:
            xs = atb_ops.fp8_act_round(xs, 128)
        g, u = self._gate_up(xs, e)
        h = atb_ops.swiglu(g, u, self.limit, row_scale=w, out_dtype=dtype)  # routing weight before w2
        if self.reference:
            h = atb_ops.fp8_act_round(h, 128)
        return atb_ops.grouped_matmul(h, self.w2, e, self.w2_scale, self.fmt)

    @property
    def sums_here(self) -> bool:
        """Whether forward sums each token's rows itself (all experts on this rank: ``moe_unpermute``), so that it
        can add ``skip`` to the sum and round it (:func:`moe_output`)."""
        return self.ep.size == 1

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, skip: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, d]; weights, ids [T, k] (global expert ids) -> sum_j weights[t, j] * expert_{ids[t, j]}(x_t),
        float32 [T, d] (partial over ``tp`` / over ``ep`` with 'allreduce'; see the class docstring). Where
        :attr:`sums_here`: ``+ skip`` [T, d] (added after the rows) in ``out_dtype``, inside ``moe_unpermute``."""
        if (skip is not None or out_dtype is not None) and not self.sums_here:
            raise ValueError("Experts.forward: skip / out_dtype need the rows summed here (expert parallel "
                             "size 1); add the shared output after the reduction (moe_output does)")
        mode = ep_mode(self)
        if mode == "alltoall":
            return self._forward_alltoall(x, weights, ids)
        if mode == "static_dp":
            return ep_static_gather(x, weights, ids, self.ep, self.split, self.w1.shape[0], self.first_expert,
                                    self._rows)
        if mode == "none":  # all experts here: permute / unpermute as ops (npu_moe_init_routing_v2 / finalize)
            xs, e, order = atb_ops.moe_permute(x, ids, self.w1.shape[0])
            y = self._rows(xs, e, weights.reshape(-1)[order], x.dtype)
            return atb_ops.moe_unpermute(y, order, ids.shape[0], skip, out_dtype)
        local_rows = ep_static_rows if mode == "static" else ep_local_rows
        return local_rows(x, weights, ids, self.w1.shape[0], self.first_expert, self._rows)  # partial sums

    def _forward_alltoall(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """EP dispatch / combine (:func:`ep_dispatch_combine`) around this rank's experts (:meth:`_rows`)."""
        return ep_dispatch_combine(x, weights, ids, self.ep, self.split, self.w1.shape[0], self.first_expert,
                                   self._rows)

    def zero_token_step(self, dtype: torch.dtype) -> None:
        """One forward on zero tokens of activation ``dtype``: this layer's EP collectives, for a data-parallel
        replica with no work in a step (:func:`dummy_moe_step`)."""
        dev = self.w1.device
        self(torch.empty(0, self.w2.shape[1], dtype=dtype, device=dev), torch.empty(0, 1, device=dev),
             torch.empty(0, 1, dtype=torch.long, device=dev))


def ep_dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ep: Group, split: Group,
                        n_local: int, first_expert: int, rows) -> torch.Tensor:
    """Expert-parallel dispatch / combine over ``ep`` (each rank holds experts ``first_expert ..
    first_expert + n_local - 1``, the same count on every rank).

    x [T, d] and weights, ids [T, k] (global expert ids) are the same on every rank of ``split`` (the ranks that
    hold the same tokens: the EP group itself, or a data-parallel replica's TP group). Rank r of ``split`` takes
    the r-th chunk of the T tokens, sends each of its (token, expert) rows to the expert's rank, which computes
    ``rows(xs, local_ids, row_weights, x.dtype) -> float [n, d]`` (rows sorted by local expert id, the routing
    weight applied) and sends the outputs back; each token's rows are summed (float32) and the chunks are
    all-gathered over ``split``, so that every rank ends with all T rows (complete sums, float32
    [T, d]). T = 0 (a replica with no work) still takes part in every collective."""
    T, k, d = ids.shape[0], ids.shape[1], x.shape[1]
    per = -(-T // split.size)
    lo, hi = min(split.rank * per, T), min((split.rank + 1) * per, T)
    flat_ids, flat_w = ids[lo:hi].reshape(-1), weights[lo:hi].reshape(-1).float()
    dest = flat_ids // n_local
    order = torch.argsort(flat_ids, stable=True)  # by expert, hence by destination rank
    send_counts = torch.bincount(dest, minlength=ep.size)
    recv_counts = exchange_counts(send_counts, ep)  # on the data's device: NCCL / HCCL take no CPU tensors
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    tok = order // k
    r_x = all_to_all(x[lo:hi][tok], sc, rc, ep)
    r_e = all_to_all(flat_ids[order], sc, rc, ep)
    r_w = all_to_all(flat_w[order], sc, rc, ep)
    local = r_e - first_expert
    o = torch.argsort(local, stable=True)  # rows from several sources: regroup by expert
    y = torch.empty(r_x.shape[0], d, dtype=torch.float32, device=x.device)
    y[o] = rows(r_x[o], local[o], r_w[o], x.dtype).float()
    back = all_to_all(y, rc, sc, ep)  # the rows this rank sent, in the order it sent them
    out = torch.zeros(per, d, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, back)
    return all_gather(out, split, 0)[:T]


def ep_local_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_local: int, first_expert: int,
                  rows) -> torch.Tensor:
    """The all-reduce form of expert parallelism (``ASCEND_DSV4_EP_COMM=allreduce``): this rank's experts
    ``first_expert .. first_expert + n_local - 1`` over every token that chose one of them; returns the partial sum
    float32 [T, d] (``rows`` as in :func:`ep_dispatch_combine`), which the MoE all-reduces over the EP ranks."""
    T, k = ids.shape
    flat_ids = ids.reshape(-1)
    mine = ((flat_ids >= first_expert) & (flat_ids < first_expert + n_local)).nonzero(as_tuple=True)[0]
    order = mine[torch.argsort(flat_ids[mine], stable=True)]  # this rank's pairs, grouped by expert
    tok = order // k
    y = rows(x[tok], flat_ids[order] - first_expert, weights.reshape(-1)[order], x.dtype)
    return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y.float())


def ep_static_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_local: int, first_expert: int,
                   rows) -> torch.Tensor:
    """:func:`ep_local_rows`' partial sum float32 [T, d] with shapes that do not depend on the routing (what a
    captured step needs): all T * k (token, expert) rows are permuted (``moe_permute`` over ``n_local + 1`` ids),
    those of other ranks' experts with id ``n_local`` -- one past this rank's last, which ``grouped_matmul`` writes
    as zero rows -- and routing weight 0; ``rows`` (as in :func:`ep_dispatch_combine`) computes them and
    ``moe_unpermute`` sums each token's rows. The same values as :func:`ep_local_rows` up to the order of the
    float32 additions (zero rows add nothing). The grouped GEMMs skip the id-``n_local`` rows: the extra cost is
    the permuted copy of every row."""
    T = ids.shape[0]
    local = ids - first_expert
    mine = (local >= 0) & (local < n_local)
    lid = torch.where(mine, local, n_local)
    w = torch.where(mine, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    xs, e, order = atb_ops.moe_permute(x, lid, n_local + 1)
    y = rows(xs, e, w.reshape(-1)[order], x.dtype)
    return atb_ops.moe_unpermute(y, order, T)


def ep_static_gather(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ep: Group, split: Group,
                     n_local: int, first_expert: int, rows) -> torch.Tensor:
    """:func:`ep_dispatch_combine`'s complete sums float32 [T, d] with shapes that depend only on T (a captured step
    under data parallelism, T the batch bucket every replica pads its step to): rank r of ``split`` takes the r-th
    chunk of ceil(T / split.size) tokens (padded with zero rows routed nowhere: id -1, weight 0), the chunks of all
    EP ranks are all-gathered, this rank's experts compute every gathered row in the static form
    (:func:`ep_static_rows`), the partial sums are reduce-scattered (each rank receives the sum for its own chunk)
    and all-gathered over ``split``. The same values as the all-to-all up to the order of the float32 additions;
    the cost is the rows of every rank's chunk gathered to every rank (decode-sized: a few rows each)."""
    T, k, d = ids.shape[0], ids.shape[1], x.shape[1]
    per = -(-T // split.size)
    lo, hi = min(split.rank * per, T), min((split.rank + 1) * per, T)
    xc, wc, ic = x[lo:hi], weights[lo:hi], ids[lo:hi]
    if hi - lo < per:  # static: T, per and the rank fix this padding
        pad = per - (hi - lo)
        xc = torch.cat([xc, xc.new_zeros(pad, d)])
        wc = torch.cat([wc, wc.new_zeros(pad, k)])
        ic = torch.cat([ic, ic.new_full((pad, k), -1)])
    gx, gw, gi = all_gather(xc, ep, 0), all_gather(wc, ep, 0), all_gather(ic, ep, 0)
    mine = reduce_scatter(ep_static_rows(gx, gw, gi, n_local, first_expert, rows), ep)  # [per, d]
    return all_gather(mine, split, 0)[:T]


def routed_experts(cfg, inter: int, limit: float, dtype: torch.dtype, reference: bool, parallel) -> Experts:
    """The routed experts of one layer for a rank: split inside (TP) or partitioned (EP) per ``parallel``."""
    E = cfg.n_routed_experts
    if parallel is None or parallel.world_size == 1:
        return Experts(E, inter, cfg.dim, limit, dtype, reference)
    if parallel.ep.size > 1:
        split = parallel.tp if getattr(parallel, "dp_size", 1) > 1 else None
        return Experts(E // parallel.ep.size, inter, cfg.dim, limit, dtype, reference, ep=parallel.ep, n_total=E,
                       split=split)
    return Experts(E, inter, cfg.dim, limit, dtype, reference, tp=parallel.tp)


def _zero_token_steps(modules, dtype: torch.dtype) -> int:
    """Run ``zero_token_step`` of every expert-parallel routed-experts module among ``modules`` (in order)."""
    n = 0
    for m in modules:
        ep = getattr(m, "ep", None)
        if isinstance(ep, Group) and ep.size > 1 and callable(getattr(m, "zero_token_step", None)):
            m.zero_token_step(dtype)
            n += 1
    return n


def dummy_moe_step(model: nn.Module) -> int:
    """The EP collectives of one forward with no tokens (a data-parallel replica with no work in a step): the
    expert-parallel routed experts of every main layer (``model.layers``, in order; not the MTP layers) run on
    zero rows -- :class:`Experts` and msModelSlim's ``ParallelQuantExperts`` alike, whatever has an ``ep`` group
    of more than one rank and a ``zero_token_step``. Returns how many layers took part."""
    return _zero_token_steps((m for layer in model.layers for m in layer.modules()), model.dtype)


def dummy_mtp_step(model: nn.Module, k: int = 0) -> int:
    """:func:`dummy_moe_step` for MTP module ``k`` (``model.mtp[k]``): what a data-parallel replica that does not
    draft in a step runs while another replica's draft (``model.mtp_logits``) runs that module's experts."""
    return _zero_token_steps(model.mtp[k].modules(), model.dtype)


def moe_output(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               shared: torch.Tensor | None, tp: Group, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The MoE's output: ``experts(x, weights, ids)`` + the shared expert's ``shared`` (float [T, d] or None),
    reduced over ``tp`` where partial, in ``out_dtype`` (default float32): the float32 sum rounded once. Where the
    experts sum their rows here (:attr:`Experts.sums_here`) ``shared`` joins that sum as ``moe_unpermute``'s
    ``skip`` (as ``npu_moe_finalize_routing``'s ``skip1`` in the DeepSeek-V4 NPU recipe) and, without an all-reduce,
    is rounded there: the sum, the add and the rounding in one kernel (the add was a launch of its own). Else
    :func:`reduce_moe`."""
    if shared is not None and getattr(experts, "sums_here", False):
        if tp.size == 1:
            return experts(x, weights, ids, skip=shared, out_dtype=out_dtype)
        return reduce_moe(experts(x, weights, ids, skip=shared), None, experts, tp, out_dtype)  # all-reduce, round
    return reduce_moe(experts(x, weights, ids), shared, experts, tp, out_dtype)


def reduce_moe(routed: torch.Tensor, shared: torch.Tensor | None, experts: Experts, tp: Group,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum of the routed and shared outputs (float32 [T, d]) with one all-reduce of the partial sums, in
    ``out_dtype`` (default float32): the float32 sum rounded once. Without an all-reduce the sum and the rounding
    are one launch (``torch.add`` computes in the promoted float32 and writes ``out_dtype``), not three."""
    if complete_rows(ep_mode(experts)):  # complete rows (msModelSlim's QuantExperts at world size 1: 'none')
        y = routed if shared is None else routed + all_reduce(shared.float(), tp)
    elif shared is not None and tp.size == 1 and out_dtype is not None:
        return torch.add(routed, shared, out=torch.empty(routed.shape, dtype=out_dtype, device=routed.device))
    else:
        y = all_reduce(routed if shared is None else routed + shared.float(), tp)
    return y if out_dtype is None else y.to(out_dtype)
