"""Process groups of data-parallel attention with expert-parallel MoE (vLLM's ``--data-parallel-size``).

Layout: ``world = D x T`` ranks (``D`` = data_parallel_size replicas, ``T`` = tensor_parallel_size ranks each).
Global rank ``r`` is rank ``r % T`` of replica ``r // T``. Each replica has its own TP group (ranks
``d*T .. d*T + T - 1``) for attention, dense MLPs, shared experts, embedding and head; one EP group spans all
``D x T`` ranks for the routed experts (``E / (D x T)`` whole experts per rank, tokens dispatched / combined by
all-to-all; see ``ascend_dsv4.layers.experts``). The replicas hold different tokens: each replica's engine has
its own scheduler and KV pools; only the routed-expert layers communicate across replicas.

Every rank creates every TP group (``torch.distributed.new_group`` must be called by all ranks in the same order)
and keeps its own.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from .groups import (Group, ParallelError, ParallelState, backend_for_device, connect_timeout_s,
                     hccl_group_options)

log = logging.getLogger("parallel")


def dp_coords(rank: int, tp: int) -> tuple[int, int]:
    """(replica, rank inside the replica) of global ``rank``."""
    return rank // tp, rank % tp


def local_dp_state(dp: int, tp: int, rank: int) -> ParallelState:
    """A state with ranks but no communicator (building a rank's model on ``meta`` to size it)."""
    d, t = dp_coords(rank, tp)
    return ParallelState(Group(rank, dp * tp), Group(t, tp), Group(rank, dp * tp), "", True, d, dp)


def init_dp_parallel(data_parallel_size: int, tensor_parallel_size: int, rank: int, *, store=None,
                     init_method: str | None = None,
                     device: str | torch.device = "cpu", backend: str | None = None,
                     timeout_s: float | None = None, hccl_buffer_mb_: int | None = None) -> ParallelState:
    """Join the world of ``D x T`` ranks through ``store`` (or the ``tcp://`` ``init_method``) and build this
    rank's TP group and the EP group over all ranks. Raises :class:`ParallelError` naming the backend when the rendezvous or a group fails."""
    be = backend_for_device(device, backend)
    dp, tp = int(data_parallel_size), int(tensor_parallel_size)
    world = dp * tp
    if dp < 1 or tp < 1 or not (0 <= rank < world):
        raise ParallelError(f"rank {rank} is not in a world of {dp} x {tp} (backend {be})")
    timeout = datetime.timedelta(seconds=connect_timeout_s(be, timeout_s))
    kwargs: dict[str, Any] = {"pg_options": hccl_group_options("world", hccl_buffer_mb_)} if be == "hccl" else {}
    try:
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = init_method
        dist.init_process_group(be, world_size=world, rank=rank, timeout=timeout, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ParallelError(f"backend {be}: rank {rank} of {world} could not join the process group: {e}") from e

    def group(name: str, ranks: list[int]):
        opts = hccl_group_options(name, hccl_buffer_mb_) if be == "hccl" else None
        try:
            return dist.new_group(ranks, timeout=timeout, backend=be, pg_options=opts)
        except Exception as e:  # noqa: BLE001
            raise ParallelError(f"backend {be}: could not create the {name} group over ranks {ranks}: {e}") from e

    d, t = dp_coords(rank, tp)
    mine = None
    for r in range(dp):  # every rank creates every replica's TP group, in the same order
        pg = group(f"tp{r}", list(range(r * tp, (r + 1) * tp)))
        if r == d:
            mine = pg
    ep_pg = group("ep", list(range(world)))
    state = ParallelState(Group(rank, world, None, be), Group(t, tp, mine, be), Group(rank, world, ep_pg, be), be,
                          True, d, dp)
    log.info("rank %d/%d: replica %d of %d, tp rank %d of %d, ep %d (backend %s)", rank, world, d, dp, t, tp, world,
             be)
    return state
