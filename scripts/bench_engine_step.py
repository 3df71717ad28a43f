#!/usr/bin/env python3
"""Where a served decode step's time goes on a GPU: the engine (scheduling, sampling, detokenising) around the
runner (step context, the model, logits to the host), for the Flash-shaped 3-layer model of ``bench_decode.py``.

``LLM(...)`` with random weights (``deepseek-v4-flash`` with 3 layers: hash-routed SWA, CSA, HCA; 64 routed
experts; BF16), ``batch`` greedy requests of ``ctx`` prompt tokens each, ``--output-len`` tokens generated with
``ignore_eos``. Every engine step and every ``runner.execute_rows`` inside it is timed (wall clock; it ends with
the greedy picks and the logits the engine needs copied to the host, so it includes the device time); pure decode steps (every request adds one
token) are kept. Printed per batch: engine ms/step, runner ms/step (of which ``prepare``: the host time up to the
launch, ``runner.last_prepare_s``), engine-only ms (sampling, detokenising, scheduling: step - execute), output tokens/s.

Usage: python scripts/bench_engine_step.py [--batches 1,8,32,64] [--ctx 2048] [--output-len 24] [--enforce-eager]
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


def make_llm(max_batch: int, ctx: int, out_len: int, device: str, eager: bool, toy: bool) -> LLM:
    model, over = ("toy-v4", {}) if toy else ("deepseek-v4-flash", FLASH3)
    return LLM(model, config_overrides=over, device=device, dtype="bfloat16", max_num_seqs=max_batch,
               max_model_len=ctx + out_len + max_batch + 16, max_num_batched_tokens=max(2048, max_batch), enforce_eager=eager,
               progress=False)


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
    vocab = llm.cfg.vocab_size
    prompts = [[3 + (i * 131 + j * 17 + batch) % (vocab - 3) for j in range(ctx)] for i in range(batch)]
    # prompts are prefilled one step each (max_num_batched_tokens = ctx): the first request decodes while the
    # others prefill, so each generates ``batch`` more tokens to leave ``out_len`` steps that decode them all
    out_len += batch
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        setattr(runner, name, orig_exec)
        engine.step = orig_step
    assert all(len(o.token_ids) == out_len for o in outs)
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
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"# {name}; Flash-shaped 3-layer V4, bf16, prompts of {a.ctx} tokens, {a.output_len} greedy tokens, "
          f"{'eager' if a.enforce_eager else 'CUDA-graph'} decode")
    print("| batch | decode steps | graph replays | engine ms/step | runner.execute ms | of which prepare ms | "
          "engine-only ms | output tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    batches = [int(x) for x in a.batches.split(",")]
    llm = make_llm(max(batches), a.ctx, a.output_len, a.device, a.enforce_eager, a.toy)  # max_num_batched_tokens 2048
    for b in batches:
        r = run(llm, b, a.ctx, a.output_len)
        print(f"| {b} | {r['steps']} | {r['replays']} | {r['step_ms']:.2f} | {r['exec_ms']:.2f} | {r['prep_ms']:.2f} | "
              f"{r['eng_ms']:.2f} | {r['tok_s']:.0f} |", flush=True)
        if r["failed"]:
            print(f"# graph buckets that could not be captured (ran eagerly): {r['failed']}", flush=True)


if __name__ == "__main__":
    main()
