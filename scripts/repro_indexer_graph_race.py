#!/usr/bin/env python3
"""Tests whether timing without a sync (the old scripts/bench_indexer.py g_ms) can read half-written inputs (session 4).

triton.testing.do_bench_cudagraph calls fn first on a NEW side stream that does not wait for the default stream.
Here cand is rewritten on the default stream behind a ~0.1 s device sleep, then timed at once. If the side stream
ran ahead:
  fill=-1:   it would see the old all -1 cand -> the first call's output all -1 (wrong), no crash
  fill=huge: it would see rows 2^40 -> the score kernel gathers far outside k_cache -> illegal access
with sync (what g_ms does now) both give the complete-input output. On the H100 (session 4, recycle=0) every case
gave the complete-input output: the race did not show. recycle=1: the side stream is one of torch's
pooled streams that already holds cached blocks (as after 32 stream creations), so no cudaMalloc synchronises the
device first. Each case in its own process (a fault ends the CUDA context).
Usage: python scripts/repro_indexer_graph_race.py [T N [RECYCLES, e.g. 1 or 0,1]]
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def case(fill, sync, t, n, path, recycle):
    import atb_ops
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_indexer as bi

    os.environ["ATB_CUDA_INDEXER"] = path
    bi.NO_SYNC = not sync
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, 64, 128, device=dev, generator=g).bfloat16()
    w = torch.randn(t, 64, device=dev, generator=g)
    keys = torch.randn(t * n, 128, device=dev, generator=g).bfloat16()
    cu = atb_ops.implementations("indexer_topk")["cuda"]
    cand = torch.full((t, n), -1 if fill == "neg1" else 2**40, dtype=torch.int64, device=dev)
    real = torch.arange(t * n, device=dev).view(t, n)
    want = cu(q, w, keys, real, 512)  # compiled, and the output of the complete inputs
    if recycle:
        # torch.cuda.Stream() hands out a pool of 32 streams round robin: warm the stream that do_bench_cudagraph
        # will get next, so that its allocations come from that stream's cached blocks (no cudaMalloc, which
        # would synchronise the device and hide the race)
        s_prev, s0 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s0):
            cu(q, w, keys, real, 512)
        torch.cuda.synchronize()
        for _ in range(64):
            if torch.cuda.Stream().cuda_stream == s_prev.cuda_stream:
                break
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # default stream busy ~0.1 s
    cand.copy_(real)  # ... then the real candidate ids, on the default stream
    first = []
    try:
        ms = bi.g_ms(lambda: first.append(cu(q, w, keys, cand, 512)) if not first else cu(q, w, keys, cand, 512))
        torch.cuda.synchronize()
        ok = torch.equal(first[0], want)
        print(f"fill={fill} sync={sync} path={path} recycle={recycle}: ran {ms * 1e3:.1f}us, first call == complete-input output: {ok}"
              f" (all -1: {bool((first[0] == -1).all())})", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"fill={fill} sync={sync} path={path} recycle={recycle}: FAILED {type(e).__name__}: {str(e)[:90]}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        case(sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7] == "1")
        sys.exit(0)
    t, n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (32, 65536)
    recycles = sys.argv[3].split(",") if len(sys.argv) > 3 else ("0", "1")
    for recycle in recycles:
        for fill in ("neg1", "huge"):
            for sync in ("0", "1"):
                subprocess.run([sys.executable, __file__, "--case", fill, sync, str(t), str(n), "rank", recycle],
                               check=False, timeout=120)
