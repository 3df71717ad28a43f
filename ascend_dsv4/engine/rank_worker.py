"""One rank of a tensor-/expert-parallel model: build its share, serve the calls the engine mirrors to it.

:func:`build_rank_runner` builds a rank's model (checkpoint folder: only this rank's slices are read; preset: the
whole random model is drawn then sliced, which is fine for toy presets only) and its runner with pools of the
engine's sizes. :func:`worker_main` is the body of a worker process (ranks 1..N-1 of the ``mp`` executor): join
the process groups, load, report ready, then run each mirrored call until told to stop or until the engine's
end of the pipe closes. A call that raises reports its traceback and ends the process, so that the other
ranks' collectives fail at once instead of waiting for the timeout.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback

import torch

from .executor import RankSpec, apply_call


def rank_device(spec: RankSpec, rank: int) -> torch.device:
    return torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type, rank)


def build_rank_runner(spec: RankSpec, parallel, device: torch.device):
    """(model, runner) of this rank."""
    import atb_ops

    from ..models import build_model
    from .model_runner import ModelRunner

    ops = atb_ops.use_backend(spec.backend) if spec.backend else contextlib.nullcontext()
    folder = spec.model if os.path.isdir(spec.model) else None
    with ops:
        if folder is None:
            from ..weights.random_init import init_random_
            from ..weights.tp_shards import copy_rank_slices

            full = init_random_(build_model(spec.cfg, spec.dtype, spec.numerics), spec.seed)
            net = copy_rank_slices(full, build_model(spec.cfg, spec.dtype, spec.numerics, parallel))
            del full
        else:
            from ..weights.loader import load_weights
            from ..weights.msmodelslim_loader import is_msmodelslim_folder, load_msmodelslim

            with torch.device("meta"):
                net = build_model(spec.cfg, spec.dtype, spec.numerics, parallel)
            npu = spec.backend == "npu" or (spec.backend is None and device.type == "npu")
            if is_msmodelslim_folder(folder):  # split on the rank (weights/msmodelslim_tp.py)
                load_msmodelslim(net, folder, spec.msmodelslim_path, spec.allow_float_mtp, spec.msmodelslim_act_sim,
                                 check_weights=spec.check_weights, npu=npu)
            else:
                plan = load_weights(net, folder, device, dequantize=spec.dequantize or npu, progress=False,
                                    check_weights=spec.check_weights)
                net.bytes_read = plan.bytes_read
        net = net.to(device).eval()
    sizes = spec.pool_sizes
    if spec.gpu_memory_utilization is not None:  # after the weights landed: what is left of this rank's device
        from .memory_sizing import agree_on_sizes, device_memory, size_pools_for_memory

        mem = device_memory(device)  # None on CPU: the flag is ignored there (LLM says so once)
        if mem is not None:
            sizes = size_pools_for_memory(net, sizes, spec.dtype, spec.gpu_memory_utilization, *mem)
        sizes = agree_on_sizes(sizes, device)
    return net, ModelRunner(net, sizes, device, backend=spec.backend, cuda_graphs=spec.cuda_graphs,
                            max_graph_batch=spec.max_graph_batch)


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))


def worker_main(rank: int, spec: RankSpec, port: int, conn) -> None:
    """Process body of rank ``rank`` (>= 1)."""
    os.environ.update(spec.env)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    import atb_ops

    from parallel.groups import destroy_parallel, init_parallel, rendezvous_store, set_rank_device

    try:
        device = rank_device(spec, rank)
        set_rank_device(device)
        store = rendezvous_store("127.0.0.1", port, spec.tensor_parallel_size, rank, spec.timeout_s)
        state = init_parallel(spec.tensor_parallel_size, rank, "", device=spec.device_type,
                              enable_expert_parallel=spec.enable_expert_parallel, backend=spec.comm_backend,
                              timeout_s=spec.timeout_s, store=store)
        model, runner = build_rank_runner(spec, state, device)
        _send(conn, ("ready", {"pid": os.getpid(), "bytes_read": getattr(model, "bytes_read", None),
                               "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
    except BaseException:  # noqa: BLE001 - reported to the engine
        _send(conn, ("err", traceback.format_exc()))
        os._exit(1)
    def ops():  # a fresh context per call: use_backend's context manager can be entered only once
        return atb_ops.use_backend(spec.backend) if spec.backend else contextlib.nullcontext()

    while True:
        try:
            op, method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            break
        if op == "stop":
            break
        try:
            with torch.inference_mode(), ops():
                apply_call(method, args, model, runner, device)
            _send(conn, ("ok", None))
        except BaseException:  # noqa: BLE001
            _send(conn, ("err", traceback.format_exc()))
            os._exit(1)
    try:
        destroy_parallel()
    finally:
        os._exit(0)
