#!/usr/bin/env python3
"""Host time of one graph-mode decode step of DeepSeek-V4, measured on the CPU (no GPU, no model weights).

The host cost of a decode step depends on the batch, the context, the page sizes and the compression ratios,
not on the model's dimensions: the pools here belong to a small V4 config with the Flash window (128) and both
compressed layer kinds (ratios 4 and 128), on the CPU, with the page sizes of scripts/bench_decode.py (token
pages of 64, ratio-4 pages of 64 entries, ratio-128 pages of 8) or, with ``--pages default``, those of
``plan_pool_sizes`` (16 / 16 / 2). Every sequence starts with ``ctx`` tokens of history; each timed step adds one
token to every sequence (crossing page and entry boundaries as a real decode does). Median (and mean) over
``--steps`` steps of, per piece (time.perf_counter):

context path (the eager path, and what graph mode did before the decode fast path):
  ensure    ``V4KVPools.ensure`` of every sequence (page allocation)
  context   ``build_step_context`` -- here its device part runs on the CPU (on a GPU it is kernel launches)
  ids       the input-ids tensor
  copy-in   the ~20 copies / fills of the context into a bucket's static buffers that ``CudaGraphDecoder.run``
            made before the fast path (replicated here on CPU tensors; on a GPU each is a launch)
fast path (``ModelRunner.decode_graph``):
  ensure    as above
  stage     ``CudaGraphDecoder.stage``: the bucket, ``DecodeInputs.fill`` (numpy into the host buffer, pinned on a
            GPU) and ``upload`` (ONE copy); on a GPU the graph replay is launched next
  derive    ``derive_decode_context`` on the CPU, for information only: on a GPU it runs inside the captured graph
            (device time, no host time)
after the step:
  trim      ``num_tokens += 1`` and ``V4KVPools.trim`` of every sequence (the engine does this every step)

Usage: python scripts/bench_host_step.py [--batches 1,32,64] [--ctx 2048,8192] [--steps 300]
[--paths context,detail,fast] (``--paths context`` runs on a checkout without the fast path, for a before / after
comparison; ``detail`` splits ``build_step_context`` into its pieces, medians only).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascend_dsv4.kv.blocks import PoolSizes, SeqBlocks  # noqa: E402
from ascend_dsv4.kv.compressed_pools import V4KVPools  # noqa: E402
from ascend_dsv4.kv.context import build_step_context  # noqa: E402
from ascend_dsv4.models import preset  # noqa: E402


def host_config():
    """toy-v4 dimensions with the Flash window and one layer of each kind (ratios 0, 4, 128)."""
    return preset("toy-v4").replace(window_size=128, n_layers=3, n_mtp_layers=0, n_hash_layers=1,
                                    compress_ratios=(0, 4, 128))


def make_pools(cfg, batch: int, ctx: int, steps: int, pages: str):
    B, B4, B128 = (64, 64, 8) if pages == "bench" else (16, 16, 2)
    n = ctx + steps + 8
    sizes = PoolSizes(block_size=B, c4_block_size=B4, c128_block_size=B128,
                      num_blocks=batch * (-(-(128 + 2 * B) // B) + 2) + -(-n // B) + 8,  # live pages + one full history
                      num_c4_blocks=batch * (-(-n // (4 * B4)) + 1) + 2,
                      num_c128_blocks=batch * (-(-n // (128 * B128)) + 1) + 2)
    pools = V4KVPools(cfg, sizes, torch.bfloat16, "cpu")
    seqs = []
    for _ in range(batch):
        s = SeqBlocks()
        pools.ensure(s, ctx)
        s.num_tokens = ctx
        pools.trim(s)
        seqs.append(s)
    return pools, seqs


class OldCopyIn:
    """The static buffers of a bucket and the copies ``CudaGraphDecoder.run`` made into them before the decode
    fast path (a replica, for the 'before' measurement)."""

    def __init__(self, b: int, window: int, ratios, trash_token: int, trash_entry: dict, widths: dict):
        z = dict(dtype=torch.long)
        self.trash_token, self.trash_entry = trash_token, trash_entry
        self.ids, self.positions, self.seq_index = torch.zeros(b, **z), torch.zeros(b, **z), torch.zeros(b, **z)
        self.swa_slot, self.window = torch.zeros(b, **z), torch.zeros(b, window, **z)
        self.cc = {r: (torch.zeros(b, (2 if r == 4 else 1) * r, **z), torch.zeros(b, **z), torch.zeros(b, **z),
                       torch.zeros(b, widths[r], **z)) for r in ratios}

    def run(self, ids, ctx) -> None:
        t = ctx.num_tokens
        self.ids[:t].copy_(ids)
        self.ids[t:].zero_()
        self.positions[:t].copy_(ctx.positions)
        self.positions[t:].zero_()
        self.seq_index[:t].copy_(ctx.seq_index)
        self.swa_slot[:t].copy_(ctx.swa_slot)
        self.swa_slot[t:].fill_(self.trash_token)
        self.window[:t].copy_(ctx.window)
        self.window[t:].fill_(-1)
        for r, (cand, pos, slot, vis) in self.cc.items():
            src = ctx.compress[r]
            m, n = src.new_slot.shape[0], src.visible.shape[1]
            cand.fill_(-1)
            cand[:m].copy_(src.new_cand)
            pos[:m].copy_(src.new_pos)
            slot.fill_(self.trash_entry[r])
            slot[:m].copy_(src.new_slot)
            vis[:t, :n].copy_(src.visible)
            vis[:t, n:].fill_(-1)
            vis[t:].fill_(-1)


def context_pieces(pools, seqs, out: dict) -> None:
    """build_step_context of a decode step, piece by piece (a replica of its steps, for timing: adds the seconds
    of each piece to ``out``)."""
    from ascend_dsv4.kv.tables import logits_rows, lookup_slots, page_tables, token_positions

    def tick(name, t0):
        t = time.perf_counter()
        out[name] = out.get(name, 0.0) + t - t0
        return t

    sizes, T, B, W = pools.sizes, len(seqs), pools.sizes.block_size, pools.cfg.window_size
    t = time.perf_counter()
    lens, seq_index, positions = token_positions([s.num_tokens for s in seqs], [1] * T)
    t = tick("positions", t)
    tok_tables = page_tables([s.token for s in seqs])
    t = tick("token table", t)
    swa_slot = lookup_slots(tok_tables, seq_index, positions, B)
    bool((swa_slot < 0).any())
    t = tick("swa slot", t)
    win_pos = positions.unsqueeze(1) - (W - 1) + torch.arange(W)
    lookup_slots(tok_tables, seq_index.unsqueeze(1).expand(-1, W), win_pos, B)
    t = tick("window grid", t)
    for r, rows, page in ((4, [s.c4 for s in seqs], sizes.c4_block_size),
                          (128, [s.c128 for s in seqs], sizes.c128_block_size)):
        ent_tables = page_tables(rows)
        t = tick(f"c{r} table", t)
        kappa = 2 if r == 4 else 1
        tok = ((positions + 1) % r == 0).nonzero(as_tuple=True)[0]
        entry = (positions[tok] + 1) // r - 1
        cand_pos = entry.unsqueeze(1) * r - (kappa - 1) * r + torch.arange(kappa * r)
        lookup_slots(tok_tables, seq_index[tok].unsqueeze(1).expand_as(cand_pos), cand_pos, B)
        lookup_slots(ent_tables, seq_index[tok], entry, page)
        t = tick(f"c{r} completed", t)
        n_vis = (positions + 1) // r
        ent = torch.arange(int(n_vis.max())).unsqueeze(0).expand(T, -1)
        ent = torch.where(ent < n_vis.unsqueeze(1), ent, torch.full_like(ent, -1))
        lookup_slots(ent_tables, seq_index.unsqueeze(1).expand_as(ent), ent, page)
        t = tick(f"c{r} visible grid", t)
    logits_rows(lens, "last")
    tick("logits rows", t)


def bench_detail(cfg, batch, ctx, steps, warmup, pages):
    pools, seqs = make_pools(cfg, batch, ctx, steps + warmup, pages)
    times: dict = {}
    for i in range(warmup + steps):
        for q in seqs:
            pools.ensure(q, q.num_tokens + 1)
        out: dict = {}
        context_pieces(pools, seqs, out)
        if i >= warmup:
            for k, v in out.items():
                times.setdefault(k, []).append(v)
        for q in seqs:
            q.num_tokens += 1
            pools.trim(q)
    return times


def _bucket_width(n: int) -> int:
    try:
        from ascend_dsv4.engine.cuda_graphs import _width
    except ImportError:  # pragma: no cover
        return n
    return _width(n)


def bench_context(cfg, batch, ctx, steps, warmup, pages):
    pools, seqs = make_pools(cfg, batch, ctx, steps + warmup, pages)
    s = pools.sizes
    ratios = [4, 128]
    trash_token, trash_entry = pools.token_alloc.alloc(1)[0] * s.block_size, {
        4: pools.c4_alloc.alloc(1)[0] * s.c4_block_size, 128: pools.c128_alloc.alloc(1)[0] * s.c128_block_size}
    copy_in = {}
    times = {k: [] for k in ("ensure", "context", "ids", "copy-in", "trim")}
    for i in range(warmup + steps):
        toks = [[7 + j] for j in range(batch)]
        t0 = time.perf_counter()
        for q, tk in zip(seqs, toks):
            pools.ensure(q, q.num_tokens + len(tk))
        t1 = time.perf_counter()
        c = build_step_context(pools, seqs, [1] * batch, "last", "cpu")
        t2 = time.perf_counter()
        ids = torch.tensor([x for tk in toks for x in tk], dtype=torch.long)
        t3 = time.perf_counter()
        key = tuple((r, _bucket_width(c.compress[r].visible.shape[1])) for r in ratios)
        if key not in copy_in:
            copy_in[key] = OldCopyIn(batch, cfg.window_size, ratios, trash_token, trash_entry, dict(key))
        t3b = time.perf_counter()
        copy_in[key].run(ids, c)
        t4 = time.perf_counter()
        for q in seqs:
            q.num_tokens += 1
            pools.trim(q)
        t5 = time.perf_counter()
        if i >= warmup:
            for k, v in (("ensure", t1 - t0), ("context", t2 - t1), ("ids", t3 - t2), ("copy-in", t4 - t3b),
                         ("trim", t5 - t4)):
                times[k].append(v)
    return times


def bench_fast(cfg, batch, ctx, steps, warmup, pages):
    from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder
    from ascend_dsv4.kv.decode_inputs import derive_decode_context

    pools, seqs = make_pools(cfg, batch, ctx, steps + warmup, pages)
    dec = CudaGraphDecoder(None, pools, max_batch=batch)  # no model: stage() only (no capture on the CPU)
    times = {k: [] for k in ("ensure", "stage", "derive", "trim")}
    rows = list(range(batch))
    for i in range(warmup + steps):
        toks = [[7 + j] for j in range(batch)]
        t0 = time.perf_counter()
        key = dec.key(seqs, toks, rows)
        for q in seqs:
            pools.ensure(q, q.num_tokens + 1)
        t1 = time.perf_counter()
        g = dec.stage(seqs, toks, key)
        t2 = time.perf_counter()
        derive_decode_context(g.inputs, pools, dec.trash_token, dec.trash_entry)
        t3 = time.perf_counter()
        for q in seqs:
            q.num_tokens += 1
            pools.trim(q)
        t4 = time.perf_counter()
        if i >= warmup:
            for k, v in (("ensure", t1 - t0), ("stage", t2 - t1), ("derive", t3 - t2), ("trim", t4 - t3)):
                times[k].append(v)
    return times


def fmt(v: list) -> str:
    return f"{statistics.median(v) * 1e3:.3f} ({statistics.mean(v) * 1e3:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--ctx", default="2048,8192")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pages", default="bench", choices=("bench", "default"))
    ap.add_argument("--paths", default="context,detail,fast")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the host's own work)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = host_config()
    paths = a.paths.split(",")
    print(f"# host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{a.threads} torch thread(s); pages {a.pages}; ms per step, median (mean) of {a.steps} steps")
    if "context" in paths:
        print("\ncontext path (eager; graph mode before the fast path):")
        print("| batch | ctx | ensure | context | ids | copy-in | host prepare total | trim |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for ctx in (int(x) for x in a.ctx.split(",")):
            for b in (int(x) for x in a.batches.split(",")):
                t = bench_context(cfg, b, ctx, a.steps, a.warmup, a.pages)
                tot = [sum(x) for x in zip(t["ensure"], t["context"], t["ids"], t["copy-in"])]
                print(f"| {b} | {ctx} | {fmt(t['ensure'])} | {fmt(t['context'])} | {fmt(t['ids'])} | "
                      f"{fmt(t['copy-in'])} | {fmt(tot)} | {fmt(t['trim'])} |", flush=True)
    if "detail" in paths:
        print("\nbuild_step_context of a decode step by piece (tables: Python lists -> padded tensors, one per "
              "sequence; grids: on the step's device, here the CPU):")
        head = None
        for ctx in (int(x) for x in a.ctx.split(",")):
            for b in (int(x) for x in a.batches.split(",")):
                t = bench_detail(cfg, b, ctx, a.steps, a.warmup, a.pages)
                if head is None:
                    head = list(t)
                    print("| batch | ctx | " + " | ".join(head) + " |")
                    print("|---:|---:|" + "---:|" * len(head))
                print(f"| {b} | {ctx} | " + " | ".join(f"{statistics.median(t[k]) * 1e3:.3f}" for k in head) + " |",
                      flush=True)
    if "fast" in paths:
        print("\nfast path (graph mode: compact inputs, context derived on the device inside the graph):")
        print("| batch | ctx | ensure | stage (fill + upload) | host prepare total | trim | derive (CPU; in-graph on GPU) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for ctx in (int(x) for x in a.ctx.split(",")):
            for b in (int(x) for x in a.batches.split(",")):
                t = bench_fast(cfg, b, ctx, a.steps, a.warmup, a.pages)
                tot = [x + y for x, y in zip(t["ensure"], t["stage"])]
                print(f"| {b} | {ctx} | {fmt(t['ensure'])} | {fmt(t['stage'])} | {fmt(tot)} | {fmt(t['trim'])} | "
                      f"{fmt(t['derive'])} |", flush=True)


if __name__ == "__main__":
    main()
