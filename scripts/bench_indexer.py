#!/usr/bin/env python3
"""Where indexer_topk's time goes on the GPU: the score kernel, the selection, torch.topk, the whole op (new and
the previous path, ATB_CUDA_INDEXER=old), each as a CUDA-graph replay (median ms), plus score-kernel tile variants.

Shapes as scripts/bench_kernels.py: 64 heads x 128 dims bf16, every token its own N key rows (read once), top-512.
Usage: python scripts/bench_indexer.py [--cfgs "BN,WARPS,STAGES,CTAS_PER_SM;..."]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import atb_ops  # noqa: E402
from atb_ops.cuda import indexer as ix  # noqa: E402


def g_ms(fn):
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def _breakdown(res, cu, q, w, keys, cand, k, byt, hbm, T, n):
    os.environ["ATB_CUDA_INDEXER"] = "old"
    res["old op"] = g_ms(lambda: cu(q, w, keys, cand, 512))
    old_out = cu(q, w, keys, cand, 512)
    k64 = torch.randint(-2**62, 2**62, (T, n), device=q.device)
    res["torch.topk int64"] = g_ms(lambda: torch.topk(k64, k, dim=-1, sorted=True))
    os.environ.pop("ATB_CUDA_INDEXER")
    res["new op"] = g_ms(lambda: cu(q, w, keys, cand, 512))
    new_out = cu(q, w, keys, cand, 512)
    sk = ix.score_keys(q, w, keys, cand)
    res["new score"] = g_ms(lambda: ix.score_keys(q, w, keys, cand))
    res["new select"] = g_ms(lambda: ix.select_topk(sk, cand, k))
    same = float((old_out == new_out).float().mean())
    line = "  ".join(f"{kk} {v * 1e3:.1f}us ({100 * byt / (v * 1e-3) / hbm:.1f}%)" for kk, v in res.items())
    print(f"T={T} N={n}: {line}  old==new {same:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="128,4,3,2;64,4,3,4;64,4,3,8;128,8,3,4;256,8,3,2;128,4,1,4,1;64,4,1,8,1;"
                                      "128,8,1,4,1;64,8,1,4,1")
    ap.add_argument("--sweep", default="1x2048;32x16384", help="shapes that get the tile sweep")
    ap.add_argument("--sel-warps", default="4;8;16")
    ap.add_argument("--shapes", default="1x2048;32x2048;32x16384;4x65536")
    a = ap.parse_args()
    dev = torch.device("cuda")
    a_ = torch.empty(2**28, device=dev)
    b_ = torch.empty_like(a_)
    hbm = 2 * a_.numel() * 4 / (float(triton.testing.do_bench(lambda: b_.copy_(a_), return_mode="median")) * 1e-3)
    del a_, b_
    print(f"device: {torch.cuda.get_device_name(dev)}; HBM copy {hbm / 1e12:.2f} TB/s", flush=True)
    cu = atb_ops.implementations("indexer_topk")["cuda"]
    g = torch.Generator(device=dev).manual_seed(0)
    for shp in a.shapes.split(";"):
        T, n = (int(v) for v in shp.split("x"))
        q = torch.randn(T, 64, 128, device=dev, generator=g).bfloat16()
        w = torch.randn(T, 64, device=dev, generator=g)
        keys = torch.randn(T * n, 128, device=dev, generator=g).bfloat16()
        cand = torch.arange(T * n, device=dev).view(T, n)
        byt = keys.numel() * 2 + cand.numel() * 8 + q.numel() * 2 + T * 512 * 8
        k = min(512, n)
        res = {}
        try:
            _breakdown(res, cu, q, w, keys, cand, k, byt, hbm, T, n)
        except Exception as e:  # noqa: BLE001
            print(f"T={T} N={n}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            os.environ.pop("ATB_CUDA_INDEXER", None)
            continue
        sk = ix.score_keys(q, w, keys, cand)
        if shp not in a.sweep.split(";"):
            continue
        for sw in a.sel_warps.split(";"):
            os.environ["ATB_CUDA_INDEXER_SEL_WARPS"] = sw
            try:
                v = g_ms(lambda: ix.select_topk(sk, cand, k))
                print(f"   select warps {sw}: {v * 1e3:.1f}us", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   select warps {sw}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            os.environ.pop("ATB_CUDA_INDEXER_SEL_WARPS")
        for cfg in filter(None, a.cfgs.split(";")):
            os.environ["ATB_CUDA_INDEXER"] = cfg
            try:
                v = g_ms(lambda: ix.score_keys(q, w, keys, cand))
                ok = torch.equal(ix.score_keys(q, w, keys, cand), sk)
                print(f"   score cfg {cfg}: {v * 1e3:.1f}us ({100 * byt / (v * 1e-3) / hbm:.1f}%) same={ok}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   score cfg {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            os.environ.pop("ATB_CUDA_INDEXER")
        del q, w, keys, cand
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
