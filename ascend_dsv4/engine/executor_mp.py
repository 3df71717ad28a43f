"""The ``mp`` executor: one worker process per rank on this node (ranks 1..N-1; rank 0 is the engine's process).

Start-up: the workers are spawned, every rank joins the process groups over a localhost rendezvous and loads its
share; the executor waits (bounded) for each worker's "ready". A step: the engine's call on rank 0's model is
sent to every worker first (pickled over a pipe: the step context without pools, token ids, row indices), then
run on rank 0; collectives inside the model meet across the ranks; rank 0 then waits (bounded) for each worker's
acknowledgement. Failure: a worker that raises reports its traceback and exits, one that dies closes its
sockets; either way rank 0's collective or acknowledgement fails and the call raises :class:`ExecutorError`
naming the rank (the engine fails the requests in flight); the executor is then dead and later calls raise at
once. :meth:`MPExecutor.shutdown` (also at interpreter exit) stops and reaps every worker.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import time
import weakref

import torch

from .executor import MIRRORED_METHODS, ExecutorError, RankSpec, kill_processes, mirror_runner, sanitize
from .rank_worker import build_rank_runner, rank_device, worker_main

log = logging.getLogger("ascend_dsv4")


class _MirroredModel:
    """Rank 0's model as the engine sees it: the mirrored methods run on every rank; the rest is rank 0's."""

    def __init__(self, model: torch.nn.Module, executor: "MPExecutor"):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_executor", executor)

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name in MIRRORED_METHODS:
            return lambda *args: self._executor.run(name, attr, args)
        return attr

    def __call__(self, *args):
        return self._executor.run("forward", self._model, args)


class MPExecutor:
    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.world = spec.tensor_parallel_size
        self.procs: list = []
        self.conns: list = []
        self.runner = None
        self.dead: str | None = None
        self.ready_info: list[dict] = []
        self._closed = False

    # ---- start-up -------------------------------------------------------------------------------------
    def start(self) -> "MPExecutor":
        from parallel.groups import init_parallel, rendezvous_store, set_rank_device

        spec = self.spec
        ctx = mp.get_context("spawn")
        # port 0: the store binds a free port itself (a port probed free, closed, then bound can be taken between)
        store = rendezvous_store("127.0.0.1", 0, self.world, 0, spec.timeout_s)
        port = store.port
        for r in range(1, self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, spec, port, child), daemon=True, name=f"ascend-dsv4-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            device = rank_device(spec, 0)
            set_rank_device(device)
            self._await_workers(store, spec.timeout_s)
            state = init_parallel(self.world, 0, "", device=spec.device_type,
                                  enable_expert_parallel=spec.enable_expert_parallel, backend=spec.comm_backend,
                                  timeout_s=spec.timeout_s, store=store)
            model, runner = build_rank_runner(spec, state, device)
            self.ready_info = [{"pid": os.getpid(), "bytes_read": getattr(model, "bytes_read", None),
                                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}]
            for r in range(1, self.world):
                self.ready_info.append(self._reply(r, "start-up", spec.timeout_s))
        except BaseException as e:
            err = e if isinstance(e, ExecutorError) else self._failure("start-up", e)
            self.shutdown()
            raise err from e
        runner.model = _MirroredModel(model, self)
        mirror_runner(runner, self.run)
        self.runner = runner
        log.info("mp executor: %d ranks ready (backend %s)", self.world, state.backend)
        return self

    def _await_workers(self, store, timeout: float) -> None:
        """Wait until every worker announced itself on the store; fail at once if one dies first."""
        deadline = time.monotonic() + timeout
        waiting = set(range(1, self.world))
        while waiting:
            for r in list(waiting):
                if store.check([f"alive/{r}"]):
                    waiting.discard(r)
                elif not self.procs[r - 1].is_alive():
                    raise self._failure("start-up", RuntimeError("worker exited before joining"))
            if waiting and time.monotonic() > deadline:
                raise ExecutorError(f"worker rank(s) {sorted(waiting)} did not start within {timeout:.0f} s")
            time.sleep(0.05)

    # ---- steps ----------------------------------------------------------------------------------------
    def run(self, method: str, fn, args: tuple):
        """Send ``method(*args)`` to every worker, run ``fn(*args)`` here (rank 0), wait for the workers."""
        self.check_health()
        msg = pickle.dumps(("call", method, sanitize(args)))
        try:
            for c in self.conns:
                c.send_bytes(msg)
        except (BrokenPipeError, OSError) as e:
            raise self._die(self._failure(method, e))
        try:
            with torch.inference_mode():
                out = fn(*args)
        except Exception as e:  # noqa: BLE001 - a failing peer surfaces as a comm error here
            raise self._die(self._failure(method, e)) from e
        for r in range(1, self.world):
            self._reply(r, method, self.spec.timeout_s)
        return out

    def _reply(self, rank: int, what: str, timeout: float) -> dict:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.05):
            if not proc.is_alive() and not conn.poll(0):
                raise self._die(ExecutorError(f"worker rank {rank} died (exit code {proc.exitcode}) during {what}"))
            if time.monotonic() > deadline:
                raise self._die(ExecutorError(f"worker rank {rank} did not answer within {timeout:.0f} s during "
                                              f"{what}"))
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise self._die(ExecutorError(f"worker rank {rank} closed its pipe during {what} (exit code "
                                          f"{proc.exitcode})"))
        if kind == "err":
            last = payload.strip().splitlines()[-1] if payload.strip() else "?"
            log.error("worker rank %d failed during %s:\n%s", rank, what, payload)
            raise self._die(ExecutorError(f"worker rank {rank} failed during {what}: {last}"))
        return payload if isinstance(payload, dict) else {}

    def _failure(self, what: str, exc: BaseException) -> ExecutorError:
        """The clearest account of a failure seen on rank 0: a worker's own report if one came."""
        time.sleep(0.2)
        for r in range(1, self.world):
            conn, proc = self.conns[r - 1], self.procs[r - 1]
            try:
                if conn.poll(0.5):
                    kind, payload = pickle.loads(conn.recv_bytes())
                    if kind == "err":
                        last = payload.strip().splitlines()[-1]
                        log.error("worker rank %d failed during %s:\n%s", r, what, payload)
                        return ExecutorError(f"worker rank {r} failed during {what}: {last}")
            except (EOFError, OSError):
                pass
            if not proc.is_alive():
                return ExecutorError(f"worker rank {r} died (exit code {proc.exitcode}) during {what}")
        return ExecutorError(f"rank 0 failed during {what}: {exc}")

    def _die(self, err: ExecutorError) -> ExecutorError:
        self.dead = str(err)
        self._kill()
        return err

    def check_health(self) -> None:
        if self.dead:
            raise ExecutorError(f"the mp executor is down ({self.dead}); restart the engine")
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                raise self._die(ExecutorError(f"worker rank {r} died (exit code {p.exitcode})"))

    # ---- shutdown -------------------------------------------------------------------------------------
    def _kill(self) -> None:
        kill_processes(self.procs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        from .cuda_graphs import release_all

        release_all()  # rank 0's graphs first: the ranks' NCCL teardown must not meet a live captured graph
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(("stop", None, None)))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self._kill()
        for c in self.conns:
            c.close()
        from parallel.groups import destroy_parallel

        destroy_parallel()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]
