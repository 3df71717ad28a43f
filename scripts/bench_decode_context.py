#!/usr/bin/env python3
"""Old vs new derivation of a captured decode step's context (kv/decode_inputs.py) on a GPU, side by side.

For DeepSeek-V4-Flash's geometry (window 128, token pages of 64, ratio-4 entry pages of 64, ratio-128 entry pages
of 8: bench_decode's pools) and each (batch, context): the step context derived from a random compact buffer by
``torch`` (the plain tensor ops, ``ASCEND_DSV4_DECODE_CTX=torch``) and by ``triton`` (one kernel launch,
atb_ops/cuda/decode_context.py). Reported per path: kernels launched per derivation (torch.profiler, one eager
call), device time of a CUDA-graph replay of the derivation alone (median, ``do_bench_cudagraph``: what it adds
to a captured decode step), and the median eager call (with the host's launch cost). Each row first checks that
both paths give identical tensors.

Usage: python scripts/bench_decode_context.py [--batches 1,8,32,128,256] [--ctx 4096,65536]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascend_dsv4.engine.cuda_graphs import _width  # noqa: E402
from ascend_dsv4.kv.decode_inputs import (DecodeInputs, DecodeLayout, derive_decode_tensors_torch,  # noqa: E402
                                          derive_decode_tensors_triton)

TRASH_TOKEN, TRASH_ENTRY = 10 ** 6, {4: 10 ** 6 + 1, 128: 10 ** 6 + 2}
PATHS = {"torch": derive_decode_tensors_torch, "triton": derive_decode_tensors_triton}


def flat(out) -> list[torch.Tensor]:
    t, rows, swa, win, comp = out
    return [t, rows, swa, win] + [x for r in sorted(comp) for x in
                                  (comp[r].new_cand, comp[r].new_pos, comp[r].new_slot, comp[r].visible)]


def inputs(b: int, ctx: int) -> DecodeInputs:
    layout = DecodeLayout(b, 64, 128, 127, ((4, _width((ctx + 1) // 4)), (128, _width((ctx + 1) // 128))),
                          ((4, 64), (128, 8)))
    inp = DecodeInputs(layout, "cuda")
    g = torch.Generator(device="cuda").manual_seed(b)
    inp.positions.copy_(ctx - torch.randint(0, min(ctx, 300), (b,), device="cuda", generator=g))
    if b > 2:  # some padding rows, as a half-full bucket has
        inp.positions[b // 2 + 1:].fill_(-1)
    inp.token_table.copy_(torch.randint(0, 10 ** 5, inp.token_table.shape, device="cuda", generator=g))
    for tab in inp.tables.values():
        tab.copy_(torch.randint(0, 10 ** 5, tab.shape, device="cuda", generator=g))
    return inp


def kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    import triton
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--ctx", default="4096,65536")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    print("| batch | ctx | widths (r4, r128) | torch kernels | torch graph us | torch eager us | triton kernels | "
          "triton graph us | triton eager us | graph speed-up |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for ctx in map(int, a.ctx.split(",")):
        for b in map(int, a.batches.split(",")):
            inp = inputs(b, ctx)
            outs = {p: flat(f(inp, TRASH_TOKEN, TRASH_ENTRY)) for p, f in PATHS.items()}
            assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(outs["torch"], outs["triton"]))
            res = {}
            for p, f in PATHS.items():
                def call(f=f):
                    return f(inp, TRASH_TOKEN, TRASH_ENTRY)
                n = kernels(call)
                tg = float(triton.testing.do_bench_cudagraph(call, rep=30, return_mode="median")) * 1e3
                te = float(triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")) * 1e3
                res[p] = (n, tg, te)
            w = dict(inp.layout.widths)
            print(f"| {b} | {ctx} | {w[4]}, {w[128]} | {res['torch'][0]} | {res['torch'][1]:.1f} | "
                  f"{res['torch'][2]:.1f} | {res['triton'][0]} | {res['triton'][1]:.1f} | {res['triton'][2]:.1f} | "
                  f"{res['torch'][1] / res['triton'][1]:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
