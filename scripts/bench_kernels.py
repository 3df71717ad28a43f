#!/usr/bin/env python3
"""Per-op benchmark of the CUDA backend's Triton kernels against the HBM and tensor-core ceilings.

For every op at DeepSeek-V4-Flash shapes (decode and prefill), the script times the ``cuda`` implementation
and the ``reference`` implementation on the same GPU (median of ``triton.testing.do_bench``), counts the
fewest bytes the op must move (each input read once, each output written once; gathered rows counted once
per distinct row) and its FLOPs, and prints time, GB/s, TFLOP/s, % of the HBM ceiling and % of the bf16
tensor-core ceiling, both measured in the same run (device-to-device copy; 8192^3 bf16 cuBLAS matmul), and
the speed-up over the reference op. Kernel times are CUDA-graph replays (device time, as inside the captured
decode step) and, separately, eager calls (with the host's launch cost); the reference ops cannot be captured
(host synchronisations), so the speed-up compares eager calls. Each case also checks the kernel against the
reference output.

DeepSeek's TileLang kernels side by side: ``scripts/bench_tilelang_peer.py`` (needs TileLang and their kernel file).

FP8-block / FP4 linears and grouped matmuls are timed on the CUDA paths side by side: ``[gemm=tiled]`` (the
tiled kernel, gemm.py), ``[gemm=decode]`` (gemm_decode.py; ``--decode-variants``: its tunables), ``[gemm=tc]``
(the swap-AB tensor-core kernel, gemm_tc.py; ``--tc-variants``: its tunables) and ``[gemm=tcl]`` (the same MMA over
rows sorted by expert, gemm_tc_large.py; ``--tcl-variants``); ``--gemm-paths`` picks a subset (``auto``: a row for
the default rules). The
grouped cases rotate over 8 expert-id draws (and the linears over 8 weights) so that the weights are read from HBM,
and each grouped shape has a bf16 peer row: torch._grouped_mm (or a per-expert cuBLAS loop where it is missing) on
rows already sorted by expert.

Usage: python scripts/bench_kernels.py [--out results.json] [--quick] [--only REGEX] [--no-reference]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import atb_ops  # noqa: E402
from quant.fp4 import quant_fp4  # noqa: E402
from quant.fp8_block import quant_fp8_block  # noqa: E402


def bench(fn, warmup=10, rep=50) -> float:
    """Median milliseconds of eager calls (CUDA events via triton.testing.do_bench): includes host launch cost."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn) -> float | None:
    """Median milliseconds of the op replayed from a CUDA graph (device time without host launch gaps, as in
    the graph-captured decode step); None when the op cannot be captured."""
    import triton.testing

    try:
        # do_bench_cudagraph runs fn on a new side stream that does not wait for the default stream: the inputs
        # must be complete first (scripts/bench_indexer.py g_ms)
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))
    except Exception:
        torch.cuda.synchronize()
        return None


def ceilings(dev) -> dict:
    n = 256 * 1024 * 1024  # two 1 GiB float32 buffers
    a = torch.empty(n, dtype=torch.float32, device=dev).normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), 5, 30)
    bw = 2 * a.numel() * 4 / (t * 1e-3)
    del a, b
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    n2 = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = bench(lambda: m @ n2, 5, 30)
    tf = 2 * 8192**3 / (t * 1e-3)
    return {"hbm_Bps": bw, "bf16_flops": tf}


