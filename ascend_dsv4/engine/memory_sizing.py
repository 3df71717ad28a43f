"""``gpu_memory_utilization``: size the KV pools from the device memory this instance may use (vLLM's flag).

``requested = gpu_memory_utilization * total device memory`` is the most this instance may hold (weights, KV,
activations). After the weights have loaded, ``in_use = total - free`` (this process's weights and whatever
else holds the device) is subtracted, and so is an activation reserve (``ACTIVATION_RESERVE`` of the total: the
step's activations and logits are not profiled yet); what is left is the KV budget. The three page counts of the
default sizing (:func:`~.model_runner.plan_pool_sizes`) are scaled by one factor so that the pools' bytes fill
the budget (pool bytes are linear in the page counts; they are measured by building the pools on the ``meta``
device, so no memory is touched).

CPU has no such budget: the flag is validated and ignored there (the pools keep their default sizing).

Under tensor / expert / data parallelism every rank sizes its pools from its own device after loading its share
(:func:`~.rank_worker.build_rank_runner`), then the ranks agree on the smallest page counts
(:func:`agree_on_sizes`, an all-reduce MIN over the world group): the engine's allocator decides slots for all
ranks, so their pools must have the same sizes (vLLM likewise takes the minimum of its workers' KV blocks).
"""

from __future__ import annotations

import dataclasses
import gc
import logging

import torch

from ..errors import ConfigError

log = logging.getLogger("ascend_dsv4")

__all__ = ["ACTIVATION_RESERVE", "agree_on_sizes", "check_utilization", "device_memory", "pool_bytes",
           "size_pools_for_memory", "sized_for_memory"]

ACTIVATION_RESERVE = 0.05


def check_utilization(util) -> float:
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
    return float(util)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of ``device`` from its torch device module (``torch.cuda`` / ``torch.npu``), after
    unreferenced tensors are collected and the allocator's cache is returned, or None for a device without one
    (CPU)."""
    mod = getattr(torch, device.type, None)
    fn = getattr(mod, "mem_get_info", None)
    if device.type == "cpu" or fn is None:
        return None
    # memory this process freed but its caching allocator still holds (an earlier engine of the process, say)
    # counts as in use for the driver: collect and return it first, as vLLM does before it profiles
    gc.collect()
    if hasattr(mod, "empty_cache"):
        mod.empty_cache()
    free, total = fn(device)
    return int(free), int(total)


def pool_bytes(model, sizes, dtype: torch.dtype) -> int:
    """Bytes of the KV pools ``model.make_pools(sizes, dtype, ...)`` would allocate (built on ``meta``)."""
    pools = model.make_pools(sizes, dtype, torch.device("meta"))
    return sum(t.numel() * t.element_size() for t in vars(pools).values() if isinstance(t, torch.Tensor))


def size_pools_for_memory(model, base, dtype: torch.dtype, util: float, free: int, total: int):
    """``base`` (a PoolSizes) with its page counts scaled to the KV budget described in the module docstring.

    Raises ConfigError naming the numbers when the budget leaves no room for KV."""
    util = check_utilization(util)
    requested = int(util * total)
    in_use = total - free
    reserve = int(ACTIVATION_RESERVE * total)
    budget = requested - in_use - reserve
    gib = 2**30
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization {util:g} allows {requested / gib:.2f} GiB of the device's {total / gib:.2f} GiB, "
            f"but {in_use / gib:.2f} GiB are in use already (the weights and other processes) and "
            f"{reserve / gib:.2f} GiB are kept for activations: no room for the KV cache; raise it")
    per = pool_bytes(model, base, dtype)
    f = budget / per
    out = dataclasses.replace(base, num_blocks=max(1, int(base.num_blocks * f)),
                              num_c4_blocks=max(1, int(base.num_c4_blocks * f)),
                              num_c128_blocks=max(1, int(base.num_c128_blocks * f)))
    log.info("KV pools sized for gpu_memory_utilization %g: %.2f GiB budget (%.2f GiB requested, %.2f GiB in use, "
             "%.2f GiB activation reserve): %d token / %d c4 / %d c128 pages", util, budget / gib, requested / gib,
             in_use / gib, reserve / gib, out.num_blocks, out.num_c4_blocks, out.num_c128_blocks)
    return out


def sized_for_memory(model, base, dtype: torch.dtype, util: float, device: torch.device, max_num_seqs: int,
                     max_model_len: int):
    """``base`` sized for ``util`` of ``device``'s memory (cuda / npu); ``base`` itself on a device without a
    memory budget (CPU), with a note."""
    util = check_utilization(util)
    mem = device_memory(device)
    if mem is None:
        log.info("gpu_memory_utilization is ignored on %s: the KV pools hold max_num_seqs (%d) sequences of "
                 "max_model_len (%d)", device, max_num_seqs, max_model_len)
        return base
    return size_pools_for_memory(model, base, dtype, util, *mem)


def agree_on_sizes(sizes, device: torch.device):
    """``sizes`` with each page count replaced by its minimum over the ranks of the default process group (an
    all-reduce MIN of three int32 on ``device``, the rank's communication device: gloo, NCCL and HCCL all reduce
    int32 with min, while CANN's HcclAllReduce reference lists int64 for training / A2 / A3 products only, not the
    300I Duo: hiascend.com .../apiref/hcclapiref/hcclcpp_07_0021.html); ``sizes`` itself at world size 1 or
    without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sizes
    t = torch.tensor([sizes.num_blocks, sizes.num_c4_blocks, sizes.num_c128_blocks], dtype=torch.int32,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    n, c4, c128 = (int(v) for v in t.tolist())
    if (n, c4, c128) != (sizes.num_blocks, sizes.num_c4_blocks, sizes.num_c128_blocks):
        log.info("KV pools: rank %d takes the smallest page counts of all ranks: %d token / %d c4 / %d c128 pages",
                 dist.get_rank(), n, c4, c128)
    return dataclasses.replace(sizes, num_blocks=n, num_c4_blocks=c4, num_c128_blocks=c128)
