#!/usr/bin/env python3
"""Where a served decode step's time goes on a GPU: the engine (scheduling, sampling, detokenising) around the
runner (step context, the model, logits to the host), for the Flash-shaped 3-layer model of ``bench_decode.py``.

``LLM(...)`` with random weights (``deepseek-v4-flash`` with 3 layers: hash-routed SWA, CSA, HCA; 64 routed
experts; BF16), ``batch`` greedy requests of ``ctx`` prompt tokens each, ``--output-len`` tokens generated with
``ignore_eos``. Every engine step and every ``runner.execute_rows`` inside it is timed (wall clock; it ends with
the greedy picks and the logits the engine needs copied to the host, so it includes the device time); pure decode steps (every request adds one
token) are kept. Printed per batch: engine ms/step, runner ms/step (of which ``prepare``: the host time up to the
launch, ``runner.last_prepare_s``), engine-only ms (sampling, detokenising, scheduling: step - execute), output tokens/s.

With ``--async-scheduling`` the engine launches each greedy decode step before processing the one in flight
(engine/overlap.py); then every engine step is timed whole, with the part spent waiting for the device.

With ``--tensor-parallel-size`` / ``--data-parallel-size`` / ``--enable-expert-parallel`` (the ``mp`` executor, one
GPU a rank) or ``--num-speculative-tokens 1`` (MTP; the model then has one MTP module) every engine step that gave
every request at least one token is timed whole (:func:`run_steps`): ms/step, tokens a step, output tokens/s; the
same for ``--enforce-eager``, so graph and eager steps compare under those layouts too. Under data parallelism the
step is also split into the slowest replica's round trips to its ranks (``executor.call``: pickling, pipes, the
ranks' work) and the rest, the front end's own host time.

Usage: python scripts/bench_engine_step.py [--batches 1,8,32,64] [--ctx 2048] [--output-len 24] [--enforce-eager]
       [--async-scheduling] [--tensor-parallel-size T] [--data-parallel-size D] [--enable-expert-parallel]
       [--num-speculative-tokens 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import logging

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascend_dsv4 import LLM, SamplingParams  # noqa: E402

FLASH3 = dict(n_layers=3, n_mtp_layers=0, n_hash_layers=1, compress_ratios=(0, 4, 128), n_routed_experts=64)


def make_llm(max_batch: int, ctx: int, out_len: int, device: str, eager: bool, toy: bool,
             async_scheduling: bool = False, **layout) -> LLM:
    """``layout``: tensor_parallel_size, data_parallel_size, enable_expert_parallel, num_speculative_tokens."""
    model, over = ("toy-v4", {}) if toy else ("deepseek-v4-flash", dict(FLASH3))
    if layout.get("num_speculative_tokens") and not toy:  # one MTP module (sliding window, as DeepSeek-V4's)
        over.update(n_mtp_layers=1, compress_ratios=(0, 4, 128, 0))
    if layout.get("tensor_parallel_size", 1) > 1 or layout.get("data_parallel_size", 1) > 1:
        layout.setdefault("distributed_executor_backend", "mp")
    llm = LLM(model, config_overrides=over, device=device, dtype="bfloat16", max_num_seqs=max_batch,
              max_model_len=ctx + 2 * out_len + 2 * max_batch + 16, max_num_batched_tokens=max(2048, max_batch),
              enforce_eager=eager, progress=False, async_scheduling=async_scheduling, **layout)
    if async_scheduling and toy and llm.runner.graphs is None and hasattr(llm.runner, "model"):
        # CPU smoke test in one process: the uncaptured graph path (a DP replica's runner has no local model)
        from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder

        llm.runner.graphs = CudaGraphDecoder(llm.runner.model, llm.runner.pools, max_batch)
    return llm


def generate_batch(llm: LLM, batch: int, ctx: int, out_len: int, restore) -> None:
    """``batch`` greedy requests of ``ctx`` prompt tokens, each generating ``out_len + batch`` tokens (prompts are
    prefilled one step each, max_num_batched_tokens = ctx: the first request decodes while the others prefill, so
    ``batch`` more tokens leave ``out_len`` steps that decode them all); ``restore()`` undoes the caller's timing
    hooks whatever happens."""
    vocab = llm.cfg.vocab_size
    prompts = [[3 + (i * 131 + j * 17 + batch) % (vocab - 3) for j in range(ctx)] for i in range(batch)]
    sp = SamplingParams(max_tokens=out_len + batch, temperature=0.0, ignore_eos=True)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        restore()
    assert all(len(o.token_ids) == out_len + batch for o in outs)


def run_async(llm: LLM, batch: int, ctx: int, out_len: int) -> dict:
    """Async scheduling: every engine step that produced a token for all ``batch`` requests, timed whole, and the
    part of it spent waiting for the device (``runner.collect``); the rest is host work done while the device runs
    the next step (and the launch)."""
    runner, engine = llm.runner, llm.engine
    rec: dict[str, list] = {"step": [], "wait": []}
    orig_collect, orig_step = runner.collect, engine.step
    waited = [0.0]

    def collect(p):
        t = time.perf_counter()
        out = orig_collect(p)
        waited[0] += time.perf_counter() - t
        return out

    def step():
        waited[0] = 0.0
        t = time.perf_counter()
        out = orig_step()
        dt = time.perf_counter() - t
        if sum(1 for o in out if o.delta_token_ids) == batch:
            rec["step"].append(dt)
            rec["wait"].append(waited[0])
        return out

    runner.collect, engine.step = collect, step
    graphs = runner.graphs
    replays0 = graphs.replays if graphs is not None else 0
    def restore():
        runner.collect, engine.step = orig_collect, orig_step

    generate_batch(llm, batch, ctx, out_len, restore)
    steps = rec["step"][2:-1]  # skip the first (graph capture) steps and the last (nothing launched behind it)
    waits = rec["wait"][2:-1]
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    step_ms = med(steps)
    return dict(batch=batch, steps=len(steps), replays=(graphs.replays - replays0) if graphs is not None else 0,
                step_ms=step_ms, wait_ms=med(waits), host_ms=med([s - w for s, w in zip(steps, waits)]),
                tok_s=batch / step_ms * 1e3)


def run_steps(llm: LLM, batch: int, ctx: int, out_len: int) -> dict:
    """Any engine (one process, TP / EP ranks, the data-parallel front end; with or without speculation): every
    engine step that gave each of the ``batch`` requests at least one token, timed whole (wall clock, the device
    work included); tokens counted per step (MTP: 1 or 2 a request)."""
    engine = llm.engine
    rec: list[tuple[float, int, float]] = []
    orig_step = engine.step
    # the data-parallel front end: each replica's round trips to its ranks (executor.call: pickling, pipes, the
    # ranks' work), summed per replica over the step; the step less the slowest replica's is the front end's own
    # host time (scheduling, outputs, and the replicas' threads waiting on each other for the GIL)
    executor = getattr(engine, "executor", None) if hasattr(engine, "engines") else None
    orig_call = getattr(executor, "call", None)
    trips: dict[int, float] = {}

    def call(replica, op, args):
        t = time.perf_counter()
        try:
            return orig_call(replica, op, args)
        finally:
            trips[replica] = trips.get(replica, 0.0) + time.perf_counter() - t

    def step():
        trips.clear()
        t = time.perf_counter()
        out = orig_step()
        dt = time.perf_counter() - t
        got = {}
        for o in out:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.delta_token_ids)
        if len(got) == batch and all(got.values()):
            rec.append((dt, sum(got.values()), max(trips.values(), default=0.0)))
        return out

    def restore():
        engine.step = orig_step
        if orig_call is not None:
            executor.call = orig_call

    engine.step = step
    if orig_call is not None:
        executor.call = call
    generate_batch(llm, batch, ctx, out_len, restore)
    steps = rec[2:-1]  # the first (graph capture) steps and the last (requests finishing) left out
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    step_ms = med([d for d, _, _ in steps])
    toks = statistics.mean([n for _, n, _ in steps]) if steps else float("nan")
    return dict(batch=batch, steps=len(steps), step_ms=step_ms, tok_step=toks,
                trip_ms=med([r for _, _, r in steps]), front_ms=med([d - r for d, _, r in steps]),
                tok_s=sum(n for _, n, _ in steps) / max(1e-9, sum(d for d, _, _ in steps)))


def run(llm: LLM, batch: int, ctx: int, out_len: int) -> dict:
    runner, engine = llm.runner, llm.engine
    rec: dict[str, list] = {"execute": [], "prepare": [], "step": [], "decode": []}
    name = "execute_rows" if hasattr(runner, "execute_rows") else "execute"  # the call the engine makes
    orig_exec, orig_step = getattr(runner, name), engine.step

    def execute(seqs, tokens, rows, *more):
        t = time.perf_counter()
        out = orig_exec(seqs, tokens, rows, *more)
        rec["execute"].append(time.perf_counter() - t)
        rec["prepare"].append(runner.last_prepare_s)  # host time up to the launch (pages, context / inputs)
        rec["decode"].append(len(tokens) == batch and all(len(x) == 1 for x in tokens))
        return out

    def step():
        n = len(rec["execute"])
        t = time.perf_counter()
        out = orig_step()
        if len(rec["execute"]) == n + 1:  # one forward in this step
            rec["step"].append((n, time.perf_counter() - t))
        return out

    setattr(runner, name, execute)
    engine.step = step
    graphs = runner.graphs
    replays0 = graphs.replays if graphs is not None else 0
    def restore():
        setattr(runner, name, orig_exec)
        engine.step = orig_step

    generate_batch(llm, batch, ctx, out_len, restore)
    dec = [(i, s) for i, s in rec["step"] if rec["decode"][i]][2:]  # skip the first (graph capture) steps
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    step_ms = med([s for _, s in dec])
    failed = [k for k, g in graphs.graphs.items() if g is False] if graphs is not None else []
    replays = (graphs.replays - replays0) if graphs is not None else 0
    return dict(batch=batch, steps=len(dec), step_ms=step_ms, replays=replays, failed=failed, exec_ms=med([rec["execute"][i] for i, _ in dec]),
                prep_ms=med([rec["prepare"][i] for i, _ in dec]),
                eng_ms=med([s - rec["execute"][i] for i, s in dec]), tok_s=batch / step_ms * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--toy", action="store_true", help="the toy model (smoke test of this script)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine launches each greedy decode step before processing the one in flight")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--num-speculative-tokens", type=int, default=0)
    a = ap.parse_args()
    layout = dict(tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
                  enable_expert_parallel=a.enable_expert_parallel, num_speculative_tokens=a.num_speculative_tokens)
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"# {name}; Flash-shaped 3-layer V4, bf16, prompts of {a.ctx} tokens, {a.output_len} greedy tokens, "
          f"{'eager' if a.enforce_eager else 'CUDA-graph'} decode")
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()

    def stamp(what: str) -> None:  # progress on '#' lines: a run cut by a timeout shows where it was
        print(f"# {time.perf_counter() - t0:.1f} s: {what}", flush=True)

    llm = make_llm(max(batches), a.ctx, a.output_len, a.device, a.enforce_eager, a.toy, a.async_scheduling,
                   **layout)
    stamp("engine built (weights initialised, pools sized)")
    if a.tensor_parallel_size > 1 or a.data_parallel_size > 1 or a.enable_expert_parallel or a.num_speculative_tokens:
        print(f"# layout: TP {a.tensor_parallel_size} x DP {a.data_parallel_size}"
              f"{' + EP' if a.enable_expert_parallel or a.data_parallel_size > 1 else ''}"
              f"{', MTP ' + str(a.num_speculative_tokens) if a.num_speculative_tokens else ''}"
              f"{', async scheduling' if a.async_scheduling else ''}; engine steps that gave every request a token")
        dp = a.data_parallel_size > 1
        if dp:
            print("# replica round trips: the slowest replica's calls to its ranks in the step (pickling, pipes, the "
                  "ranks' work); front end: the rest of the step (its own host work)")
        print("| batch | steps | engine ms/step |" + (" replica round trips ms | front end ms |" if dp else "")
              + " tokens/step | output tok/s |")
        print("|---:|---:|---:|" + ("---:|---:|" if dp else "") + "---:|---:|", flush=True)
        try:
            for b in batches:
                stamp(f"batch {b}: prefill, graph capture and decode")
                r = run_steps(llm, b, a.ctx, a.output_len)
                split = f" {r['trip_ms']:.2f} | {r['front_ms']:.2f} |" if dp else ""
                print(f"| {b} | {r['steps']} | {r['step_ms']:.2f} |{split} {r['tok_step']:.1f} | {r['tok_s']:.0f} |",
                      flush=True)
            stamp("done")
        finally:
            llm.shutdown()
        return
    if a.async_scheduling:
        print("# async scheduling: engine steps that gave every request a token; 'waiting' = time blocked on the "
              "device's results (runner.collect), 'host' = the rest (done while the device runs the next step)")
        print("| batch | decode steps | graph replays | engine ms/step | of which waiting ms | host ms | output tok/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        for b in batches:
            r = run_async(llm, b, a.ctx, a.output_len)
            print(f"| {b} | {r['steps']} | {r['replays']} | {r['step_ms']:.2f} | {r['wait_ms']:.2f} | "
                  f"{r['host_ms']:.2f} | {r['tok_s']:.0f} |", flush=True)
        return
    print("| batch | decode steps | graph replays | engine ms/step | runner.execute ms | of which prepare ms | "
          "engine-only ms | output tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for b in batches:
        r = run(llm, b, a.ctx, a.output_len)
        print(f"| {b} | {r['steps']} | {r['replays']} | {r['step_ms']:.2f} | {r['exec_ms']:.2f} | {r['prep_ms']:.2f} | "
              f"{r['eng_ms']:.2f} | {r['tok_s']:.0f} |", flush=True)
        if r["failed"]:
            print(f"# graph buckets that could not be captured (ran eagerly): {r['failed']}", flush=True)


if __name__ == "__main__":
    main()