ROTATE = 8
FP4_MOE_PATHS = []  # "[gemm=fp4moe]", "[gemm=fp4moe cfg=...]" per --fp4moe-variants entry, "[gemm=auto]"
GEMM_PATHS = ["[gemm=tiled]", "[gemm=decode]", "[gemm=tc]", "[gemm=tcl]"]  # + "[gemm=decode cfg=...]" per
# --decode-variants entry, "[gemm=tc cfg=...]" per --tc-variants entry and "[gemm=tcl cfg=...]" per --tcl-variants
# entry; "[gemm=auto]" (the default rules) where --gemm-paths names it
# tile variants of the attention kernel timed side by side: " [BH,BN,WARPS]" (see atb_ops/cuda/attention.py)
# and of the second kernel: " [attn=old]" (attention.py's default tiles), " [attn2=BH,BN,ND,WARPS,STAGES]"
# (attention_v2.py, see its ``tile``), " [attn=new]" (attention_v2.py's default tiles), " [attnw=on]" / " [attnw=
# seesaw]" (attention_wgmma.py / attention_seesaw.py where they take the shape); "" = the default
# (ATB_CUDA_ATTN_IMPL=auto). --attn-variants replaces the list.
ATTN_VARIANTS = ["", " [attn=new]", " [attn=old]"]
ROTATE_BYTES = 150e6  # rotated attention inputs: 3x the 50 MB L2
# indexer_topk variants (ATB_CUDA_INDEXER, see atb_ops/cuda/indexer.py): the selection paths (rank: histogram +
# bucket by bin + rank within the bin; hist: histogram + compact + sort; split: its compaction over many programs;
# bits: the previous bit-search selection; old: int64 keys + torch.topk), " name=value" options setting
# ATB_CUDA_INDEXER_<NAME> (ch, hb, r, sel_warps), and score-kernel tiles " [indexer=BN,WARPS,STAGES,CTAS_PER_SM,PRE]"
# (P, Q, FIT, SPLITS: the fused path's bucket / sort programs per token, score programs rounded down / given).
# Session 4: the fused path (one launch) against the other paths and the score kernel fitted to one wave.
# Session 4 measured the first rows (to N=65536 fused p=2); the rest are the next run's questions (fused's rank-slice
# sort programs, the other paths on the one-wave score grid).
INDEXER_VARIANTS = ["", " [indexer=fused]", " [indexer=fused q=4]", " [indexer=fused p=2]",
                    " [indexer=fused,128,4,1,4,1]", " [indexer=rank]", " [indexer=rank,128,4,1,2,1 fit=1]",
                    " [indexer=split]", " [indexer=bits]", " [indexer=fused frank=1]", " [indexer=rank fit=1]",
                    " [indexer=split fit=1]", " [indexer=place]"]


class Rotating:
    """Calls ``fn`` on the next argument tuple of a list at each call (weights that would fit in L2)."""

    def __init__(self, fn, arg_sets, kw):
        self.fn, self.arg_sets, self.kw, self.i = fn, arg_sets, kw, 0

    def __call__(self):
        a = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*a, **self.kw)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _nb(*ts):
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _grouped_peer(w, x, draws):
    """(fn(i) -> bf16 [M, N] of draw i's rows sorted by expert, name): torch._grouped_mm with int32 row-end
    offsets where it runs, else one cuBLAS matmul per active expert (row ranges computed here, on the host)."""
    E = w.shape[0]
    sets = []
    for d in draws:
        order = torch.argsort(d, stable=True)
        counts = torch.bincount(d, minlength=E)
        sets.append((x[order].contiguous(), torch.cumsum(counts, 0).to(torch.int32), d[order], counts.tolist()))
    wt = w.transpose(-2, -1)  # [E, K, N]
    try:
        got = torch._grouped_mm(sets[0][0], wt, offs=sets[0][1])
        want = torch.cat([sets[0][0][sets[0][2] == e] @ w[e].t() for e in range(E)])
        if got.shape == want.shape and float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2:
            return (lambda i: torch._grouped_mm(sets[i][0], wt, offs=sets[i][1])), "torch._grouped_mm"
    except (AttributeError, RuntimeError):
        pass
    ranges = []
    for xs, _, _, counts in sets:
        r, a = [], 0
        for e, c in enumerate(counts):
            if c:
                r.append((e, a, a + c))
            a += c
        ranges.append(r)

    def loop(i):
        xs = sets[i][0]
        return torch.cat([xs[a:b] @ w[e].t() for e, a, b in ranges[i]])

    return loop, "per-expert cuBLAS"


