#!/usr/bin/env python3
"""DeepSeek's own TileLang kernels side by side with this project's CUDA kernels, same GPU, same inputs, one run.

DeepSeek-V4's inference code ships TileLang kernels (``inference/kernel.py``: ``sparse_attn``, ``act_quant``,
``fp8_gemm``, ``fp4_gemm``). This project does not carry that file or TileLang: give the file's path with ``--peer``
(TileLang must be importable). For each case both are run on identical inputs, checked against a float32 torch
computation, and timed: CUDA-graph replay medians where the kernel can be captured, else eager medians (marked).
Cases: sparse attention at decode and prefill shapes (one index list over one KV tensor, as DeepSeek's kernel
takes it: window + selected entries concatenated; each token gathers its own rows; 4 input sets rotated so
decode rows come from HBM) and the FP8-block / FP4 linears (4096 x 4096; DeepSeek's path = ``act_quant`` of the
bf16 activations + ``fp8_gemm`` / ``fp4_gemm``, ours = ``atb_ops.linear`` on bf16 activations; 8 weights rotated),
with cuBLAS BF16 on the same shape. Percentages are of the HBM copy rate and the bf16 cuBLAS rate measured in the
same run.

Usage: python scripts/bench_tilelang_peer.py --peer PATH/kernel.py [--only REGEX]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import atb_ops  # noqa: E402
from bench_kernels import Rotating, bench, bench_graph, ceilings, rel  # noqa: E402
from quant.fp4 import dequant_fp4, quant_fp4  # noqa: E402
from quant.fp8_block import dequant_fp8_block, quant_fp8_block  # noqa: E402


def load_peer(path: str):
    spec = importlib.util.spec_from_file_location("deepseek_tilelang_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bf16_default(fn):
    """DeepSeek's GEMM wrappers allocate their output in torch's default dtype (bfloat16 in their model)."""
    def call(*a):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return fn(*a)
        finally:
            torch.set_default_dtype(prev)
    return call


def timed(fn) -> tuple[float, str]:
    """(ms, how): a CUDA-graph replay median, else an eager median."""
    fn()
    torch.cuda.synchronize()
    g = bench_graph(fn)
    return (g, "graph") if g is not None else (bench(fn), "eager")


def attention_cases(dev, g):
    D = 512
    for T, h in ((32, 64), (128, 64), (32, 128), (128, 128), (2048, 64), (2048, 128)):
        K = 640  # window 128 + 512 selected entries
        sets = []
        for _ in range(1 if T >= 2048 else 4):
            q = torch.randn(T, h, D, device=dev, generator=g).to(torch.bfloat16)
            kv = torch.randn(T * K, D, device=dev, generator=g).to(torch.bfloat16)
            idx = (torch.stack([torch.randperm(K, device=dev, generator=g) for _ in range(T)])
                   + torch.arange(T, device=dev)[:, None] * K).int()
            idx[:, -7:] = -1  # a few absent entries, as at the start of a sequence
            sink = torch.randn(h, device=dev, generator=g)
            sets.append((q, kv, idx, sink))
        byt = T * K * D * 2 + 2 * T * h * D * 2 + T * K * 4
        yield f"sparse_attn T={T} h={h} K={K} d={D}", sets, byt, 4 * T * h * K * D


def attention_reference(q, kv, idx, sink, scale):
    rows = kv.float()[idx.clamp(min=0).long()]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, rows) / den[..., None]


def run_attention(peer, dev, g, only, ceil):
    for name, sets, byt, fl in attention_cases(dev, g):
        if only and not re.search(only, name):
            continue
        scale = 512 ** -0.5
        q, kv, idx, sink = sets[0]
        want = attention_reference(q, kv, idx, sink, scale)
        ours = lambda q, kv, idx, sink: atb_ops.sparse_attention(q, kv, idx, sink, scale)  # noqa: E731
        theirs = lambda q, kv, idx, sink: peer.sparse_attn(q[None], kv[None], sink, idx[None], scale)[0]  # noqa: E731
        for who, fn in (("ours", ours), ("DeepSeek TileLang", theirs)):
            try:
                err = rel(fn(q, kv, idx, sink).float(), want)
                ms, how = timed(Rotating(fn, sets, {}))
            except Exception as e:  # noqa: BLE001 - a kernel that cannot build at this shape is reported
                print(f"| {name} | {who} | failed: {type(e).__name__}: {str(e)[:120]} |||||", flush=True)
                torch.cuda.synchronize()
                continue
            print(f"| {name} | {who} | {ms:.4f} ({how}) | {100 * byt / (ms * 1e-3) / ceil['hbm_Bps']:.1f} | "
                  f"{fl / (ms * 1e-3) / 1e12:.1f} | {100 * fl / (ms * 1e-3) / ceil['bf16_flops']:.1f} | {err:.1e} |",
                  flush=True)


def run_linears(peer, dev, g, only, ceil):
    N = K = 4096
    ws = [torch.randn(N, K, device=dev, generator=g) * 0.02 for _ in range(8)]
    w8 = [quant_fp8_block(w) for w in ws]
    w4 = [quant_fp4(w) for w in ws]
    wb = [w.to(torch.bfloat16) for w in ws]
    e8m0 = torch.float8_e8m0fnu
    for M in (1, 32, 64, 128):
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        for fmt in ("fp8_block", "fp4"):
            name = f"linear {fmt} M={M} {N}x{K}"
            if only and not re.search(only, name):
                continue
            if fmt == "fp8_block":
                wq = w8
                deq = dequant_fp8_block(*w8[0], dtype=torch.float32)
                ours = lambda x, w, s: atb_ops.linear(x, w, s, "fp8_block")  # noqa: E731

                @bf16_default
                def theirs(x, w, s):  # V4's FP8 linears: ue8m0 activation scales, E8M0 weight scales
                    a, a_s = peer.act_quant(x, 128, scale_fmt="ue8m0", scale_dtype=e8m0)
                    return peer.fp8_gemm(a, a_s, w, s.view(torch.uint8).view(e8m0), scale_dtype=e8m0)

                wbytes = N * K + (N // 128) * (K // 128) * 4
            else:
                wq = w4
                deq = dequant_fp4(*w4[0], dtype=torch.float32)
                ours = lambda x, w, s: atb_ops.linear(x, w, s, "fp4")  # noqa: E731

                @bf16_default
                def theirs(x, w, s):
                    a, a_s = peer.act_quant(x, 128, scale_fmt="ue8m0", scale_dtype=e8m0)
                    return peer.fp4_gemm(a, a_s, w.view(torch.uint8).view(torch.float4_e2m1fn_x2),
                                         s.view(torch.uint8).view(e8m0), scale_dtype=e8m0)

                wbytes = N * K // 2 + N * (K // 32)
            want = x.float() @ deq.T
            byt = wbytes + M * K * 2 + M * N * 2
            fl = 2 * M * N * K
            rows = [(who, fn, [(x, w, s) for w, s in wq]) for who, fn in (("ours", ours), ("DeepSeek TileLang", theirs))]
            rows.append(("cuBLAS bf16", lambda x, w: x @ w.T, [(x, w) for w in wb]))
            for who, fn, sets in rows:
                try:
                    err = rel(fn(*sets[0]).float(), want)
                    ms, how = timed(Rotating(fn, sets, {}))
                except Exception as e:  # noqa: BLE001
                    print(f"| {name} | {who} | failed: {type(e).__name__}: {str(e)[:120]} |||||", flush=True)
                    torch.cuda.synchronize()
                    continue
                b = (N * K * 2 + M * K * 2 + M * N * 2) if who.startswith("cuBLAS") else byt
                print(f"| {name} | {who} | {ms:.4f} ({how}) | {100 * b / (ms * 1e-3) / ceil['hbm_Bps']:.1f} | "
                      f"{fl / (ms * 1e-3) / 1e12:.1f} | {100 * fl / (ms * 1e-3) / ceil['bf16_flops']:.1f} | "
                      f"{err:.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", required=True, help="path of DeepSeek-V4's inference/kernel.py (TileLang)")
    ap.add_argument("--only", default=None, help="regex over case names")
    a = ap.parse_args()
    import triton

    import tilelang

    dev = torch.device("cuda")
    peer = load_peer(a.peer)
    ceil = ceilings(dev)
    print(f"# {torch.cuda.get_device_name(0)} (torch {torch.__version__}, triton {triton.__version__}, "
          f"tilelang {tilelang.__version__}); HBM copy {ceil['hbm_Bps'] / 1e12:.2f} TB/s, bf16 cuBLAS "
          f"{ceil['bf16_flops'] / 1e12:.0f} TFLOP/s")
    print("# ms: median CUDA-graph replay (graph) or eager call (eager); % HBM: bytes that must move / copy rate; "
          "rel err vs a float32 torch computation on the same inputs")
    print("| case | kernel | ms | % HBM | TFLOP/s | % TC | rel err |")
    print("|---|---|---:|---:|---:|---:|---:|", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    run_attention(peer, dev, g, a.only, ceil)
    run_linears(peer, dev, g, a.only, ceil)


if __name__ == "__main__":
    main()
