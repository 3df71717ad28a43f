"""Independent work of a layer on a second stream of the device (the MoE's router beside its shared expert).

A decode step's router is a chain of small, latency-bound launches (the logits' split-K GEMM, their sum, the
top-k selection) that leave most of the GPU idle, and the shared expert does not depend on it: run on a side
stream, the two overlap (vllm-ascend's ``multistream_overlap_shared_expert`` does the same on Ascend). The pattern
is fork / work / join: the side stream first waits for everything already queued on the current stream, the side
work is queued on it, and the current stream waits for the side stream before the results are used. Stream
capture (CUDA graphs) records that as two branches of the graph.

Memory: tensors the side work allocates come from the side stream's pool and are used by the current stream only
after the join; they return to the side stream's pool when freed, and the next side work starts only after the
next fork, behind everything the current stream had queued (including those uses): no reuse while in use.

Numerics never change (the same kernels on the same inputs). ``ASCEND_DSV4_OVERLAP``: ``auto`` (default) overlaps
on CUDA devices only, ``1`` on any device whose torch module has streams (an NPU too: not run on one, no NPU is
available to this project), ``0`` never; without overlap :func:`fork` returns None and the work runs in order on the
current stream.
"""

from __future__ import annotations

import contextlib
import os

import torch

_STREAMS: dict[torch.device, object] = {}


def enabled(device: torch.device) -> bool:
    """Whether work on ``device`` overlaps (``ASCEND_DSV4_OVERLAP``: auto = CUDA only, 1 = any device, 0 = none)."""
    v = os.environ.get("ASCEND_DSV4_OVERLAP", "auto")
    if v not in ("auto", "0", "1"):
        raise ValueError(f"ASCEND_DSV4_OVERLAP={v!r}: expected auto, 0 or 1")
    return v == "1" or (v == "auto" and device.type == "cuda")


def _device_module(device: torch.device):
    """torch.cuda / torch.npu (any device module with Stream, current_stream and stream), or None."""
    if device.type == "cpu":
        return None
    mod = getattr(torch, device.type, None)
    return mod if all(hasattr(mod, a) for a in ("Stream", "current_stream", "stream")) else None


def fork(x: torch.Tensor):
    """A side stream of x's device that has waited for the work queued so far on the current stream, or None
    (CPU, overlap off): pass it to :func:`on` and :func:`join`."""
    mod = _device_module(x.device)
    if mod is None or not enabled(x.device):
        return None
    side = _STREAMS.get(x.device)
    if side is None:
        side = _STREAMS[x.device] = mod.Stream(device=x.device)
    side.wait_stream(mod.current_stream(x.device))
    return side


def on(side):
    """Context that queues the work inside it on ``side`` (nothing when side is None)."""
    if side is None:
        return contextlib.nullcontext()
    return _device_module(side.device).stream(side)


def join(side) -> None:
    """The current stream waits for everything queued on ``side`` (nothing when side is None)."""
    if side is not None:
        _device_module(side.device).current_stream(side.device).wait_stream(side)


def run_beside(side_work, main_work, x: torch.Tensor):
    """``(side_work(), main_work())``, side_work queued on a side stream of x's device while main_work is queued on
    the current one, both joined before returning; in order on the CPU, with overlap off, or when main_work is
    None (then ``(side_work(), None)``)."""
    side = fork(x) if main_work is not None else None
    with on(side):
        a = side_work()
    b = main_work() if main_work is not None else None
    join(side)
    return a, b
