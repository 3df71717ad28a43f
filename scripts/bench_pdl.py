#!/usr/bin/env python3
"""What programmatic dependent launch (PDL) saves per kernel boundary inside a CUDA graph, on this GPU.

A decode step of the Flash-shaped model is ~200 kernels a step, most of them small (a few us of work each), so the
gap between one kernel's end and the next one's start is a visible part of the step. With PDL (Hopper+: the launch
attribute ``programmaticStreamSerialization``, Triton's ``launch_pdl=True``) the next kernel may be launched before
the previous one has finished; its ``griddepcontrol.wait`` (Triton ``gdc_wait``) then blocks until the previous
kernel has completed and its memory is visible. This script times a chain of N dependent copies of a small Triton
kernel (each reads the previous one's output: ``y = x + 1`` over ``size`` floats) captured in one CUDA graph:

- ``plain``: no PDL;
- ``pdl-wait``: launched with PDL, ``gdc_wait`` as the kernel's first statement (the previous kernel triggers its
  dependents implicitly, as its programs exit);
- ``pdl-trigger``: as ``pdl-wait`` plus ``gdc_launch_dependents`` right after the wait (the next kernel may start
  its programs while this one runs).

It checks the chain's result (x + N) in every mode, so a broken dependency shows as an error, not a speed-up.
Usage: python scripts/bench_pdl.py [--n 200] [--sizes 1024,262144,4194304]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _add_one(x_ptr, y_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    if MODE >= 1:
        gdc_wait()
    if MODE == 2:
        gdc_launch_dependents()
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = off < n
    tl.store(y_ptr + off, tl.load(x_ptr + off, mask=m) + 1.0, mask=m)


def chain(bufs, n_kernels: int, mode: int, block: int) -> None:
    size = bufs[0].numel()
    grid = (triton.cdiv(size, block),)
    for i in range(n_kernels):
        _add_one[grid](bufs[i % 2], bufs[(i + 1) % 2], size, MODE=mode, BLOCK=block, num_warps=4,
                       launch_pdl=mode >= 1)


def time_mode(size: int, n_kernels: int, mode: int, reps: int = 20) -> float:
    block = 1024
    bufs = [torch.zeros(size, device="cuda"), torch.zeros(size, device="cuda")]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain(bufs, 2, mode, block)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(bufs, n_kernels, mode, block)
    times = []
    for _ in range(reps):
        bufs[0].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
        want = float(n_kernels)
        got = bufs[n_kernels % 2]
        if not torch.all(got == want):
            raise SystemExit(f"mode {mode} size {size}: chain result {got.min().item()}..{got.max().item()}, "
                             f"expected {want}: a dependency was not honoured")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--sizes", default="1024,262144,4194304")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"chain of {a.n} dependent kernels in one CUDA graph, median of 20 replays")
    print("| floats per kernel | plain us/kernel | pdl-wait us/kernel | pdl-trigger us/kernel | saved per boundary |")
    print("|---:|---:|---:|---:|---:|")
    for size in [int(x) for x in a.sizes.split(",")]:
        t = [time_mode(size, a.n, m) / a.n for m in (0, 1, 2)]
        print(f"| {size} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {t[0] - min(t[1], t[2]):.2f} us |")


if __name__ == "__main__":
    main()
