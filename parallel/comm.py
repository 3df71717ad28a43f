"""Collectives over a :class:`parallel.groups.Group`; identities at group size 1 (no torch.distributed needed).

Every failure is re-raised as :class:`ParallelError` naming the collective, the backend and the group size, so
that a dead peer surfaces as one readable line instead of a backend stack trace.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import Group, ParallelError


def _fail(op: str, g: Group, e: Exception) -> ParallelError:
    return ParallelError(f"{op} over a group of {g.size} (backend {g.backend or dist.get_backend(g.pg)}) failed: {e}")


def all_reduce(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Sum of ``x`` over the group (in place when it communicates; returns the result)."""
    if g.size == 1:
        return x
    x = x.contiguous()
    try:
        dist.all_reduce(x, group=g.pg)
    except Exception as e:  # noqa: BLE001
        raise _fail("all_reduce", g, e) from e
    return x


def all_gather(x: torch.Tensor, g: Group, dim: int = -1) -> torch.Tensor:
    """Concatenation of every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
    if g.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(g.size)]
    try:
        dist.all_gather(parts, x.contiguous(), group=g.pg)
    except Exception as e:  # noqa: BLE001
        raise _fail("all_gather", g, e) from e
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, g: Group) -> torch.Tensor:
    """This rank's share of the sum over the group: x [size * n, *rest] (same shape on every rank) -> the sum of
    every rank's rows ``rank * n .. rank * n + n - 1``, [n, *rest]. gloo has no reduce-scatter: there the sum is an
    all-reduce of all of x, of which the rank keeps its rows (the same values, more traffic: CPU tests)."""
    if g.size == 1:
        return x
    if x.shape[0] % g.size:
        raise ParallelError(f"reduce_scatter: {x.shape[0]} rows do not split over a group of {g.size}")
    n = x.shape[0] // g.size
    if (g.backend or str(dist.get_backend(g.pg))) == "gloo":
        return all_reduce(x.clone(), g)[g.rank * n:(g.rank + 1) * n]
    out = x.new_empty((n,) + tuple(x.shape[1:]))
    try:
        dist.reduce_scatter_tensor(out, x.contiguous(), group=g.pg)
    except Exception as e:  # noqa: BLE001
        raise _fail("reduce_scatter", g, e) from e
    return out


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], g: Group) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` go to rank r; returns the rows received, grouped by source rank.

    x: [sum(send_counts), *rest]; returns [sum(recv_counts), *rest] (same dtype).
    """
    if g.size == 1:
        return x
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=g.pg)
    except Exception as e:  # noqa: BLE001
        raise _fail("all_to_all", g, e) from e
    return out


def exchange_counts(send_counts: torch.Tensor, g: Group) -> torch.Tensor:
    """int64 [size] rows this rank sends to each rank -> int64 [size] rows it receives from each rank. The counts
    must live where the backend communicates (the data's device for NCCL / HCCL, which refuse CPU tensors: an
    expert-parallel all-to-all over NCCL failed on CPU counts, found on 2 H200s in session 9)."""
    if g.size == 1:
        return send_counts
    recv = torch.empty_like(send_counts)
    try:
        dist.all_to_all_single(recv, send_counts.contiguous(), group=g.pg)
    except Exception as e:  # noqa: BLE001
        raise _fail("all_to_all (counts)", g, e) from e
    return recv
