#!/usr/bin/env python3
"""MTP speculation's cost per step on a GPU: the Flash-shaped model of ``bench_decode.py`` (3 layers) with one MTP
module, FP8 + FP4 (or BF16) weights, every sequence ``ctx`` tokens of history.

A speculative step is what the engine runs for a batch of decoding requests with one draft each
(engine/engine.py): ``ModelRunner.execute_rows`` over [x, draft] of every sequence (2 rows a sequence, the greedy
picks on the device), the commit (the draft accepted: 2 positions; rejected: 1), then ``ModelRunner.draft`` (the
MTP module over the committed positions; the greedy drafts' argmax copied to the host, as MTPDrafter does). Timed
per mode: ``graph`` (both replay captured graphs, engine/cuda_graphs.py) and ``eager``; beside it the plain graph
decode step (one token a sequence, ``ModelRunner.step``) of the same runner. ms are medians of synchronised host
wall time (host work included, as the engine sees it).

Speculation pays when (1 + acceptance) x plain / spec > 1: the break-even acceptance printed is spec / plain - 1
(with the drafts rejected). With 3 main layers the MTP module and its head are a large share of a step; the full
model's 43 layers (Flash) make it a smaller one.

Usage: python scripts/bench_spec_decode.py [--batches 1,8,32] [--ctx 2048] [--format fp8|bf16] [--modes graph,eager]
``--device cpu --toy``: a smoke run of this script (the graph path uncaptured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import atb_ops  # noqa: E402
from ascend_dsv4.engine.model_runner import prepare_weights_for  # noqa: E402
from ascend_dsv4.kv.blocks import SeqBlocks  # noqa: E402
from ascend_dsv4.models import build_model, preset  # noqa: E402
from bench_decode import flash3, init_on_device_, make_runner, time_decode, to_official_formats_  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def spec_steps(runner, seqs, steps: int, warmup: int, vocab: int, accept: bool) -> float:
    """Median ms of a speculative step (verification + commit + draft), every draft accepted or every one rejected."""
    g = torch.Generator().manual_seed(3)
    b, times = len(seqs), []
    counts = [2 if accept else 1] * b
    hrows = torch.cat([torch.arange(2 * i, 2 * i + c) for i, c in enumerate(counts)])
    for i in range(warmup + steps):
        toks = torch.randint(0, vocab, (b, 2), generator=g).tolist()
        nxt = torch.randint(0, vocab, (sum(counts),), generator=g).tolist()
        _sync(runner.device)
        t0 = time.perf_counter()
        out = runner.execute_rows(seqs, toks, list(range(2 * b)), [])
        starts = [s.num_tokens for s in seqs]
        for s, c in zip(seqs, counts):
            s.num_tokens += c
        lg = runner.draft([SeqBlocks(s.token, s.c4, s.c128, st) for s, st in zip(seqs, starts)], counts, nxt,
                          out.hidden, hrows, on_device=True)
        torch.argmax(lg, -1).tolist()  # the greedy drafts, as MTPDrafter takes them
        for s in seqs:
            runner.pools.trim(s)
        _sync(runner.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--format", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--toy", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.cuda.synchronize = lambda *args: None  # time_decode synchronises
    # the MTP module attends over its sliding window (compress ratio 0), as DeepSeek-V4's
    cfg = preset("toy-v4") if a.toy else flash3().replace(n_mtp_layers=1, compress_ratios=(0, 4, 128, 0))
    torch.manual_seed(0)
    model = build_model(cfg, torch.bfloat16, "exact").to(dev).eval()
    init_on_device_(model)
    if a.format == "fp8" and not a.toy:
        to_official_formats_(model)
    prepare_weights_for(model, dev, None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    what = "toy-v4 (smoke run)" if a.toy else f"Flash-shaped 3 layers + 1 MTP module, {a.format} weights"
    print(f"# {name}; {what}, ctx {a.ctx}; ms per step (median)")
    print("| mode | batch | plain decode (graph) | spec step, drafts accepted | rejected | break-even acceptance |")
    print("|---|---:|---:|---:|---:|---:|", flush=True)
    n = a.warmup + a.steps
    for batch in [int(x) for x in a.batches.split(",")]:
        plain = None
        for mode in a.modes.split(","):
            graphs = mode == "graph"
            with atb_ops.use_backend("cuda" if dev.type == "cuda" else "reference"):
                runner, seqs = make_runner(model, cfg, batch, a.ctx, 3 * n + 8, dev, graphs)
                if graphs and runner.graphs is not None:
                    runner.graphs.allow_rows(2 * batch)
                    plain = time_decode(runner, seqs, a.steps, a.warmup, cfg.vocab_size)
                acc = spec_steps(runner, seqs, a.steps, a.warmup, cfg.vocab_size, True)
                rej = spec_steps(runner, seqs, a.steps, a.warmup, cfg.vocab_size, False)
            used = "" if not graphs else f" ({runner.graphs.replays} replays)"
            be = "" if plain is None else f"{rej / plain - 1:.2f}"
            print(f"| {mode}{used} | {batch} | {'' if plain is None else f'{plain:.2f}'} | {acc:.2f} | {rej:.2f} | "
                  f"{be} |", flush=True)
            del runner, seqs
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
