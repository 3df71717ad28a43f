#!/usr/bin/env python3
"""Decode-step benchmark of a DeepSeek-V4-Flash-shaped model through the project's ModelRunner on a GPU.

Model: Flash dimensions (dim 4096, 64 heads x 512, q_lora 1024, o 8 x 1024, indexer 64 x 128 top-512,
hc 4 x 20 Sinkhorn iterations, vocabulary 129280) with 3 layers: a hash-routed sliding-window layer, a CSA
layer (ratio 4 with the indexer) and an HCA layer (ratio 128); 64 routed experts (top-6, inter 2048) plus
the shared expert. Random weights (std fan_in^-1/2) initialised on the device, as BF16 or with the official
formats kept: FP8-e4m3 128x128 block-scaled attention and shared-expert linears, FP4-e2m1 routed experts.

Every sequence of a batch starts with ``ctx`` tokens of history (pages allocated, pools filled with random
values; the compressor pools hold random entries), then decode steps run through ``ModelRunner.step`` (the
same call the engine makes): step context built on the host, the model, the logits of the new token.

Reported per (format, batch, ctx): ms/step (median of ``--steps`` after warm-up), tokens/s, and the HBM floor:
the bytes a step must read (every non-routed weight but the embedding table, of which a step reads one row per
token; the weights of the routed experts the step's tokens actually selected; the KV rows it reads: window 128 +
CSA top-512 entries + indexer keys of all ctx/4 entries + HCA ctx/128 entries, per sequence and layer) over the
copy bandwidth measured in the same run; the ratio
floor / measured is the "% of HBM floor". "host prepare ms" is the host time of a step before its launch
(``ModelRunner.last_prepare_s``: page allocation, then the step context in eager mode, or the compact inputs in
one pinned buffer and their upload in graph mode); scripts/bench_host_step.py splits it into pieces on a CPU.
"graph replay ms" (graph mode): the step's captured graph replayed back to back, device time only; ms/step adds
the host work of a step (prepare, launch, the logits' copy-out), which varies from run to run on a shared host.
``--modes async``: the graph steps chained as the engine runs them with ``--async-scheduling`` (greedy: step N+1
launched with step N's argmax as its input ids, on the device, before the host waits for step N), ms/step the wall
time between consecutive steps' results: the host work hides behind the device. With ``--hf`` transformers' eager
DeepseekV4ForCausalLM runs the same shapes (BF16) side by side at batch 8.

One script of about 550 lines: the model set-up, the timing loops (synchronised, chained, replay, profiles) and the
table share the runner and the byte count, and run in one process per GPU call.

Usage: python scripts/bench_decode.py [--batches 1,8,32,64] [--ctx 2048,8192] [--formats bf16,fp8] [--hf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import atb_ops  # noqa: E402
from ascend_dsv4.models import preset  # noqa: E402
from ascend_dsv4.kv.blocks import PoolSizes  # noqa: E402
from ascend_dsv4.engine.model_runner import ModelRunner, prepare_weights_for  # noqa: E402
from ascend_dsv4.models import build_model  # noqa: E402
from parallel.linear import Linear  # noqa: E402
from quant.fp4 import quant_fp4  # noqa: E402
from quant.fp8_block import dequant_fp8_block, quant_fp8_block  # noqa: E402


def flash3(n_experts: int = 64):
    return preset("deepseek-v4-flash").replace(n_layers=3, n_mtp_layers=0, n_hash_layers=1, compress_ratios=(0, 4, 128),
                                               n_routed_experts=n_experts)


@torch.no_grad()
def init_on_device_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place on the model's device (std fan_in^-1/2 for matrices, near-1 norms)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() >= 2:
            p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5, generator=g)
        elif leaf == "weight":
            p.normal_(1.0, 0.1, generator=g)
        elif leaf.endswith("_scale"):
            p.normal_(1.0, 0.2, generator=g)
        else:
            p.normal_(0.0, 0.5, generator=g)
    for mod in model.modules():  # float32-compute linears hold BF16 values, as loading the BF16 checkpoint gives
        if isinstance(mod, Linear) and mod.compute_fp32 and mod.weight.dtype == torch.float32:
            mod.weight.copy_(mod.weight.bfloat16().float())
    cfg = model.cfg
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            r = torch.rand(cfg.vocab_size, cfg.n_routed_experts, device=b.device, generator=g)
            b.copy_(r.argsort(-1)[:, : b.shape[1]])


@torch.no_grad()
def to_official_formats_(model: torch.nn.Module) -> None:
    """FP8 block-scaled attention / shared-expert linears, FP4 routed experts (kept in format); ``wo_a`` FP8 in the
    checkpoint and dequantised at load (its values on the FP8 grid; with ASCEND_DSV4_WO_A_FP8=1 the CUDA runner
    stores it back in FP8)."""
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.keep_checkpoint_format and (".attn." in name or "shared_experts" in name):
            q, s = quant_fp8_block(m.weight.float())
            m.set_weight(q, s, "fp8_block")
        elif isinstance(m, Linear) and getattr(m, "fp8_compact", False) and m.fmt == "dense":
            q, s = quant_fp8_block(m.weight.float())
            m.weight.copy_(dequant_fp8_block(q, s, dtype=m.weight.dtype))
        if type(m).__name__ == "Experts":
            t = {}
            for n in ("w1", "w2", "w3"):
                w = getattr(m, n)
                qs = [quant_fp4(w[e].float()) for e in range(w.shape[0])]
                t[n] = torch.stack([q for q, _ in qs])
                t[n + "_scale"] = torch.stack([s for _, s in qs])
            m.set_weights("fp4", t)
    torch.cuda.empty_cache()


def weight_bytes(model) -> tuple[int, dict]:
    """(bytes of every parameter a decode step reads except the routed experts, {layer: bytes of one routed
    expert}). The embedding table is left out: a step reads only its batch's rows (:func:`embed_bytes`)."""
    other, per_expert = 0, {}
    for name, p in model.named_parameters():
        if ".experts." in name:
            lid = int(name.split(".")[1])
            per_expert[lid] = per_expert.get(lid, 0) + p.numel() * p.element_size() // p.shape[0]
        elif name.split(".")[0] != "embed":
            other += p.numel() * p.element_size()
    return other, per_expert


