"""Process groups for tensor / expert parallelism and the communication backend chosen by device.

Layout (vLLM's meaning of the flags): ``world = tensor_parallel_size`` ranks on one node. Attention, dense MLPs,
the embedding and the head are split over the tensor-parallel (TP) group. Routed experts are either split inside
every expert over the same TP group (``enable_expert_parallel=False``: each rank holds a K / N slice of every
expert) or partitioned whole over the expert-parallel (EP) group (``enable_expert_parallel=True``: EP size = TP
size, ``E / ep`` consecutive experts per rank). Both groups span the world today; they are separate
``torch.distributed`` groups so that their communicators (and, on Ascend, their HCCL buffers) are separate,
and so that a data-parallel dimension could be added without changing the layers (``parallel/dp_groups.py``:
one TP group per attention replica, the EP group over all replicas' ranks).

Backend by device: ``npu`` -> ``hccl``, ``cuda`` -> ``nccl``, ``cpu`` -> ``gloo``; ``backend=`` overrides it.
On ``hccl`` each group gets torch_npu's ``ProcessGroupHCCL.Options`` with ``hccl_config = {"hccl_buffer_size":
MB}`` (the per-group HCCL window; ``HCCL_BUFFSIZE`` or ``hccl_buffer_mb``, default 200 MB as torch_npu's own
default) and every group is created with ``timeout = HCCL_CONNECT_TIMEOUT`` seconds when that variable is set
(HCCL itself also reads it when the communicator connects). Without torch_npu (CPU tests, where ``hccl`` is a
test backend registered by name that delegates to gloo) the same settings travel in :class:`HcclGroupOptions`.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("parallel")

BACKEND_BY_DEVICE = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEFAULT_HCCL_BUFFER_MB = 200
DEFAULT_TIMEOUT_S = 600.0


class ParallelError(RuntimeError):
    """A process group cannot be built or a collective failed; the message names the backend and the group."""


def backend_for_device(device: str | torch.device, override: str | None = None) -> str:
    """The torch.distributed backend for a device type (``override`` wins when given)."""
    if override:
        return override
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in BACKEND_BY_DEVICE:
        raise ParallelError(f"no communication backend for device type {kind!r}; expected one of "
                            f"{', '.join(BACKEND_BY_DEVICE)} or an explicit backend=")
    return BACKEND_BY_DEVICE[kind]


@dataclass
class HcclGroupOptions:
    """The HCCL settings of one group when torch_npu is not importable (same attribute as its Options)."""

    hccl_config: dict = field(default_factory=dict)
    group_name: str = ""


def hccl_buffer_mb(explicit: int | None = None) -> int:
    if explicit is not None:
        return int(explicit)
    env = os.environ.get("HCCL_BUFFSIZE")
    if env:
        try:
            return int(env)
        except ValueError as e:
            raise ParallelError(f"HCCL_BUFFSIZE={env!r} is not an integer number of MB (backend hccl)") from e
    return DEFAULT_HCCL_BUFFER_MB


def connect_timeout_s(backend: str, explicit: float | None = None) -> float:
    """Group set-up / collective timeout: ``explicit``, else ``HCCL_CONNECT_TIMEOUT`` on hccl, else 600 s."""
    if explicit is not None:
        return float(explicit)
    env = os.environ.get("HCCL_CONNECT_TIMEOUT") if backend == "hccl" else None
    if env:
        try:
            return float(env)
        except ValueError as e:
            raise ParallelError(f"HCCL_CONNECT_TIMEOUT={env!r} is not a number of seconds (backend hccl)") from e
    return DEFAULT_TIMEOUT_S


def hccl_group_options(group_name: str, buffer_mb: int | None = None) -> Any:
    """torch_npu's ``ProcessGroupHCCL.Options`` carrying ``hccl_buffer_size`` (MB) for one group; a
    :class:`HcclGroupOptions` with the same ``hccl_config`` where torch_npu is absent."""
    cfg = {"hccl_buffer_size": hccl_buffer_mb(buffer_mb)}
    try:
        import torch_npu  # noqa: F401

        opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
        opts.hccl_config = cfg
        return opts
    except ImportError:
        return HcclGroupOptions(cfg, group_name)


@dataclass(frozen=True)
class Group:
    """A communication group as the layers see it: this process's rank in it, its size, the torch group
    (``None`` = the default group; ignored when ``size == 1``)."""

    rank: int = 0
    size: int = 1
    pg: Any = None
    backend: str = ""

    def __post_init__(self):
        if not (0 <= self.rank < self.size):
            raise ParallelError(f"group rank {self.rank} is not in [0, {self.size})")


def resolve_group(group: Any = None) -> Group:
    """``Group`` -> itself; a torch ProcessGroup -> its rank/size; ``None`` -> the default process group, or
    world size 1 when torch.distributed is not initialised."""
    if isinstance(group, Group):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return Group()
    return Group(dist.get_rank(group), dist.get_world_size(group), group, str(dist.get_backend(group)))


@dataclass
class ParallelState:
    """What one rank knows about the layout: world rank/size and its TP and EP groups."""

    world: Group
    tp: Group
    ep: Group
    backend: str
    enable_expert_parallel: bool = False
    dp_rank: int = 0  # data-parallel replica of this rank (parallel/dp_groups.py); 0 of 1 without DP
    dp_size: int = 1

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size


def single_rank_state() -> ParallelState:
    g = Group()
    return ParallelState(g, g, g, "", False)


def local_state(tp_size: int, tp_rank: int, enable_expert_parallel: bool = False) -> ParallelState:
    """A state with ranks but no communicator (for building a rank's model on ``meta`` to size it)."""
    g = Group(tp_rank, tp_size)
    return ParallelState(g, g, g if enable_expert_parallel else Group(), "", enable_expert_parallel)


def init_parallel(tensor_parallel_size: int, rank: int, init_method: str, *, device: str | torch.device = "cpu",
                  enable_expert_parallel: bool = False, backend: str | None = None,
                  timeout_s: float | None = None, hccl_buffer_mb_: int | None = None, store=None) -> ParallelState:
    """Initialise torch.distributed for this rank (world = ``tensor_parallel_size``) and build its groups.

    ``init_method``: a ``tcp://host:port`` or ``file://`` rendezvous shared by all ranks (or ``store``: a
    torch.distributed Store the caller already connected, see :func:`rendezvous_store`). Raises
    :class:`ParallelError` naming the backend when the rendezvous or a group fails.
    """
    be = backend_for_device(device, backend)
    world = int(tensor_parallel_size)
    if world < 1 or not (0 <= rank < world):
        raise ParallelError(f"rank {rank} is not in a world of {world} (backend {be})")
    timeout = datetime.timedelta(seconds=connect_timeout_s(be, timeout_s))
    kwargs: dict[str, Any] = {}
    if be == "hccl":
        kwargs["pg_options"] = hccl_group_options("world", hccl_buffer_mb_)
    try:
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = init_method
        dist.init_process_group(be, world_size=world, rank=rank, timeout=timeout, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the backend named
        raise ParallelError(f"backend {be}: rank {rank} of {world} could not join the process group at "
                            f"{init_method}: {e}") from e
    ranks = list(range(world))

    def group(name: str) -> Group:
        opts = hccl_group_options(name, hccl_buffer_mb_) if be == "hccl" else None
        try:
            pg = dist.new_group(ranks, timeout=timeout, backend=be, pg_options=opts)
        except Exception as e:  # noqa: BLE001
            raise ParallelError(f"backend {be}: could not create the {name} group over ranks {ranks}: {e}") from e
        return Group(dist.get_rank(pg), dist.get_world_size(pg), pg, be)

    tp = group("tp")
    ep = group("ep") if enable_expert_parallel else Group(backend=be)
    state = ParallelState(Group(rank, world, None, be), tp, ep, be, enable_expert_parallel)
    log.info("rank %d/%d: backend %s, tp %d, ep %d", rank, world, be, tp.size, ep.size)
    return state


_BEFORE_DESTROY: list = []  # callables run by destroy_parallel before the groups go


def before_destroy(fn) -> None:
    """Run ``fn()`` in :func:`destroy_parallel` before the process groups are destroyed (once per registration;
    ``engine/cuda_graphs.py`` releases its captured graphs there)."""
    if fn not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(fn)


def destroy_parallel() -> None:
    """Destroy this process's groups, after the :func:`before_destroy` hooks: a captured CUDA graph that holds NCCL
    collectives makes ``ncclCommDestroy`` wait forever while the graph lives (pytorch/pytorch#115388; seen here
    with the Ray executor's graph decode, scripts/bench_results/nccl_h200x4_session15.txt)."""
    for fn in list(_BEFORE_DESTROY):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failing hook must not keep the groups alive
            log.warning("destroy_parallel: a before-destroy hook failed: %s: %s", type(e).__name__, e)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def set_rank_device(device: torch.device) -> None:
    """Make ``device`` (``cuda:i`` / ``npu:i``) this process's current device before its groups are built."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(device)


def visible_devices(device_type: str) -> int | None:
    """Devices of ``device_type`` this process can see (None for CPU: ranks are processes, not devices)."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return 0
        return torch.npu.device_count()
    return None


def rendezvous_store(host: str, port: int, world: int, rank: int, timeout_s: float):
    """A TCP store for ``init_parallel(store=...)``: rank 0 serves it without waiting for the others (so that it
    can watch its workers while they come up), the other ranks connect to it and announce themselves
    (key ``alive/<rank>``)."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    if rank:
        store.set(f"alive/{rank}", "1")
    return store
