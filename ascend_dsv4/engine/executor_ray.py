"""The ``ray`` executor: the ``mp`` executor's interface (:mod:`ascend_dsv4.engine.executor`) over a Ray cluster.

Rank 0 runs in the engine's process, as with ``mp``; ranks 1..N-1 are Ray actors (:class:`EngineRank`) placed by
:class:`~ascend_dsv4.engine.ray_executor.RayExecutor`: one bundle per rank (``NPU`` / ``GPU`` / ``CPU``), packed
per node, rank 0's bundle pinned to this node and held so that Ray reserves its device, ranks ordered by node,
the launch environment propagated, process groups over ``tcp://<this node>:<free port>``. A step: the engine's
call on rank 0's model is submitted to every actor (the step context without pools, token ids), then run here;
collectives inside the model meet across the nodes; then the actors' acknowledgements are awaited (bounded).
Failure: a rank that raises or dies ends the call at once with an :class:`ExecutorError` naming the rank and its
node (the engine fails the requests in flight, the server's ``/health`` turns 503 and says how to recover); the
executor stays down; :meth:`RayEngineExecutor.shutdown` kills the actors and frees the placement group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref

import torch

from .executor import ExecutorError, RankSpec, apply_call, mirror_runner, sanitize
from .executor_mp import _MirroredModel
from .ray_executor import RayExecutor

log = logging.getLogger("ascend_dsv4")


def start_timeout_s(spec: RankSpec) -> float:
    """Bound on placement + every remote rank's load: ``$ASCEND_DSV4_RAY_START_TIMEOUT`` seconds, default the
    larger of 1800 s (nodes read hundreds of GB of weights) and the per-call timeout."""
    return float(os.environ.get("ASCEND_DSV4_RAY_START_TIMEOUT", max(1800.0, spec.timeout_s)))


class EngineRank:
    """Rank r >= 1 inside its Ray actor: its share of the model and its pools; runs the mirrored calls."""

    def __init__(self, rank: int, local_rank: int, device_index: int | None, state, spec: RankSpec) -> None:
        import atb_ops

        from .rank_worker import build_rank_runner

        # the driver's HCCL_IF_IP is the head node's address: this node keeps its own
        os.environ.update({k: v for k, v in spec.env.items() if k != "HCCL_IF_IP"})
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.spec = spec
        self.device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type,
                                                                                          device_index or 0)
        self.model, self.runner = build_rank_runner(spec, state, self.device)
        self._ops = (lambda: atb_ops.use_backend(spec.backend)) if spec.backend else contextlib.nullcontext

    def info(self) -> dict:
        return {"pid": os.getpid(), "bytes_read": getattr(self.model, "bytes_read", None),
                "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def call(self, method: str, args: tuple) -> None:
        with torch.inference_mode(), self._ops():
            apply_call(method, args, self.model, self.runner, self.device)


class RayEngineExecutor:
    """``start()`` / ``runner`` / ``check_health()`` / ``shutdown()`` as :class:`MPExecutor`, ranks on Ray."""

    def __init__(self, spec: RankSpec, address: str | None = None) -> None:
        self.spec = spec
        self.world = spec.tensor_parallel_size
        self.runner = None
        self.ready_info: list[dict] = []
        self._model = self._runner0 = None
        self._closed = False
        self.ray = RayExecutor(self.world, "ascend_dsv4.engine.executor_ray.EngineRank", {"spec": spec},
                               device=spec.device_type, address=address,
                               enable_expert_parallel=spec.enable_expert_parallel, backend=spec.comm_backend,
                               start_timeout_s=start_timeout_s(spec), call_timeout_s=spec.timeout_s,
                               local_rank0=self._start_rank0)

    def _start_rank0(self, master: tuple[str, int], device_index: int | None) -> None:
        from parallel.groups import init_parallel, set_rank_device

        from .rank_worker import build_rank_runner

        spec = self.spec
        device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type,
                                                                                     device_index or 0)
        set_rank_device(device)
        state = init_parallel(self.world, 0, f"tcp://{master[0]}:{master[1]}", device=spec.device_type,
                              enable_expert_parallel=spec.enable_expert_parallel, backend=spec.comm_backend,
                              timeout_s=spec.timeout_s)
        self._model, self._runner0 = build_rank_runner(spec, state, device)

    def start(self) -> RayEngineExecutor:
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            self.ray.start()
            self.ready_info = [{"pid": os.getpid(), "bytes_read": getattr(self._model, "bytes_read", None)}]
            self.ready_info += self.ray.collective_rpc("info")
        except BaseException:
            self.shutdown()
            raise
        runner = self._runner0
        runner.model = _MirroredModel(self._model, self)
        mirror_runner(runner, self.run)
        self.runner = runner
        log.info("ray executor: %d ranks ready on %d node(s)", self.world, len({s.node_id for s in self.ray.slots}))
        return self

    def run(self, method: str, fn, args: tuple):
        """Submit ``method(*args)`` to every actor rank, run ``fn(*args)`` here (rank 0), await the actors."""
        self.check_health()
        refs = self.ray.submit("call", method, sanitize(args))
        try:
            with torch.inference_mode():
                out = fn(*args)
        except Exception as e:  # noqa: BLE001 - a failing peer surfaces as a comm error here
            self.ray.first_failure(refs, method, e)
        self.ray.wait(refs, method)
        return out

    def check_health(self) -> None:
        if self.ray.error:
            raise ExecutorError(f"the ray executor is down: {self.ray.error}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        from .cuda_graphs import release_all

        release_all()  # rank 0's graphs first: the ranks' NCCL teardown must not meet a live captured graph
        self.ray.shutdown()
        from parallel.groups import destroy_parallel

        destroy_parallel()