def embed_bytes(model, batch: int) -> int:
    """Bytes of the embedding rows a decode step of ``batch`` tokens reads (one row per token)."""
    w = model.embed.weight
    return batch * w.shape[-1] * w.element_size()


def kv_bytes_per_seq(cfg, ctx: int, dtype_bytes: int) -> int:
    d = cfg.head_dim * dtype_bytes
    total = 0
    for r in cfg.compress_ratios[: cfg.n_layers]:
        total += min(ctx, cfg.window_size) * d
        if r == 4:
            total += min(cfg.index_topk, ctx // 4) * d + (ctx // 4) * cfg.index_head_dim * dtype_bytes
        elif r == 128:
            total += (ctx // 128) * d
    return total


def copy_bandwidth(dev) -> float:
    import triton.testing

    a = torch.empty(256 * 1024 * 1024, dtype=torch.float32, device=dev).normal_()
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=30, return_mode="median")
    del a, b
    return 2 * 256 * 1024 * 1024 * 4 / (t * 1e-3)


def make_runner(model, cfg, batch: int, ctx: int, steps: int, dev, graphs: bool | str = False):
    B = 64
    per_seq_tok = -(-(ctx + steps + 256) // B) + 1
    sizes = PoolSizes(block_size=B, c4_block_size=64, c128_block_size=8,
                      num_blocks=batch * 8 + per_seq_tok + 8,
                      num_c4_blocks=batch * (-(-(ctx + steps) // 256) + 1),
                      num_c128_blocks=batch * (-(-(ctx + steps) // 1024) + 1))
    runner = ModelRunner(model, sizes, dev, cuda_graphs=graphs, max_graph_batch=batch)
    if graphs and runner.graphs is None and dev.type == "cpu":  # --toy smoke test: the graph path, uncaptured
        from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder

        runner.graphs = CudaGraphDecoder(runner.model, runner.pools, batch)
    seqs = []
    for _ in range(batch):
        s = runner.new_sequence()
        runner.pools.ensure(s, ctx)
        s.num_tokens = ctx
        runner.pools.trim(s)
        seqs.append(s)
    g = torch.Generator(device=dev).manual_seed(1)
    for t in runner.pools.token_tensors() if hasattr(runner.pools, "token_tensors") else []:
        t.normal_(0, 1, generator=g) if t.is_floating_point() else None
    for name in ("c4", "c4_idx", "c128"):
        t = getattr(runner.pools, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.normal_(0, 1, generator=g)
    return runner, seqs


HOST_MS: list = []


def time_decode(runner, seqs, steps: int, warmup: int, vocab: int, expert_log: list | None = None):
    """Median ms of ``runner.step`` (host + device, synchronised); the host time of the timed steps' preparation
    (``runner.last_prepare_s``: pages and the step context in eager mode; pages, the compact inputs and their
    upload in graph mode) goes to HOST_MS."""
    g = torch.Generator().manual_seed(2)
    times = []
    prep = []
    for i in range(warmup + steps):
        toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
        if expert_log is not None:
            expert_log.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(seqs, [[x] for x in toks])
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            prep.append(runner.last_prepare_s)
    HOST_MS.clear()
    HOST_MS.append(statistics.median(prep) * 1e3)
    return statistics.median(times) * 1e3


def time_async(runner, seqs, steps: int, warmup: int, vocab: int) -> float:
    """Median ms per step of the engine's ``--async-scheduling`` decode loop on the runner alone
    (``engine/overlap.py``): step N+1 is launched from its captured graph, its input ids step N's argmax fed on the
    device (``ModelRunner.launch_greedy(after=...)``), before the host waits for step N (``collect``); the
    pages for the next position are allocated while the device runs. Wall time between consecutive collects:
    the pace a greedy batch decodes at when the host work hides behind the device. Needs graph mode (None
    launched: a ValueError)."""
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
    torch.cuda.synchronize()
    prev = runner.launch_greedy(seqs, [[x] for x in toks])
    if prev is None:
        raise ValueError("async mode: the runner launched no captured graph step (graph mode needed)")
    times, prep, last = [], [], None
    for i in range(warmup + steps):
        for s in seqs:  # prev's token is computed (its value stays on the device), as AsyncDecode advances them
            s.num_tokens += 1
        nxt = runner.launch_greedy(seqs, after=prev)
        if nxt is None:
            raise ValueError("async mode: a chained step could not replay its graph bucket")
        prep.append(runner.last_prepare_s)
        runner.collect(prev)
        for s in seqs:
            runner.pools.trim(s)
        t = time.perf_counter()
        if last is not None and i >= warmup:
            times.append(t - last)
        last, prev = t, nxt
    runner.collect(prev)
    for s in seqs:
        s.num_tokens += 1
    HOST_MS.clear()
    HOST_MS.append(statistics.median(prep[warmup:]) * 1e3)
    return statistics.median(times) * 1e3


def replay_ms(runner, reps: int = 30) -> float | None:
    """Median ms of the decode step's CUDA graph replayed back to back with the last staged inputs (CUDA events, no
    host work between replays): the device part of a graph step, for telling device time from host jitter in
    ms/step. None outside graph mode. Replays rewrite the same KV slots (harmless here)."""
    gr = getattr(runner, "graphs", None)
    built = [g for g in (gr.graphs.values() if gr is not None else ()) if g and g.graph is not None]
    if not built:
        return None
    g = built[-1]  # the bucket built last: the one the timed steps ended on
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


PROFILE = False
PROFILE_OPS = False


def profile_steps(runner, seqs, vocab: int, label: str, n: int = 3) -> None:
    """Device time by kernel over ``n`` decode steps (torch.profiler sees the kernels of graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    from atb_ops.cuda._util import pdl_enabled

    g = torch.Generator().manual_seed(3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            runner.step(seqs, [[int(x)] for x in torch.randint(0, vocab, (len(seqs),), generator=g)])
        torch.cuda.synchronize()
    print(f"profile ({label}, {n} steps, device time by kernel):")
    if pdl_enabled():  # (the backend's own answer: ATB_CUDA_PDL, the GPU, Triton)
        # with programmatic dependent launch a kernel starts while the one before it runs and waits on it: its span
        # then holds that wait too (session 36, h200_session36.txt: _post_kernel 66 us a step here with PDL, 18.6
        # with ATB_CUDA_PDL=0, 17.6 in --profile-ops)
        print("  (PDL on: a kernel's span can include its wait for the kernel before it; ATB_CUDA_PDL=0 for kernels' "
              "own times, or --profile-ops)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


class _Ranges:
    """Profiler ranges ("mod <name>" around every submodule's forward, "op <name>" around every atb_ops op call)
    for the duration of a ``with``: the kernels a range launches are attributed to it by time."""

    def __init__(self, model):
        self.model, self.hooks, self.saved, self.open = model, [], {}, {}

    def __enter__(self):
        from torch.profiler import record_function

        for name, mod in self.model.named_modules():
            if not name:
                continue

            def pre(m, args, name=name):
                r = record_function("mod " + name)
                r.__enter__()
                self.open.setdefault(name, []).append(r)

            def post(m, args, out, name=name):
                self.open[name].pop().__exit__(None, None, None)

            self.hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        for op in tuple(atb_ops.OPS) + tuple(atb_ops.FUSED):  # the fused forms too (hc_pre_norm, ...): the
            fn = getattr(atb_ops, op)  # innermost range names a kernel's op
            self.saved[op] = fn

            def wrapped(*a, _fn=fn, _op=op, **k):
                with record_function("op " + _op):
                    return _fn(*a, **k)

            setattr(atb_ops, op, wrapped)
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for op, fn in self.saved.items():
            setattr(atb_ops, op, fn)


def profile_ops(model, cfg, batch: int, ctx: int, dev, backend: str, label: str, n: int = 2) -> None:
    """Device time by kernel and where it comes from (the atb_ops op and the model's modules around its launch),
    for the graph path's code run uncaptured (``CudaGraphDecoder.capture`` off: the same static-buffer step, so the
    kernels are the ones a replay runs, each launch visible to the profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner, seqs = make_runner(model, cfg, batch, ctx, n + 4, dev, "static" if dev.type == "cpu" else True)
    if runner.graphs is not None:
        runner.graphs.capture = False  # the graph step's code, run op by op
    g = torch.Generator().manual_seed(3)

    def step():
        runner.step(seqs, [[int(x)] for x in torch.randint(0, cfg.vocab_size, (len(seqs),), generator=g)])

    with atb_ops.use_backend(backend):
        step()
        torch.cuda.synchronize()
        with _Ranges(model), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
    evs = prof.events()
    cpu = [ev for ev in evs if ev.device_type == DeviceType.CPU]
    # the work: (name, us, the CPU event that issued it). A kernel's correlation id is that of the runtime call
    # that launched it (cudaLaunchKernel, cuLaunchKernelEx for Triton, ...)
    if dev.type == "cpu":  # smoke test: CPU time of each aten op
        work = [(ev.name, ev.self_cpu_time_total, ev) for ev in cpu if ev.name.startswith("aten::")]
    else:
        launchers = {ev.id: ev for ev in cpu if ev.name.startswith("cu")}
        work = [(ev.name, ev.time_range.elapsed_us(), launchers.get(ev.id)) for ev in evs
                if ev.device_type == DeviceType.CUDA and not ev.name.startswith(("mod ", "op "))]  # not the ranges
    # the ranges open around each issuing event, by time (a sweep over nested intervals; the runtime calls'
    # parent links are not reliable across the profiler's thread ids)
    ranges = sorted((ev for ev in cpu if ev.name.startswith(("mod ", "op "))), key=lambda e: e.time_range.start)
    issuers = sorted({id(w[2]): w[2] for w in work if w[2] is not None}.values(), key=lambda e: e.time_range.start)
    where, stack, i = {}, [], 0
    for ev in issuers:
        t = ev.time_range.start
        while i < len(ranges) and ranges[i].time_range.start <= t:
            stack.append(ranges[i])
            i += 1
        stack = [f for f in stack if f.time_range.end >= t]
        ops = [f.name[3:] for f in stack if f.name.startswith("op ")]
        mods = [f.name[4:] for f in stack if f.name.startswith("mod ")]
        where[id(ev)] = f"{ops[-1] if ops else '-'} in {mods[-1] if mods else '(no module)'}"
    agg: dict = {}
    for name, us, ev in work:
        a = agg.setdefault((name, where.get(id(ev), "?")), [0.0, 0])
        a[0] += us
        a[1] += 1
    rows = [(v[0] / n, v[1] // n, k[0], k[1]) for k, v in agg.items()]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"op profile ({label}, graph path uncaptured, {n} steps; per step: device us, kernels, kernel, op in module):")
    print(f"  total device time {total / 1e3:.3f} ms per step, {sum(r[1] for r in rows)} kernels; "
          f"{sum(w[2] is not None for w in work)} of {len(work)} matched to the call that launched them")
    by_site: dict = {}
    for us, cnt, key, site in rows:
        op, _, mod = site.partition(" in ")
        k = (op, ".".join(p for p in mod.split(".") if not p.isdigit()))
        by_site[k] = [by_site.get(k, [0, 0])[0] + us, by_site.get(k, [0, 0])[1] + cnt]
    print("  by op and module (layers summed):")
    for (op, mod), (us, cnt) in sorted(by_site.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:9.1f} us {cnt:4d} kernels  {op:22s} {mod}")
    print("  by kernel (the 40 longest, then every kernel launched outside an atb_ops op: the glue):")
    for us, cnt, key, site in rows[:40] + [r for r in rows[40:] if r[3].startswith("- in")]:
        print(f"  {us:9.1f} us {cnt:4d}x {key[:40]:40s} {site[:120]}")


def bench_ours(fmt: str, batches, ctxs, steps, warmup, dev, bw, rows, backend, toy=False, modes=("eager",)):
    cfg = preset("toy-v4").replace(n_mtp_layers=0, compress_ratios=(0, 0, 4, 128, 4, 128, 4)) if toy else flash3()
    torch.manual_seed(0)
    model = build_model(cfg, torch.bfloat16, "exact").to(dev).eval()
    init_on_device_(model)
    if fmt == "fp8":
        to_official_formats_(model)
    prepare_weights_for(model, dev, backend)  # as the runner does: weights are counted as stored
    other, per_expert = weight_bytes(model)
    picked: dict[int, set] = {}

    def hook(mod, inp, out, lid):
        picked.setdefault(lid, set()).update(out[1].reshape(-1).tolist())

    for ctx in ctxs:
        for batch in batches:
            act = None
            for mode in modes:
                graphs = mode in ("graph", "async")
                try:
                    runner, seqs = make_runner(model, cfg, batch, ctx, warmup + steps + 2, dev, graphs)
                    with atb_ops.use_backend(backend):
                        if act is None:  # one eager step with a routing hook: the experts a step reads
                            picked.clear()
                            hs = [blk.ffn.gate.register_forward_hook(lambda m, i, o, lid=lid: hook(m, i, o, lid))
                                  for lid, blk in enumerate(model.layers)]
                            with torch.inference_mode():
                                ids, c = runner.prepare(seqs, [[7 + i] for i in range(batch)])
                                model(ids, c)
                            for h in hs:
                                h.remove()
                            act = {lid: len(v) for lid, v in picked.items()}
                            runner.commit(seqs, c)
                        if mode == "async":
                            ms = time_async(runner, seqs, steps, warmup, cfg.vocab_size)
                        else:
                            ms = time_decode(runner, seqs, steps, warmup, cfg.vocab_size)
                        rep = replay_ms(runner) if graphs else None
                        if PROFILE and mode == "graph":
                            profile_steps(runner, seqs, cfg.vocab_size, f"{fmt} batch {batch} ctx {ctx}")
                        if PROFILE_OPS and mode == "graph":
                            del runner, seqs
                            torch.cuda.empty_cache()
                            profile_ops(model, cfg, batch, ctx, dev, backend, f"{fmt} batch {batch} ctx {ctx}")
                            runner = seqs = None
                except torch.cuda.OutOfMemoryError:
                    print(f"| ours ({backend}, {mode}) | {fmt} | {batch} | {ctx} | OOM |", flush=True)
                    torch.cuda.empty_cache()
                    continue
                byt = (other + embed_bytes(model, batch) + sum(per_expert[l] * act.get(l, 0) for l in per_expert)
                       + batch * kv_bytes_per_seq(cfg, ctx, 2))
                floor = byt / bw * 1e3
                row = dict(impl=f"ours-{backend}-{mode}", fmt=fmt, batch=batch, ctx=ctx, ms=ms, host_prepare_ms=HOST_MS[0],
                           tok_s=batch / ms * 1e3, bytes=byt, floor_ms=floor, pct_floor=100 * floor / ms, experts=act,
                           replay_ms=rep)
                rows.append(row)
                rp = "" if rep is None else f"{rep:.2f} ({100 * floor / rep:.1f} %)"
                print(f"| ours ({backend}, {mode}) | {fmt} | {batch} | {ctx} | {ms:.2f} | {row['tok_s']:.0f} | "
                      f"{byt / 1e9:.2f} | {floor:.2f} | {row['pct_floor']:.1f} | {HOST_MS[0]:.2f} | {rp} |", flush=True)
                del runner, seqs
                torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


@torch.no_grad()
def bench_hf(batch: int, ctx: int, steps: int, warmup: int, dev, rows):
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401

        sys.path.insert(0, os.path.join(ROOT, "tests", "v4"))
        from hf_oracle import hf_config
    except ImportError as e:
        print(f"| transformers eager | bf16 | {batch} | {ctx} | not available: {e} |")
        return
    from transformers import DeepseekV4ForCausalLM

    cfg = flash3()
    with torch.device(dev):
        model = DeepseekV4ForCausalLM(hf_config(cfg)).to(torch.bfloat16).eval()
    g = torch.Generator(device=dev).manual_seed(0)
    for name, p in model.named_parameters():
        p.normal_(0, (p.shape[-1] ** -0.5) if p.dim() >= 2 else 0.1, generator=g) if p.dim() >= 2 else p.normal_(1.0, 0.1, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device=dev, generator=g)
    try:
        out = model(input_ids=ids, use_cache=True)
        pkv = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ms = statistics.median(times) * 1e3
        rows.append(dict(impl="transformers-eager", fmt="bf16", batch=batch, ctx=ctx, ms=ms, tok_s=batch / ms * 1e3))
        print(f"| transformers eager | bf16 | {batch} | {ctx} | {ms:.2f} | {batch / ms * 1e3:.0f} | | | |", flush=True)
    except torch.cuda.OutOfMemoryError:
        print(f"| transformers eager | bf16 | {batch} | {ctx} | OOM |", flush=True)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ctx", default="2048,8192")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--backends", default="cuda", help="comma list of atb_ops backends to time (cuda, reference)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--modes", default="eager,graph",
                    help="eager, graph (CUDA-graph-captured decode, each step synchronised) and / or async (graph "
                         "steps chained as with --async-scheduling: the next launched before the host waits)")
    ap.add_argument("--hf", action="store_true", help="also time transformers eager (bf16, batch 8)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="the toy model instead (smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="print a per-kernel device-time profile (graph mode; with PDL on, spans include waits)")
    ap.add_argument("--profile-ops", action="store_true",
                    help="print device time by torch op and source line (graph mode's code, run uncaptured)")
    a = ap.parse_args()
    global PROFILE, PROFILE_OPS
    PROFILE = a.profile
    PROFILE_OPS = a.profile_ops
    dev = torch.device(a.device)
    if dev.type == "cpu":  # smoke test only
        torch.cuda.synchronize = lambda *args: None
    bw = copy_bandwidth(dev) if dev.type == "cuda" else 1e10
    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print("| impl | weights | batch | ctx | ms/step | tok/s | bytes/step GB | HBM floor ms | % of floor | "
          "host prepare ms | graph replay ms (% of floor) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    rows: list = []
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [int(x) for x in a.ctx.split(",")]
    for backend in a.backends.split(","):
        for fmt in a.formats.split(","):
            bench_ours(fmt, batches, ctxs, a.steps, a.warmup, dev, bw, rows, backend, a.toy, tuple(a.modes.split(",")))
    if a.hf:
        for ctx in ctxs:
            bench_hf(8, ctx, a.steps, a.warmup, dev, rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"), copy_Bps=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