def cases(dev, quick: bool):
    """Yield (name, op, args, kwargs, bytes, flops)."""
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def r(*s, dtype=bf, scale=1.0):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(dtype)

    D, H, Dm = 512, 64, 4096
    for T in ((32,) if quick else (1, 32, 128)):
        x = r(T, Dm)
        w = torch.ones(Dm, device=dev)
        yield f"rms_norm T={T} d=4096", "rms_norm", (x, w, 1e-6), {}, 2 * _nb(x), 3 * x.numel()
        q = r(T, H, D)
        yield f"rms_norm q T={T}x64 d=512", "rms_norm", (q, None, 1e-6), {}, 2 * _nb(q), 3 * q.numel()
        inv = atb_ops.rope_inv_freq(64, 10000.0).to(dev)  # a model buffer lives on the device
        pos = torch.arange(T, device=dev) + 5000
        yield f"apply_rope q T={T}x64x512", "apply_rope", (q, pos, inv), {}, 2 * _nb(q), 6 * T * H * 64
        xs = r(T, 4, Dm)
        fn = r(24, 4 * Dm, dtype=torch.float32, scale=0.01)
        base, scale = r(24, dtype=torch.float32), r(3, dtype=torch.float32).abs()
        yield (f"hc_pre T={T} 4x4096", "hc_pre", (xs, fn, base, scale, 20, 1e-6, 1e-6), {},
               2 * _nb(xs) + _nb(fn) + T * Dm * 2, 2 * T * 24 * 4 * Dm + 2 * T * 4 * Dm)
        post, comb = torch.rand(T, 4, device=dev), torch.rand(T, 4, 4, device=dev)
        yield f"hc_post T={T} 4x4096", "hc_post", (x, xs, post, comb), {}, 2 * _nb(xs) + _nb(x), 10 * T * 4 * Dm
        gt, up = r(T * 6, 2048), r(T * 6, 2048)
        yield f"swiglu {T * 6}x2048", "swiglu", (gt, up, 10.0), {}, _nb(gt, up) + gt.numel() * 4, 8 * gt.numel()
        yield f"fp8_act_round {T}x4096", "fp8_act_round", (x, 128), {}, 2 * _nb(x), 4 * x.numel()
        yield f"fp4_act_round {T}x4096", "fp4_act_round", (x, 32), {}, 2 * _nb(x), 8 * x.numel()
        gw, gb = r(256, Dm), r(256, dtype=torch.float32, scale=0.1)
        yield (f"moe_gate T={T} E=256 k=6", "moe_gate", (x, gw, gb, 6, 1.5), {}, _nb(x, gw) + T * 6 * 16,
               2 * T * 256 * Dm)

    # sparse attention: window 128 + compressed entries (CSA top-512 of ctx/4, HCA all ctx/128) per token, d = 512.
    # Decode rows: every token its own rows (distinct sequences); ROTATE_BYTES of index draws over separate pools
    # are rotated so that the rows come from HBM. Bytes = the rows gathered once per token + q + out (+ indices).
    # "-seq" prefill rows: the 2048 tokens of one sequence (sliding window, the causal compressed entries of a
    # 2048-token context): rows shared by the tokens, L2-resident, compute-bound. FLOPs count valid keys only.
    for T, h, ctx, kind in ((1, 64, 8192, "csa"), (4, 64, 8192, "csa"), (8, 64, 8192, "csa"), (16, 64, 8192, "csa"),
                            (32, 64, 8192, "csa"), (64, 64, 8192, "csa"), (128, 64, 8192, "csa"), (8, 128, 8192, "csa"),
                            (32, 128, 8192, "csa"), (128, 128, 8192, "csa"), (32, 64, 8192, "hca"),
                            (64, 64, 8192, "hca"), (128, 64, 8192, "hca"),
                            (2048, 64, 2048, "csa-prefill"), (2048, 128, 2048, "csa-prefill"),
                            (2048, 64, 2048, "csa-prefill-seq"), (2048, 128, 2048, "csa-prefill-seq")):
        if quick and T not in (32,):
            continue
        q = r(T, h, D)
        sink = r(h, dtype=torch.float32)
        k2 = 512 if kind.startswith("csa") else ctx // 128
        if kind.endswith("-seq"):
            swa = r(T, D)
            pos = torch.arange(T, device=dev)
            win = pos[:, None] - 127 + torch.arange(128, device=dev)[None, :]
            win = torch.where(win >= 0, win, torch.full_like(win, -1))
            pool = r(ctx // 4, D)
            ex = torch.arange(k2, device=dev)[None, :].expand(T, k2)
            ex = torch.where(ex < ((pos + 1) // 4)[:, None], ex, torch.full_like(ex, -1)).contiguous()
            valid = int((win >= 0).sum() + (ex >= 0).sum())
            sets = [(q, swa, win, sink, D**-0.5, pool, ex)]
            byt = _nb(swa, pool, win, ex) + 2 * _nb(q)
        else:
            n_ent = ctx // 4 if kind.startswith("csa") else ctx // 128
            valid = T * (128 + k2)
            byt = valid * D * 2 + 2 * _nb(q) + T * (128 + k2) * 8
            sets = []
            while not sets or (len(sets) < 8 and len(sets) * byt < ROTATE_BYTES):
                swa = r(T * 128 + 16, D)
                win = torch.randperm(T * 128 + 16, device=dev, generator=g)[:T * 128].view(T, 128)
                pool = r(T * n_ent, D)
                ex = torch.stack([torch.randperm(n_ent, device=dev, generator=g)[:k2] + i * n_ent for i in range(T)])
                sets.append((r(T, h, D), swa, win, sink, D**-0.5, pool, ex))
        fl = 4 * h * valid * D
        rot = f" x{len(sets)}" if len(sets) > 1 else ""
        for variant in ([""] if quick else ATTN_VARIANTS):
            yield (f"sparse_attention {kind} T={T} h={h} K=128+{k2}{rot}{variant}", "sparse_attention", sets, {},
                   byt, fl)

    # V3 MLA decode (absorbed): H=128, C=512, R=64
    for T, L in ((1, 4096), (32, 4096)):
        if quick and T != 32:
            continue
        qn, qp = r(T, 128, 512), r(T, 128, 64)
        lat = r(T * L, 576)
        idx = torch.arange(T * L, device=dev).view(T, L)
        for variant in ([""] if quick else ATTN_VARIANTS):
            yield (f"mla_decode T={T} H=128 L={L}{variant}", "mla_decode", (qn, qp, lat, idx, 0.1), {},
                   _nb(lat, idx) + 2 * _nb(qn) + _nb(qp), 4 * T * 128 * L * 512 + 2 * T * 128 * L * 64)

    # compressor pooling (prefill of 8192 tokens, ratio 4 with overlap; ratio 128)
    S = 8192
    for ratio in (4, 128):
        width = 2 * D if ratio == 4 else D
        kvs, scs = r(S, width, dtype=torch.float32), r(S, width, dtype=torch.float32)
        M = S // ratio
        kk = 2 * ratio if ratio == 4 else ratio
        e = torch.arange(M, device=dev)
        cand = (e[:, None] * ratio - (kk - ratio) + torch.arange(kk, device=dev)[None, :])
        cand = torch.where(cand >= 0, cand, torch.full_like(cand, -1))
        yield (f"compressor_pool prefill S={S} r={ratio}", "compressor_pool", (kvs, scs, cand, ratio == 4), {},
               _nb(kvs, scs) + M * D * 4 + _nb(cand), 5 * M * kk * D)

    # indexer: 64 heads x 128 dims, candidates = ctx/4 entries, top-512
    for T, ctx in ((1, 8192), (32, 8192), (32, 32768), (32, 65536), (32, 262144)):
        if quick and T != 32:
            continue
        n = ctx // 4
        q, wts = r(T, 64, 128), r(T, 64, dtype=torch.float32)
        keys = r(T * n, 128)
        cand = torch.arange(T * n, device=dev).view(T, n)
        for var in INDEXER_VARIANTS:
            yield (f"indexer_topk T={T} N={n} top-512{var}", "indexer_topk", (q, wts, keys, cand, 512), {},
                   _nb(keys, cand, q) + T * 512 * 8, 2 * T * 64 * n * 128)

    # linears: FP8 block (attention / shared expert) and FP4 (experts), N=K=4096. A 4096^2 weight fits in the
    # 50 MB L2: each case rotates over 8 weight copies (ROTATE) so that every call streams its weight from HBM
    Nl, Kl = 4096, 4096
    ws = [torch.randn(Nl, Kl, device=dev, generator=g) * 0.02 for _ in range(ROTATE)]
    w8s = [quant_fp8_block(w) for w in ws]
    w4s = [quant_fp4(w) for w in ws]
    wbs = [w.to(bf) for w in ws]
    del ws
    for M in ((32,) if quick else (1, 32, 64, 512)):
        x = r(M, Kl)
        w8, s8 = w8s[0]
        w4, s4 = w4s[0]
        for path in GEMM_PATHS:
            yield (f"linear fp8_block M={M} 4096x4096 {path}", "linear", [(x, w, s, "fp8_block") for w, s in w8s], {},
                   _nb(w8, s8, x) + M * Nl * 2, 2 * M * Nl * Kl)
        for variant in ("fp4", "fp4-split"):
            for path in (GEMM_PATHS if variant == "fp4" else ("[gemm=tiled]",)):
                yield (f"linear {variant} M={M} 4096x4096 {path}", "linear", [(x, w, s, "fp4") for w, s in w4s], {},
                       _nb(w4, s4, x) + M * Nl * 2, 2 * M * Nl * Kl)
        yield (f"linear bf16 (cuBLAS) M={M} 4096x4096", "linear", [(x, w) for w in wbs], {},
               Nl * Kl * 2 + 2 * _nb(x), 2 * M * Nl * Kl)
    del w8s, w4s, wbs

    # the FP8 linears of a Flash decode step at batch 8, at their own shapes (N x K): wq_a + wkv stacked, wq_b,
    # wo_b, the shared expert's w1 + w3 stacked and w2; cuBLAS BF16 on the same shapes side by side
    if not quick:
        for name, (nd, kd) in (("wq_a+wkv", (1536, 4096)), ("wq_b", (32768, 1024)), ("wo_b", (4096, 8192)),
                               ("shared w13", (4096, 4096)), ("shared w2", (4096, 2048))):
            rot = max(2, min(16, int(2 * ROTATE_BYTES // (nd * kd))))  # >= 2x the 50 MB L2 in all
            ws = [torch.randn(nd, kd, device=dev, generator=g) * 0.02 for _ in range(rot)]
            w8s = [quant_fp8_block(w) for w in ws]
            wbs = [w.to(bf) for w in ws]
            del ws
            x = r(8, kd)
            w8, s8 = w8s[0]
            for path in GEMM_PATHS:
                yield (f"linear fp8_block M=8 {nd}x{kd} ({name}) {path}", "linear",
                       [(x, w, s, "fp8_block") for w, s in w8s], {}, _nb(w8, s8, x) + 8 * nd * 2, 2 * 8 * nd * kd)
            yield (f"linear bf16 (cuBLAS) M=8 {nd}x{kd} ({name})", "linear", [(x, w) for w in wbs], {},
                   nd * kd * 2 + 2 * _nb(x), 2 * 8 * nd * kd)
            del w8s, wbs

    # grouped expert GEMM, routed experts of DeepSeek-V4-Flash: w1 / w3 [E, 2048, 4096] and w2 [E, 4096, 2048],
    # and w1 / w3 stacked (w13 [E, 4096, 4096]: Experts.stack_weights_, one call for both on CUDA);
    # rows = T * 6 routed; 8 draws of expert ids per case (rotated) so that the experts are not L2-resident
    E, I = 64, 2048
    for shape in (("w1", I, Dm), ("w2", Dm, I), ("w13", 2 * I, Dm)):
        name, Nw, Kw = shape
        if quick and name != "w1":
            continue
        we = torch.randn(E, Nw, Kw, device=dev, generator=g) * 0.02
        we8, se8 = quant_fp8_block(we)
        we4, se4 = quant_fp4(we)
        web = we.to(bf)
        del we
        for T in ((32,) if quick else (1, 8, 32, 64, 512)):
            rows = T * 6
            draws = [torch.stack([torch.randperm(E, device=dev, generator=g)[:6] for _ in range(T)]).view(-1)
                     for _ in range(ROTATE)]
            draws = [d.sort().values for d in draws]
            active = sum(int(d.unique().numel()) for d in draws) / ROTATE
            x = r(rows, Kw)
            fl = 2 * rows * Nw * Kw
            for fmt, wt, sc, bpw in (("dense", web, None, 2.0), ("fp8_block", we8, se8, 1.0 + 1 / 16384),
                                     ("fp4", we4, se4, 0.5 + 1 / 32), ("fp4-split", we4, se4, 0.5 + 1 / 32)):
                byt = int(active * Nw * Kw * bpw) + _nb(x) + rows * Nw * 2
                paths = [""] if fmt == "dense" else (["[gemm=tiled]"] if fmt == "fp4-split" else list(GEMM_PATHS))
                if fmt == "fp4":  # the MoE fp4 kernel (gemm_fp4_moe.py) and its variants; "[gemm=auto]": the default
                    paths += FP4_MOE_PATHS
                paths = list(dict.fromkeys(paths))  # "[gemm=auto]" once
                if rows > 1024:  # beyond the decode / tc / fp4moe kernels' MAX_ROWS: the tiled and tcl kernels only
                    paths = [p for p in paths if p in ("", "[gemm=tiled]", "[gemm=auto]") or p.startswith("[gemm=tcl")]
                for path in paths:
                    yield (f"grouped_matmul {fmt} T={T}x6 E={E} {Nw}x{Kw} ({name}) {path}".rstrip(), "grouped_matmul",
                           [(x, wt, d, sc, fmt.split("-")[0]) for d in draws], {}, byt, fl)
            # the bf16 peer: torch._grouped_mm (cuBLAS / CUTLASS grouped GEMM) over rows already sorted by expert,
            # or a per-expert cuBLAS loop where that op is missing; the GEMM alone (no sort, no gather)
            peer, peer_name = _grouped_peer(web, x, draws)
            yield (f"grouped_matmul bf16 peer ({peer_name}) T={T}x6 E={E} {Nw}x{Kw} ({name})", peer,
                   [(i,) for i in range(ROTATE)], {}, int(active * Nw * Kw * 2.0) + 2 * _nb(x) + rows * Nw * 2, fl)
        del we8, se8, we4, se4, web


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the reference ops")
    ap.add_argument("--only", default=None, help="time only the cases whose name matches this regular expression")
    ap.add_argument("--decode-variants", default="",
                    help="';'-separated ATB_CUDA_DECODE_CFG settings of the decode GEMM, each timed as its own row")
    ap.add_argument("--tc-variants", default="",
                    help="';'-separated ATB_CUDA_TC_CFG settings of the swap-AB tensor-core GEMM, each its own row")
    ap.add_argument("--tcl-variants", default="",
                    help="';'-separated ATB_CUDA_TCL_CFG settings of the sorted-rows tensor-core GEMM, one row each")
    ap.add_argument("--fp4moe-variants", default=None,
                    help="';'-separated ATB_CUDA_FP4_MOE_CFG settings of the fp4 MoE GEMM, each its own row ('' = "
                         "its defaults); given: fp4 grouped cases also get a '[gemm=auto]' row (the default path)")
    ap.add_argument("--fp4mma-variants", default=None,
                    help="';'-separated ATB_CUDA_FP4_MMA_CFG settings of the CUDA C fp4 MoE kernel (fp4_moe_mma.py), "
                         "each its own row ('' = its defaults)")
    ap.add_argument("--fp4f16-variants", default=None,
                    help="';'-separated ATB_CUDA_FP4_MMA_CFG settings of the float16-MMA fp4 MoE kernel "
                         "(fp4_moe_f16.py), each its own row ('' = its defaults)")
    ap.add_argument("--gemm-paths", default=None,
                    help="','-separated subset of the GEMM paths to time (tiled,decode,tc,tcl,auto); default all "
                         "but auto")
    ap.add_argument("--indexer-variants", default=None,
                    help="';'-separated indexer variants, e.g. ';indexer=rank;indexer=split,128,4,1,3,1' ('' = default)")
    ap.add_argument("--attn-variants", default=None,
                    help="';'-separated attention variants, e.g. ';attn=old;attn2=64,32,2,4,3' ('' = default)")
    a = ap.parse_args()
    if a.gemm_paths:
        keep = a.gemm_paths.split(",")
        GEMM_PATHS[:] = [p for p in GEMM_PATHS if p[len("[gemm="):-1] in keep] + (["[gemm=auto]"] if "auto" in keep
                                                                                  else [])
    if a.attn_variants is not None:
        ATTN_VARIANTS[:] = [f" [{v}]" if v else "" for v in a.attn_variants.split(";")]
    if a.indexer_variants is not None:
        INDEXER_VARIANTS[:] = [f" [{v}]" if v else "" for v in a.indexer_variants.split(";")]
    GEMM_PATHS.extend(f"[gemm=decode cfg={v}]" for v in filter(None, a.decode_variants.split(";")))
    GEMM_PATHS.extend(f"[gemm=tc cfg={v}]" for v in filter(None, a.tc_variants.split(";")))
    GEMM_PATHS.extend(f"[gemm=tcl cfg={v}]" for v in filter(None, a.tcl_variants.split(";")))
    if a.fp4moe_variants is not None:
        FP4_MOE_PATHS.extend(f"[gemm=fp4moe cfg={v}]" if v else "[gemm=fp4moe]" for v in a.fp4moe_variants.split(";"))
        FP4_MOE_PATHS.append("[gemm=auto]")
    if a.fp4mma_variants is not None:
        FP4_MOE_PATHS.extend(f"[gemm=fp4mma cfg={v}]" if v else "[gemm=fp4mma]" for v in a.fp4mma_variants.split(";"))
    if a.fp4f16_variants is not None:
        FP4_MOE_PATHS.extend(f"[gemm=fp4f16 cfg={v}]" if v else "[gemm=fp4f16]" for v in a.fp4f16_variants.split(";"))
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    ceil = ceilings(dev)
    print(f"device: {name}; measured ceilings: HBM copy {ceil['hbm_Bps'] / 1e12:.2f} TB/s (read + write), "
          f"bf16 cuBLAS 8192^3 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    impl = {op: atb_ops.implementations(op) for op in atb_ops.OPS}
    rows = []
    hdr = ("| op / shape | kernel ms (graph) | GB/s | % HBM | TFLOP/s | % TC | kernel ms (eager call) | reference ms "
           "(eager) | speed-up (eager/eager) | rel err |")
    print(hdr + "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for case_name, op, args, kw, byt, fl in cases(dev, a.quick):
        if a.only and not re.search(a.only, case_name):
            continue
        os.environ["ATB_CUDA_FP4"] = "split" if "fp4-split" in case_name else "join"
        gm = re.search(r"\[gemm=(\w+)(?: bm=(\d+))?(?: cfg=([^\]]+))?\]", case_name)
        os.environ["ATB_CUDA_GEMM"] = gm.group(1) if gm else "auto"
        tc_cfg = gm and gm.group(1) == "tc" and gm.group(3)
        tcl_cfg = gm and gm.group(1) == "tcl" and gm.group(3)
        moe_cfg = gm and gm.group(1) == "fp4moe" and gm.group(3)
        mma_cfg = gm and gm.group(1) in ("fp4mma", "fp4f16") and gm.group(3)
        for var, val in (("ATB_CUDA_DECODE_BM", gm and gm.group(2)),
                         ("ATB_CUDA_DECODE_CFG", gm and gm.group(1) == "decode" and gm.group(3)),
                         ("ATB_CUDA_TC_CFG", tc_cfg), ("ATB_CUDA_TCL_CFG", tcl_cfg), ("ATB_CUDA_FP4_MOE_CFG", moe_cfg),
                         ("ATB_CUDA_FP4_MMA_CFG", mma_cfg)):
            if val:
                os.environ[var] = val
            else:
                os.environ.pop(var, None)
        im = re.search(r"\[indexer=([\w,]+)((?: \w+=\d+)*)\]", case_name)
        for opt in ("CH", "HB", "R", "SEL_WARPS", "P", "Q", "FIT", "SPLITS", "CAP", "FRANK", "RADIX_HIST"):
            os.environ.pop(f"ATB_CUDA_INDEXER_{opt}", None)
        if im:
            os.environ["ATB_CUDA_INDEXER"] = im.group(1)
            for opt in im.group(2).split():  # " ch=4096 hb=11" -> ATB_CUDA_INDEXER_CH=4096 ...
                key, val = opt.split("=")
                os.environ[f"ATB_CUDA_INDEXER_{key.upper()}"] = val
        else:
            os.environ.pop("ATB_CUDA_INDEXER", None)
        am = re.search(r"\[(attn2?|attnw)=([\w,-]+)\]", case_name)
        for var in ("ATB_CUDA_ATTN", "ATB_CUDA_ATTN2", "ATB_CUDA_ATTN_IMPL"):
            os.environ.pop(var, None)
        if am and am.group(1) == "attnw":  # " [attnw=on]" / " [attnw=seesaw]"
            os.environ["ATB_CUDA_ATTN_IMPL"] = "seesaw" if am.group(2) == "seesaw" else "wgmma"
        elif am and am.group(2) == "new":
            os.environ["ATB_CUDA_ATTN_IMPL"] = "new"
        elif am and am.group(1) == "attn2":
            os.environ["ATB_CUDA_ATTN_IMPL"] = "new"
            os.environ["ATB_CUDA_ATTN2"] = am.group(2)
        elif am:
            os.environ["ATB_CUDA_ATTN_IMPL"] = "old"
            if am.group(2) != "old":
                os.environ["ATB_CUDA_ATTN"] = am.group(2)
        if callable(op):  # a peer library call (no reference op: its own first output is the check)
            cu, ref = op, op
        else:
            cu = impl[op].get("cuda")
            ref = impl[op]["reference"]
        if cu is None:
            print(f"| {case_name} | (no cuda kernel) |")
            continue
        arg_sets = args if isinstance(args, list) else [args]
        args = arg_sets[0]
        try:
            out = cu(*args, **kw)
            want = ref(*args, **kw)
            o1 = out[0] if isinstance(out, tuple) else out
            o2 = want[0] if isinstance(want, tuple) else want
            err = 0.0 if o1.dtype == torch.int64 and torch.equal(o1, o2) else rel(o1.float(), o2.float())
            if o1.dtype == torch.int64 and not torch.equal(o1, o2):
                err = float((o1 != o2).float().mean())  # fraction of differing selections
            t_eager = bench(Rotating(cu, arg_sets, kw))
            t = bench_graph(Rotating(cu, arg_sets, kw)) or t_eager
            tr = float("nan") if a.no_reference else bench(Rotating(ref, arg_sets, kw), 3, 20)
        except torch.cuda.OutOfMemoryError:
            print(f"| {case_name} | OOM |", flush=True)
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # a variant that fails to compile or run: say so, keep the other rows
            print(f"| {case_name} | error: {type(e).__name__}: {str(e)[:120]} |", flush=True)
            torch.cuda.synchronize()
            continue
        row = dict(case=case_name, op=op if isinstance(op, str) else "peer", ms=t, eager_ms=t_eager, ref_ms=tr,
                   bytes=byt, flops=fl, gbps=byt / t / 1e6,
                   hbm_pct=100 * byt / (t * 1e-3) / ceil["hbm_Bps"], tflops=fl / t / 1e9,
                   tc_pct=100 * fl / (t * 1e-3) / ceil["bf16_flops"], speedup=tr / t_eager, rel_err=err)
        rows.append(row)
        l2 = "*" if byt * len(arg_sets) < 40e6 else ""  # a working set that can stay in the 50 MB L2 across replays
        print(f"| {case_name}{l2} | {t:.4f} | {row['gbps']:.0f} | {row['hbm_pct']:.1f} | {row['tflops']:.2f} | "
              f"{row['tc_pct']:.1f} | {t_eager:.4f} | {tr:.4f} | {tr / t_eager:.1f}x | {err:.1e} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=name, ceilings=ceil, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
