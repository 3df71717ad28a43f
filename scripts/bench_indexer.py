#!/usr/bin/env python3
"""Where indexer_topk's time goes on the GPU: the whole op on each path (ATB_CUDA_INDEXER = old / bits / hist / rank /
split / place / radix), the score kernel with and without the histogram, each selection alone, each as a CUDA-graph
replay (median), plus selection warps, histogram bits and score-kernel tile variants on the sweep shapes.

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

BREAK_PATHS = ("radix", "radix:radix_hist=1", "fused", "rank", "hist", "split", "place", "bits", "old")
from atb_ops.cuda import indexer as ix  # noqa: E402
from atb_ops.cuda import topk_radix  # noqa: E402


NO_SYNC = False  # --no-sync: the timing without the synchronisation below (to reproduce the old failure)


def g_ms(fn):
    """Median ms of fn replayed from a CUDA graph. do_bench_cudagraph runs fn (warm-up, estimate) on a NEW side
    stream that does not wait for the default stream, so inputs still being written there (randn / arange of the
    shape just built, a histogram copied into a buffer) could be read half-written; hence a device
    synchronisation first. (Suspected, not shown, to be the illegal memory access of the last session's T=32
    N=65536 breakdown: scripts/bench_results/indexer_h100_session4.txt.)"""
    if not NO_SYNC:
        torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def _pct(byt, v, hbm):
    return 100 * byt / (v * 1e-3) / hbm


def _timed(res, name, fn):
    try:
        res[name] = g_ms(fn)
    except Exception as e:  # noqa: BLE001
        print(f"   {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)


def _breakdown(res, cu, q, w, keys, cand, k, byt, hbm, T, n):
    outs = {}
    for spec in BREAK_PATHS:  # "PATH[:OPT=V:...]" -> ATB_CUDA_INDEXER=PATH, ATB_CUDA_INDEXER_OPT=V
        path, *opts = spec.split(":")
        os.environ["ATB_CUDA_INDEXER"] = path
        for o in opts:
            os.environ["ATB_CUDA_INDEXER_" + o.split("=")[0].upper()] = o.split("=")[1]
        outs[spec] = cu(q, w, keys, cand, 512)
        _timed(res, f"{spec} op", lambda: cu(q, w, keys, cand, 512))
        for o in opts:
            os.environ.pop("ATB_CUDA_INDEXER_" + o.split("=")[0].upper())
    os.environ.pop("ATB_CUDA_INDEXER")
    hb = ix.hist_bits()
    sk = ix.score_keys(q, w, keys, cand)
    _timed(res, "score", lambda: ix.score_keys(q, w, keys, cand))  # the previous grid (4 * SMs / T rounded up)
    _timed(res, "score 1-wave", lambda: ix.score_keys(q, w, keys, cand, wave=True))  # 2 * SMs / T rounded down

    def zeros():
        return torch.zeros(T, (1 << hb) + 32, dtype=torch.int32, device=q.device)

    _timed(res, "zeros", zeros)
    _timed(res, "zeros+score+hist", lambda: ix.score_keys(q, w, keys, cand, zeros(), hb))
    _timed(res, "zeros+score+hist 1-wave", lambda: ix.score_keys(q, w, keys, cand, zeros(), hb, wave=True))
    hist = zeros()
    ix.score_keys(q, w, keys, cand, hist, hb)
    _timed(res, "select bits", lambda: ix.select_topk(sk, cand, k))
    _timed(res, "select hist", lambda: ix.select_hist(sk, hist, cand, k, hb))
    # split: the slot counter (column 2^hb) must start at 0 on every replay: a copy of the histogram per call
    _timed(res, "copy+select split", lambda: ix.select_hist(sk, hist.clone(), cand, k, hb, split=True))
    _timed(res, "copy+select place", lambda: ix.select_hist(sk, hist.clone(), cand, k, hb, split="place"))
    if topk_radix.eligible(cand, k):
        _timed(res, "select radix", lambda: topk_radix.select(sk, cand, k))
        _timed(res, "select radix (hist)", lambda: topk_radix.select(sk, cand, k, hist, hb))
    buf = torch.zeros(T, (2 << hb) + 32, dtype=torch.int32, device=q.device)
    buf[:, : 1 << hb] = hist[:, : 1 << hb]  # the rank path's buffer: histogram, zeroed slot counters
    _timed(res, "copy+select rank", lambda: ix.select_rank(sk, buf.clone(), cand, k, hb))
    _timed(res, "copy", lambda: buf.clone())
    base = outs.get('old', next(iter(outs.values())))
    same = "  ".join(f"{p}==old: {float((o == base).float().mean()):.4f}" for p, o in outs.items())
    line = "  ".join(f"{kk} {v * 1e3:.1f}us ({_pct(byt, v, hbm):.1f}%)" for kk, v in res.items())
    print(f"T={T} N={n}: {line}  {same}", flush=True)
    return sk, hist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="128,4,1,4,1;128,4,1,2,1;64,4,1,8,1;128,8,1,4,1;128,4,3,2,0;64,4,3,8,0")
    ap.add_argument("--sweep", default="1x2048;32x16384", help="shapes that get the tile sweep")
    ap.add_argument("--sel-warps", default="4;8;16")
    ap.add_argument("--chs", default="1024;2048;4096;8192", help="compaction chunks tried on the sweep shapes")
    ap.add_argument("--hbs", default="10;11;12;13", help="histogram bits tried on the sweep shapes")
    ap.add_argument("--shapes", default="1x2048;32x2048;32x8192;32x16384;32x65536")
    ap.add_argument("--no-sync", action="store_true", help="old timing: no synchronisation before a graph timing")
    ap.add_argument("--paths", default="radix,radix:radix_hist=1,fused,rank,hist,split,place,bits,old", help="op paths of the breakdown")
    a = ap.parse_args()
    global NO_SYNC, BREAK_PATHS
    NO_SYNC, BREAK_PATHS = a.no_sync, tuple(a.paths.split(","))
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
            res["_keys"] = _breakdown(res, cu, q, w, keys, cand, k, byt, hbm, T, n)
        except Exception as e:  # noqa: BLE001
            print(f"T={T} N={n}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            os.environ.pop("ATB_CUDA_INDEXER", None)
            continue
        if shp not in a.sweep.split(";"):
            continue
        sk, hist = res.pop("_keys")
        hb = ix.hist_bits()
        for var, values, label in (("ATB_CUDA_INDEXER_SEL_WARPS", a.sel_warps, "select warps"),
                                   ("ATB_CUDA_INDEXER_CH", a.chs, "compaction chunk")):
            for val in values.split(";"):
                os.environ[var] = val
                try:
                    line = f"   {label} {val}:"
                    for split in (False, True):
                        v = g_ms(lambda: ix.select_hist(sk, hist.clone(), cand, k, hb, split=split))
                        line += f" {'split' if split else 'hist'} (+copy) {v * 1e3:.1f}us"
                    print(line, flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"   {label} {val}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                os.environ.pop(var)
        for hbs in a.hbs.split(";"):
            os.environ["ATB_CUDA_INDEXER_HB"] = hbs
            try:
                v = g_ms(lambda: cu(q, w, keys, cand, 512))
                print(f"   hist bits {hbs}: op {v * 1e3:.1f}us ({_pct(byt, v, hbm):.1f}%)", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   hist bits {hbs}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            os.environ.pop("ATB_CUDA_INDEXER_HB")
        for cfg in filter(None, a.cfgs.split(";")):
            tiles = [int(v) for v in cfg.split(",")]
            try:
                v = g_ms(lambda: ix.score_keys(q, w, keys, cand, tiles=tiles))
                ok = torch.equal(ix.score_keys(q, w, keys, cand, tiles=tiles), sk)
                os.environ["ATB_CUDA_INDEXER"] = cfg
                vo = g_ms(lambda: cu(q, w, keys, cand, 512))
                os.environ.pop("ATB_CUDA_INDEXER")
                print(f"   score cfg {cfg}: {v * 1e3:.1f}us ({_pct(byt, v, hbm):.1f}%) same={ok}; op with it "
                      f"{vo * 1e3:.1f}us ({_pct(byt, vo, hbm):.1f}%)", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   score cfg {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                os.environ.pop("ATB_CUDA_INDEXER", None)
        del q, w, keys, cand
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
