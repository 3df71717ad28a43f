"""Executors: where the ranks of a model run. The interface a Ray executor implements too.

An executor owns the worker processes of ranks 1..N-1 (rank 0 is the engine's own process) and exposes rank 0's
:class:`~ascend_dsv4.engine.model_runner.ModelRunner` to the engine. Every model call the engine makes on that
runner (``model(ids, ctx)``, ``model.logits``, ``model.mtp_logits``, ``model.mtp_forward``) and every pool
write outside the model (``pools.copy_page`` of the prefix cache) is first sent to all other ranks, which run
the same call on their own share of the model and their own pools (same sizes, same slots: the engine's
allocator decides for all ranks), then run on rank 0; collectives inside the model meet across ranks. Step
inputs are the token ids and the step context (positions, slots, tables) minus the pools; results (logits) come
from rank 0 only.

Contract of an executor (``executor_mp.MPExecutor``; a Ray executor implements the same):

- ``Executor(spec: RankSpec).start() -> self``: start ranks 1..N-1 somewhere (each runs
  ``rank_worker.build_rank_runner(spec, parallel_state, device)`` after joining the process groups, then serves
  calls), build rank 0 here, wait (bounded) until every rank reported ready; raise :class:`ExecutorError` (after
  stopping what started) otherwise; a bad layout raises ``ConfigError`` before (``LLM`` validates it);
- ``runner``: rank 0's runner whose ``model`` methods in :data:`MIRRORED_METHODS`, runner methods in
  :data:`MIRRORED_RUNNER_METHODS` (graph decode steps, MTP drafts, greedy steps launched ahead) and ``pools.copy_page`` run on every rank (the engine uses
  nothing else); :func:`mirror_runner` wires the last two;
- ``run(method, fn, args)``: one mirrored call: send ``(method, sanitize(args))`` to every other rank, run
  ``fn(*args)`` here, wait for every rank's acknowledgement; returns rank 0's result;
- ``check_health()``: raise :class:`ExecutorError` when a rank is gone;
- ``shutdown()``: stop and reap every rank (idempotent; also at interpreter exit).

A worker applies a call with :func:`apply_call`: ``restore(args, its_pools, its_device)`` then ``model(*args)``
(``forward``), ``getattr(model, method)(*args)``, ``getattr(runner, method)(*args)`` or ``pools.copy_page(*args)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AscendDSV4Error

MIRRORED_METHODS = ("forward", "logits", "mtp_logits", "mtp_forward")
# runner methods mirrored the same way: a graph-captured decode step (pages allocated by rank 0 first), an MTP draft's,
# a greedy step launched ahead (async scheduling: each rank feeds its own argmax of the step before)
MIRRORED_RUNNER_METHODS = ("replay_decode", "replay_draft", "replay_greedy")


class ExecutorError(AscendDSV4Error, RuntimeError):
    """A worker rank died, raised or timed out; the requests in flight fail with this message."""


@dataclass
class RankSpec:
    """Everything a rank needs to build its share of the model and its pools (picklable)."""

    model: str
    cfg: Any
    dtype: torch.dtype
    numerics: str
    device_type: str
    seed: int
    pool_sizes: Any
    tensor_parallel_size: int
    enable_expert_parallel: bool = False
    backend: str | None = None  # atb_ops backend override
    comm_backend: str | None = None  # torch.distributed backend override (default by device)
    dequantize: bool = False
    msmodelslim_path: str = "int"
    allow_float_mtp: bool = False
    msmodelslim_act_sim: str | None = None
    check_weights: bool = True  # NaN / Inf check of every tensor as it lands (weights/weight_check.py)
    # each rank sizes its KV pools from this fraction of its device's memory, then all agree on the minimum
    # (engine/memory_sizing.py); None: pool_sizes as given
    gpu_memory_utilization: float | None = None
    # graph-captured decode on every rank (ModelRunner's cuda_graphs: True, or "static" for the uncaptured
    # static-buffer path off CUDA in tests); the graph steps are mirrored with replay_decode
    cuda_graphs: bool | str = False
    max_graph_batch: int = 256
    timeout_s: float = 300.0
    data_parallel_size: int = 1  # attention replicas (executor_dp.py); ranks = data x tensor parallel size
    env: dict = field(default_factory=dict)


def kill_processes(procs, join_s: float = 5.0) -> None:
    """Kill every live worker process, then reap each (bounded wait): what a dead or shut-down executor leaves."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(join_s)


def strip_context(ctx) -> Any:
    """The step context without its pools (each rank has its own), for sending to other ranks."""
    import copy

    out = copy.copy(ctx)
    out.pools = None
    return out


def sanitize(obj):
    """Arguments of a mirrored call as sent to the other ranks: contexts without pools, tensors on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if hasattr(obj, "pools") and hasattr(obj, "positions"):
        return strip_context(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(sanitize(o) for o in obj)
    return obj


def restore(obj, pools, device):
    """Inverse of :func:`sanitize` on a worker: its own pools, tensors on its device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if hasattr(obj, "pools") and hasattr(obj, "positions"):
        obj.pools = pools
        for k, v in vars(obj).items():
            if isinstance(v, torch.Tensor):
                setattr(obj, k, v.to(device))
            elif isinstance(v, dict):  # V4 compress contexts
                for c in v.values():
                    for ck, cv in vars(c).items():
                        if isinstance(cv, torch.Tensor):
                            setattr(c, ck, cv.to(device))
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(restore(o, pools, device) for o in obj)
    return obj


def mirror_runner(runner, run) -> None:
    """Make rank 0's ``runner`` send its graph decode steps and page copies to every rank through ``run(method, fn,
    args)`` (the executor's mirrored call)."""
    runner.mirrored = True
    copy_page = runner.pools.copy_page
    runner.pools.copy_page = lambda *a: run("copy_page", copy_page, a)
    for name in MIRRORED_RUNNER_METHODS:
        fn = getattr(runner, name)
        setattr(runner, name, (lambda n, f: lambda *a: run(n, f, a))(name, fn))


def apply_call(method: str, args, model, runner, device) -> None:
    """Run one mirrored call on a worker rank (its own model share, pools and device)."""
    if method == "copy_page":
        runner.pools.copy_page(*args)
        return
    args = restore(args, runner.pools, device)
    if method in MIRRORED_RUNNER_METHODS:
        getattr(runner, method)(*args)
        return
    fn = model if method == "forward" else getattr(model, method)
    fn(*args)
