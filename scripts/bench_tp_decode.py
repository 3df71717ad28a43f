#!/usr/bin/env python3
"""Decode throughput under tensor / expert parallelism: the Flash-shaped decode step of ``bench_decode.py`` on
``--tp`` GPUs of one host (one process per GPU, NCCL), TP only or TP + EP.

Every rank builds its share of the 3-layer Flash-shaped model (``build_model(..., parallel=state)``, random
weights drawn with the same seed on every rank, so the replicated router agrees), fills ``ctx`` tokens of history
per sequence and runs decode steps through ``ModelRunner.step``: CUDA-graph-captured per rank (each rank captures
the same buckets in lockstep, the NCCL collectives inside the graphs; what the mp executor's ranks do since
ModelRunner.replay_decode is mirrored), or eager with ``--enforce-eager``. Reported per (layout, batch): ms/step (median; all ranks step together since the collectives meet),
tokens/s, the share of a step's time the GPU spends in NCCL kernels (torch.profiler: device time of kernels whose
name contains "nccl", over 3 steps after a throw-away profiled step, the smallest over the ranks; a collective also waits for
the slowest rank, which this counts as communication), and the HBM floor of the per-GPU bytes: the bytes the busiest rank must read in a step (its
non-routed weight slices (of the embedding, the batch's rows only), its slices / whole experts of the routed experts the step selected, the KV rows its heads
read: the KV is replicated, so every rank reads all of them) over the copy bandwidth measured in the same run.

Usage (a host with N >= TP GPUs): python scripts/bench_tp_decode.py --tp 1,2,4 [--ep] [--batches 8,32,128]
``--ep`` adds an EP layout (experts partitioned, TP attention) for every TP size > 1. ``--device cpu --toy --backend reference``:
a smoke run of this script on CPU processes (gloo) with the toy model.
Keep NVLink multicast off where the host requires it (NCCL_NVLS_ENABLE=0 is set here for every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_ms(runner, seqs, vocab: int, n: int = 3) -> float:
    """Device ms per step spent in NCCL kernels over ``n`` decode steps (0 without CUDA).

    The profiler's first start in a process (CUPTI's initialisation) takes a variable time; a rank that starts
    early can see its first collectives wait for the late one, and that wait counts as NCCL kernel time (the likely
    reading of session 9's TP 2 batch-8 row: 76 ms "in" a 1.5 ms step, rank 0 only; with the two measures below the
    same row read 0.08 ms in session 14). So a first profiled step is thrown away (the ranks meet again in it), and
    the caller takes the smallest share over the ranks: the rank that waits least is the closest to the transfer
    time."""
    if not torch.cuda.is_available() or runner.device.type != "cuda":
        return 0.0
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(3)

    def step():
        runner.step(seqs, [[int(x)] for x in torch.randint(0, vocab, (len(seqs),), generator=g)])

    with profile(activities=[ProfilerActivity.CUDA]):  # the throw-away start
        step()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    us = 0.0
    for e in prof.key_averages():
        if "nccl" in e.key.lower():
            us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return us / 1e3 / n


def rank_main(rank: int, world: int, ep: bool, args, port: int, out_path: str) -> None:
    import torch.distributed as dist

    import atb_ops
    from bench_decode import (copy_bandwidth, embed_bytes, flash3, init_on_device_, kv_bytes_per_seq, make_runner,
                              time_decode, to_official_formats_, weight_bytes)

    from ascend_dsv4.engine.model_runner import prepare_weights_for
    from ascend_dsv4.models import build_model, preset
    from parallel.groups import destroy_parallel, init_parallel, set_rank_device

    torch.set_num_threads(max(1, 16 // world))
    dev = torch.device("cpu") if args.device == "cpu" else torch.device(args.device, rank)
    set_rank_device(dev)
    if dev.type == "cpu":
        torch.cuda.synchronize = lambda *a: None
    state = init_parallel(world, rank, f"tcp://127.0.0.1:{port}", device=dev.type, enable_expert_parallel=ep,
                          timeout_s=600)
    rows = []
    try:
        cfg = (preset("toy-v4").replace(n_mtp_layers=0, compress_ratios=(0, 0, 4, 128, 4, 128, 4)) if args.toy
               else flash3(args.experts))
        torch.manual_seed(0)
        model = build_model(cfg, torch.bfloat16, "exact", state).to(dev).eval()
        init_on_device_(model, seed=0)  # same draws on every rank: the replicated router agrees
        if args.format == "fp8":
            to_official_formats_(model)
        prepare_weights_for(model, dev, None)  # as the runner does: weights are counted as stored
        other, per_expert = weight_bytes(model)  # this rank's slices; per local expert
        n_local = cfg.n_routed_experts // (world if ep else 1)
        first = rank * n_local if ep else 0
        bw = copy_bandwidth(dev) if dev.type == "cuda" else 1e10
        picked: dict[int, set] = {}

        def hook(mod, inp, out, lid):
            picked.setdefault(lid, set()).update(out[1].reshape(-1).tolist())

        for batch in args.batches:
            runner, seqs = make_runner(model, cfg, batch, args.ctx, args.warmup + args.steps + 8, dev,
                                       not args.enforce_eager)
            with atb_ops.use_backend(args.backend), torch.inference_mode():
                picked.clear()
                hs = [blk.ffn.gate.register_forward_hook(lambda m, i, o, lid=lid: hook(m, i, o, lid))
                      for lid, blk in enumerate(model.layers)]
                ids, c = runner.prepare(seqs, [[7 + i] for i in range(batch)])
                model(ids, c)
                for h in hs:
                    h.remove()
                runner.commit(seqs, c)
                local = {lid: sum(first <= e < first + n_local for e in v) for lid, v in picked.items()}
                dist.barrier()
                ms = time_decode(runner, seqs, args.steps, args.warmup, cfg.vocab_size)
                comm = _nccl_ms(runner, seqs, cfg.vocab_size)
            byt = (other + embed_bytes(model, batch) + sum(per_expert[lid] * local.get(lid, 0) for lid in per_expert)
                   + batch * kv_bytes_per_seq(cfg, args.ctx, 2))
            gr = runner.graphs  # did this batch's steps replay a captured graph (a failed capture runs eagerly)?
            captured = gr is not None and any(v is not False and v.graph is not None for v in gr.graphs.values())
            rows.append(dict(rank=rank, batch=batch, ms=ms, comm_ms=comm, bytes=byt, floor_ms=byt / bw * 1e3, bw=bw,
                             captured=captured))
            del runner, seqs
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(gathered, f)
    finally:
        destroy_parallel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes (one process per GPU each)")
    ap.add_argument("--ep", action="store_true", help="also TP + EP for every TP size > 1")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--enforce-eager", action="store_true", help="eager decode steps (no CUDA graphs)")
    ap.add_argument("--toy", action="store_true")
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    a = ap.parse_args()
    a.batches = [int(x) for x in a.batches.split(",")]
    n_dev = torch.cuda.device_count() if a.device == "cuda" else 64
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    layouts = []
    for tp in (int(x) for x in a.tp.split(",")):
        if tp > n_dev:
            print(f"# TP {tp}: skipped, {n_dev} GPU(s) visible")
            continue
        layouts.append((tp, False))
        if a.ep and tp > 1:
            layouts.append((tp, True))
    mode = "eager" if a.enforce_eager else "CUDA-graph"
    print(f"# {name} x {n_dev}; Flash-shaped 3-layer decode, {a.format} weights, ctx {a.ctx}, {mode} steps")
    print("| layout | GPUs | batch | steps | ms/step | tok/s | NCCL ms (share) | per-GPU bytes GB | HBM floor ms | "
          "% of floor |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    every = []
    for tp, ep in layouts:
        out = os.path.join("/tmp", f"bench_tp_{os.getpid()}_{tp}_{int(ep)}.json")
        mp.spawn(rank_main, args=(tp, ep, a, _free_port(), out), nprocs=tp, join=True)
        with open(out) as f:
            per_rank = json.load(f)
        for i, batch in enumerate(a.batches):
            rs = [r[i] for r in per_rank]
            ms = statistics.median(r["ms"] for r in rs)
            comm = min(r["comm_ms"] for r in rs)  # the rank that waits least (see _nccl_ms)
            busiest = max(rs, key=lambda r: r["bytes"])
            floor = busiest["floor_ms"]
            label = f"TP {tp}" + (" + EP" if ep else "")
            steps = "graph" if all(r.get("captured") for r in rs) else "eager"
            print(f"| {label} | {tp} | {batch} | {steps} | {ms:.2f} | {batch / ms * 1e3:.0f} | {comm:.2f} ({100 * comm / ms:.0f} %) | "
                  f"{busiest['bytes'] / 1e9:.2f} | {floor:.2f} | {100 * floor / ms:.1f} |", flush=True)
            every.append(dict(layout=label, gpus=tp, batch=batch, steps=steps, ms=ms, comm_ms=comm,
                              comm_ms_ranks=[r["comm_ms"] for r in rs], bytes=busiest["bytes"],
                              floor_ms=floor, device=name))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(every, f, indent=1)


if __name__ == "__main__":
    main()
