"""Ray executor: one worker actor per rank, placed over a Ray cluster, process groups across nodes.

``RayExecutor(world_size, worker_cls, worker_kwargs, device="npu").start()`` connects to the Ray cluster
(``address`` / ``$RAY_ADDRESS``; a local one is started when none is given), checks that the cluster can hold
one bundle per rank (:mod:`ascend_dsv4.engine.ray_placement`; a shortfall is reported at once: asked vs the
cluster's), reserves them in a ``PACK`` placement group, starts one :class:`RankWorker` actor per bundle with the
environment propagated, orders ranks by node, and in every actor initialises the process groups
(:func:`parallel.init_parallel` over ``tcp://<rank 0 node>:<free port>``) and builds ``worker_cls(rank=...,
local_rank=..., device_index=..., state=..., **worker_kwargs)`` -- the object the executor then drives with
:meth:`RayExecutor.collective_rpc` (call one method on every rank, results in rank order).

Environment: the node-independent variables of the launch scripts (:data:`PROPAGATED_ENV`, plus every
``ASCEND_DSV4_*`` / ``ATB_OPS_*``) are copied from the driver into each actor (Ray ``runtime_env``);
``HCCL_IF_IP`` and the device visibility stay the node's own (the raylet's, set by ``scripts/ray_*.sh``), with
``HCCL_IF_IP`` defaulting to the node's Ray address; ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` /
``LOCAL_RANK`` / ``WORLD_SIZE`` are set per rank.

Failures: no call waits without a timeout (``start_timeout_s`` for placement and start-up, ``call_timeout_s``
per call); the first rank that fails or dies ends the call at once with an :class:`ExecutorError` naming the rank
and its node, and the executor stays failed (:attr:`RayExecutor.error`; every later call raises the same error)
until it is shut down and started again.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from typing import Any, Callable

from .executor import ExecutorError
from .ray_placement import (RESOURCE_BY_DEVICE, PlacementError, RankSlot, capacity_problem, describe_bundles,
                            local_device_index, order_ranks, rank_bundles)

log = logging.getLogger("ascend_dsv4.ray")

PROPAGATED_ENV = ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT",
                  "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_OP_EXPANSION_MODE", "HCCL_INTRA_PCIE_ENABLE",
                  "HCCL_INTRA_ROCE_ENABLE", "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
                  "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE",
                  "OMP_NUM_THREADS", "OMP_PROC_BIND", "PYTHONPATH")
PROPAGATED_PREFIXES = ("ASCEND_DSV4_", "ATB_OPS_")
RECOVER = ("the server process stays up but cannot serve: restart it (the Ray cluster can stay up); "
           "`ascend-dsv4 check-env --nodes N` shows which node or NIC is at fault")


def propagated_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables every rank gets (see the module docstring); never HCCL_IF_IP or device visibility."""
    env = dict(os.environ) if env is None else env
    return {k: v for k, v in env.items() if k in PROPAGATED_ENV or k.startswith(PROPAGATED_PREFIXES)}


def _import(path: str):
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ExecutorError(f"worker class {path!r} cannot be imported on this node: {e}") from e


def _set_rank_device(device: str, index: int) -> None:
    """Make NPU / GPU ``index`` current before the groups are built (parallel's helper owns the device code)."""
    import torch

    try:
        from parallel.groups import set_rank_device
    except ImportError as e:
        raise ExecutorError(f"this build of parallel/ cannot select the {device} of a rank ({e})") from e
    set_rank_device(torch.device(device, index))


