"""Data-parallel attention on the Ray executor: the design of :mod:`ascend_dsv4.engine.executor_dp` with every rank
a Ray actor (:class:`DPEngineRank`, placed by :class:`~ascend_dsv4.engine.ray_executor.RayExecutor`: one bundle
per rank, packed per node, ranks ordered by node, groups of ``parallel/dp_groups.py`` over
``tcp://<rank 0's node>:<port>``). The front end (this process) holds no rank: one engine per replica on a
:class:`~ascend_dsv4.engine.executor_dp.ReplicaRunner`, each replica's calls submitted to its actors and awaited
(bounded by ``ASCEND_DSV4_MP_TIMEOUT``). A rank that raises or dies ends the call with an
:class:`ExecutorError` naming it and its node; the executor then stays down (``check_health`` raises).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
import weakref

import torch

from .dp_worker import DPRankState, apply_dp_call, graph_trash
from .executor import ExecutorError, RankSpec, sanitize
from .executor_dp import ReplicaRunner, replica_runners
from .executor_ray import start_timeout_s
from .ray_executor import RayExecutor

log = logging.getLogger("ascend_dsv4")


class DPEngineRank:
    """One rank inside its Ray actor: its share of the model and its pools; the calls of ``dp_worker``."""

    def __init__(self, rank: int, local_rank: int, device_index: int | None, state, spec: RankSpec) -> None:
        import atb_ops

        from .rank_worker import build_rank_runner

        os.environ.update({k: v for k, v in spec.env.items() if k != "HCCL_IF_IP"})
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type,
                                                                                          device_index or 0)
        self.leader = state.tp.rank == 0
        self.replica = state.dp_rank
        self.model, self.runner = build_rank_runner(spec, state, self.device)
        self._ops = (lambda: atb_ops.use_backend(spec.backend)) if spec.backend else contextlib.nullcontext
        self._kept = DPRankState()

    def info(self) -> dict:
        return {"pid": os.getpid(), "replica": self.replica, "pool_sizes": self.runner.pools.sizes,
                "graph_trash": graph_trash(self.runner),
                "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def call(self, op: str, args):
        """One call of the data-parallel protocol (``dp_worker``'s docstring, :func:`~.dp_worker.apply_dp_call`)."""
        with torch.inference_mode(), self._ops():
            return apply_dp_call(op, args, self.model, self.runner, self.device, self.leader, self._kept)


class RayDPExecutor:
    """``start()`` / ``runners`` / ``call(replica, op, args)`` / ``check_health()`` / ``shutdown()`` as
    :class:`~ascend_dsv4.engine.executor_dp.DPExecutor`, ranks on Ray."""

    def __init__(self, spec: RankSpec, address: str | None = None) -> None:
        self.spec = spec
        self.dp, self.tp = spec.data_parallel_size, spec.tensor_parallel_size
        self.world = self.dp * self.tp
        self.runners: list[ReplicaRunner] = []
        self.ready_info: list[dict] = []
        self._closed = False
        self.ray = RayExecutor(self.world, "ascend_dsv4.engine.executor_dp_ray.DPEngineRank", {"spec": spec},
                               device=spec.device_type, address=address, enable_expert_parallel=True,
                               backend=spec.comm_backend, start_timeout_s=start_timeout_s(spec),
                               call_timeout_s=spec.timeout_s, data_parallel_size=self.dp)

    @property
    def dead(self) -> str | None:
        return self.ray.error

    def start(self) -> "RayDPExecutor":
        from ..models import build_model

        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            self.ray.start()
            self.ready_info = self.ray.collective_rpc("info")
        except BaseException:
            self.shutdown()
            raise
        with torch.device("meta"):
            meta = build_model(self.spec.cfg, self.spec.dtype, self.spec.numerics)
        sizes = self.ready_info[0].get("pool_sizes", self.spec.pool_sizes)  # as the ranks agreed (memory_sizing.py)
        self.runners = replica_runners(self, meta, sizes)
        log.info("ray dp executor: %d replicas x %d ranks on %d node(s)", self.dp, self.tp,
                 len({s.node_id for s in self.ray.slots}))
        return self

    def call(self, replica: int, op: str, args):
        """``op(args)`` on every rank of ``replica`` (bounded); returns the replica rank 0's answer."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.check_health()
        ranks = list(range(replica * self.tp, (replica + 1) * self.tp))
        payload = sanitize(args)
        refs = [self.ray.workers[r].execute.remote("call", (op, payload), {}) for r in ranks]
        deadline = time.monotonic() + self.spec.timeout_s
        pending = refs
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            if pending and self.ray.error:  # another replica's rank failed: this one's collectives cannot finish
                raise ExecutorError(f"the ray executor is down: {self.ray.error}")
        out = []
        for r, ref in zip(ranks, refs):
            where = f"rank {r} (replica {replica}, node {self.ray.slots[r].ip})"
            if ref in pending:
                self.ray._fail(f"{op}: {where} did not answer within {self.spec.timeout_s:g} s")
            try:
                out.append(ray.get(ref, timeout=0))
            except RayActorError as e:
                self.ray._fail(f"{op}: {where} died ({type(e).__name__})")
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                self.ray._fail(f"{op}: {where} failed: {type(cause).__name__}: "
                               f"{str(cause).splitlines()[0] if str(cause) else ''}")
        return out[0]

    def check_health(self) -> None:
        if self.ray.error:
            raise ExecutorError(f"the ray executor is down: {self.ray.error}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.ray.shutdown()