class RankWorker:
    """The body of one rank's Ray actor (made remote by :class:`RayExecutor`)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.rank: int | None = None

    def node_info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "accelerator_ids": {k: list(v) for k, v in ctx.get_accelerator_ids().items()},
                "visible": {k: os.environ.get(k) for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_rank(self, rank: int, world_size: int, local_rank: int, device_index: int | None, ip: str,
                  master: tuple[str, int], device: str, enable_expert_parallel: bool, backend: str | None,
                  timeout_s: float, worker_cls: str, worker_kwargs: dict, data_parallel_size: int = 1) -> int:
        from parallel import init_parallel

        os.environ.setdefault("HCCL_IF_IP", ip)  # the raylet's value (scripts/ray_*.sh) wins
        if device != "cpu" and device_index is not None:
            _set_rank_device(device, device_index)
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)})
        if data_parallel_size > 1:  # D attention replicas, experts EP over all ranks (parallel/dp_groups.py)
            from parallel.dp_groups import init_dp_parallel

            state = init_dp_parallel(data_parallel_size, world_size // data_parallel_size, rank,
                                     init_method=f"tcp://{master[0]}:{master[1]}", device=device, backend=backend,
                                     timeout_s=timeout_s)
        else:
            state = init_parallel(world_size, rank, f"tcp://{master[0]}:{master[1]}", device=device,
                                  enable_expert_parallel=enable_expert_parallel, backend=backend, timeout_s=timeout_s)
        self.rank = rank
        self.worker = _import(worker_cls)(rank=rank, local_rank=local_rank, device_index=device_index, state=state,
                                          **worker_kwargs)
        return os.getpid()

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def close(self) -> None:
        from parallel import destroy_parallel

        if self.worker is not None and hasattr(self.worker, "close"):
            self.worker.close()
        destroy_parallel()


class RayExecutor:
    """Drive ``world_size`` ranks on a Ray cluster (see the module docstring).

    ``local_rank0``: rank 0 runs in this process (the engine's, as in the ``mp`` executor): its bundle is pinned
    to this node (``node:<ip>`` resource) and held by an idle actor so that Ray reserves its device; the actors run
    ranks 1..N-1, and ``local_rank0(master, device_index)`` is called once their initialisation has been sent
    (it must join the same process groups); the executor then waits for the actors' initialisation.
    """

    def __init__(self, world_size: int, worker_cls: str, worker_kwargs: dict | None = None, *, device: str = "npu",
                 address: str | None = None, enable_expert_parallel: bool = False, backend: str | None = None,
                 cpus_per_rank: float = 1.0, start_timeout_s: float = 600.0, call_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None, local_rank0: Callable[[tuple[str, int], int | None], None] | None
                 = None, data_parallel_size: int = 1) -> None:
        self.data_parallel_size = data_parallel_size
        self.world_size, self.worker_cls, self.worker_kwargs = world_size, worker_cls, dict(worker_kwargs or {})
        self.device, self.address = device, address or os.environ.get("RAY_ADDRESS")
        self.enable_expert_parallel, self.backend = enable_expert_parallel, backend
        self.cpus_per_rank, self.start_timeout_s, self.call_timeout_s = cpus_per_rank, start_timeout_s, call_timeout_s
        self.env = propagated_env(env)
        self.bundles = rank_bundles(world_size, device, cpus_per_rank)
        self.local_rank0 = local_rank0
        self.workers: list[Any] = []  # actors running ranks, in rank order (from rank 1 with local_rank0)
        self.slots: list[RankSlot] = []  # every rank's place, rank order
        self.error: str | None = None
        self._holder = None
        self._pg = None
        self._owns_ray = False

    @property
    def first_actor_rank(self) -> int:
        return 1 if self.local_rank0 else 0

    # ---- start-up -------------------------------------------------------------------------------------

    def start(self) -> RayExecutor:
        """Place and start the ranks; on any failure everything started so far is torn down before raising."""
        try:
            return self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> RayExecutor:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            self._owns_ray = True
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
        my_ip, my_node = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        bundles = [dict(b) for b in self.bundles]
        if self.local_rank0:
            bundles[0][f"node:{my_ip}"] = 0.001  # rank 0's device must be on this node
        problem = capacity_problem(bundles, ray.nodes())
        if problem:  # the cluster can never hold it: say so at once
            raise PlacementError(f"cannot place {self.world_size} rank(s) on the Ray cluster: {problem}; start more "
                                 "nodes (scripts/ray_worker.sh) or lower --tensor-parallel-size / --data-parallel-size")
        busy = capacity_problem(bundles, ray.nodes(), ray.available_resources())
        if busy:  # held by other jobs (or a placement group still being freed): wait, bounded, below
            log.warning("ray executor: %s; waiting up to %g s for them", busy, self.start_timeout_s)
        self._pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.start_timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            self._pg = None
            problem = capacity_problem(bundles, ray.nodes(), ray.available_resources())
            raise PlacementError(f"the placement group for {describe_bundles(self.bundles)} was not satisfied within "
                                 f"{self.start_timeout_s:g} s: {problem or 'the bundles fit in total but not as packed'}")
        res = RESOURCE_BY_DEVICE[self.device]
        remote = ray.remote(RankWorker)
        actors = []
        for i, b in enumerate(bundles):
            opts: dict[str, Any] = {"num_cpus": b.get("CPU", 0.0),
                                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                        self._pg, placement_group_bundle_index=i),
                                    "runtime_env": {"env_vars": self.env}}
            if res == "GPU":
                opts["num_gpus"] = b[res]
            elif res != "CPU":
                opts["resources"] = {res: b[res]}
            actors.append(remote.options(**opts).remote())
        self.workers = actors  # so that a failure below can shut them down
        infos = self._get([a.node_info.remote() for a in actors], self.start_timeout_s, "start the rank actors")
        slots = [RankSlot(i, inf["node_id"], inf["ip"], tuple(inf["accelerator_ids"].get(res, ())))
                 for i, inf in enumerate(infos)]
        vis_var = {"NPU": "ASCEND_RT_VISIBLE_DEVICES", "GPU": "CUDA_VISIBLE_DEVICES"}.get(res)
        if self.local_rank0:
            self._holder = actors[0]  # keeps rank 0's device reserved; rank 0 itself runs here
            home = slots[0].node_id  # where rank 0's device is reserved: this node
            order = [(0, 0, slots[0])] + [(r + 1, local + (s.node_id == home), s)
                                          for r, local, s in order_ranks(slots[1:], home)]
        else:
            order = order_ranks(slots, my_node)
        self.slots = [s for _, _, s in order]
        self.workers = [actors[s.bundle] for r, _, s in order if r >= self.first_actor_rank]
        if self.local_rank0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                master = (my_ip, sock.getsockname()[1])
        else:
            port = self._get([self.workers[0].free_port.remote()], self.start_timeout_s, "pick a port on rank 0")[0]
            master = (self.slots[0].ip, port)
        calls = []
        for rank, local, s in order:
            if rank < self.first_actor_rank:
                continue
            dev = local_device_index(s.accelerator_ids, infos[s.bundle]["visible"].get(vis_var) if vis_var else None)
            calls.append(actors[s.bundle].init_rank.remote(
                rank, self.world_size, local, dev, s.ip, master, self.device, self.enable_expert_parallel,
                self.backend, self.start_timeout_s, self.worker_cls, self.worker_kwargs, self.data_parallel_size))
        if self.local_rank0:
            dev0 = local_device_index(slots[0].accelerator_ids, os.environ.get(vis_var) if vis_var else None)
            try:
                self.local_rank0(master, dev0)
            except Exception as e:  # a peer's own report is the clearer account
                self.first_failure(calls, "initialise rank 0 and join the process groups", e)
        self._get(calls, self.start_timeout_s, "initialise the process groups and workers")
        log.info("ray executor: %d ranks on %d node(s), rank 0 at %s:%d", self.world_size,
                 len({s.node_id for s in self.slots}), *master)
        return self

    # ---- calls --------------------------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``worker.method(*args, **kwargs)`` on every actor rank; the results in rank order."""
        return self._get(self.submit(method, *args, **kwargs), self.call_timeout_s if timeout is None else timeout,
                         method)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Start ``method`` on every actor rank; the object refs (wait with :meth:`wait`)."""
        if self.error:
            raise ExecutorError(self.error)
        if not self.workers and self.world_size > self.first_actor_rank:
            raise ExecutorError("the Ray executor is not started")
        return [w.execute.remote(method, args, kwargs) for w in self.workers]

    def wait(self, refs: list, what: str, timeout: float | None = None) -> list[Any]:
        return self._get(refs, self.call_timeout_s if timeout is None else timeout, what)

    def _where(self, i: int) -> str:
        rank = i + self.first_actor_rank
        if rank < len(self.slots):
            return f"rank {rank} (node {self.slots[rank].ip})"
        return f"rank actor {i}"

    def first_failure(self, refs: list, what: str, exc: BaseException) -> None:
        """Rank 0 (this process) failed inside ``what``: raise the clearest account, a peer's own failure if one
        shows up within a few seconds (a dead peer makes rank 0's collective fail), else rank 0's."""
        if refs:
            self._get(refs, 5.0, what, on_timeout=lambda late: None)
        self._fail(f"{what}: rank 0 failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

    def _get(self, refs: list, timeout: float, what: str, on_timeout=None) -> list[Any]:
        """Wait for all ``refs``; the first error ends the wait at once; nothing waits past ``timeout``."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        index = {r: i for i, r in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
            if not ready:
                late = ", ".join(self._where(index[r]) for r in pending)
                if on_timeout is not None:
                    return on_timeout(late)
                self._fail(f"{what}: {late} did not answer within {timeout:g} s (a peer may have died inside a "
                           f"collective; HCCL_EXEC_TIMEOUT bounds that on Ascend)")
            for r in ready:
                try:
                    ray.get(r, timeout=0)
                except RayActorError as e:
                    self._fail(f"{what}: {self._where(index[r])} died ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else 'actor gone'})")
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    self._fail(f"{what}: {self._where(index[r])} failed: {type(cause).__name__}: "
                               f"{str(cause).splitlines()[0] if str(cause) else ''}")
                except GetTimeoutError:  # not ready after all: keep waiting on it
                    pending.append(r)
        return ray.get(refs, timeout=max(deadline - time.monotonic(), 1.0))

    def _fail(self, reason: str) -> None:
        self.error = f"{reason}. {RECOVER}"
        log.error("ray executor: %s", self.error)
        raise ExecutorError(self.error)

    def is_healthy(self) -> bool:
        return self.error is None and (bool(self.workers) or self.world_size <= self.first_actor_rank)

    # ---- shutdown -----------------------------------------------------------------------------------------

    def shutdown(self, close_timeout_s: float = 10.0) -> None:
        """Let the rank actors release their process groups (:meth:`RankWorker.close`, at most
        ``close_timeout_s``; skipped once a rank failed), then kill them, free the placement group, disconnect from
        Ray if this executor connected.

        Why the close first: each rank destroys its own NCCL communicators (``parallel.groups.destroy_parallel``,
        which first releases the rank's captured CUDA graphs: a live graph holding NCCL collectives makes
        ``ncclCommDestroy`` wait forever) before it is killed. Session 14 saw rank 0 hang in
        ``destroy_process_group`` after graph decode; session 15 traced it to the live graphs and, with the release,
        the Ray test at TP 2 shut down cleanly on an H200 x 2 (scripts/bench_results/nccl_h200x4_session15.txt)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self.workers and not self.error:
            refs = [w.close.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=close_timeout_s)
        for w in self.workers + ([self._holder] if self._holder is not None else []):
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.workers, self._holder = [], None
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


class GroupCheckWorker:
    """A minimal rank body: proves the process groups span the nodes before any weight is read (also what the
    executor's tests drive). ``stall`` blocks on purpose, to exercise the executor's timeouts."""

    def __init__(self, rank: int, local_rank: int, device_index: int | None, state: Any, device: str = "cpu") -> None:
        import torch

        self.rank, self.local_rank, self.device_index, self.state = rank, local_rank, device_index, state
        self.device = torch.device(device, device_index) if device != "cpu" and device_index is not None \
            else torch.device("cpu")

    def where(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "device_index": self.device_index,
                "pid": os.getpid(), "env": {k: os.environ.get(k) for k in ("HCCL_IF_IP", "MASTER_ADDR", "RANK",
                                                                             "LOCAL_RANK", "HCCL_BUFFSIZE")}}

    def all_reduce_ranks(self) -> dict[str, float]:
        """Sum of the ranks over the world, TP and EP groups (world: W(W-1)/2)."""
        import torch

        from parallel import comm

        out = {}
        for name in ("world", "tp", "ep"):
            g = getattr(self.state, name)
            x = torch.tensor([float(g.rank)], device=self.device)
            out[name] = float(comm.all_reduce(x, g).item()) if g.size > 1 else 0.0
        return out

    def stall(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        """Called by :meth:`RankWorker.close` before the actor is killed; with ``ASCEND_DSV4_CLOSE_MARK`` set (a
        folder; tests) it leaves a file ``rank<r>`` there to show that the executor's shutdown let it run."""
        mark = os.environ.get("ASCEND_DSV4_CLOSE_MARK")
        if mark:
            with open(os.path.join(mark, f"rank{self.rank}"), "w") as f:
                f.write(str(os.getpid()))
