#!/usr/bin/env python3
"""The engine's own host time per decode step, with the model replaced by an instant fake (any CPU machine).

``LLM("toy-v4")`` on the CPU; ``ModelRunner.execute_rows`` is replaced by a function that returns a greedy pick for
every row at once, so that each engine step's time is what the engine itself does around the model: scheduling,
page allocation, appending tokens, detokenising, stop checks, building the step's ``RequestOutput``s. ``batch``
greedy requests of 64 prompt tokens generate ``--output-len`` tokens each (``ignore_eos``); printed: the median
thread CPU time of the last 50 decode steps (CPU time, not wall time: a shared host's steal time stays out), i.e.
the engine's cost per step near the end of outputs that long.

Usage: python scripts/bench_engine_host.py [--batch 64] [--output-len 200,6000]
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

from ascend_dsv4 import LLM, SamplingParams  # noqa: E402
from ascend_dsv4.engine.model_runner import StepLogits  # noqa: E402


def engine_ms(batch: int, out_len: int) -> float:
    llm = LLM("toy-v4", device="cpu", dtype="bfloat16", max_num_seqs=batch, max_model_len=out_len + 128,
              max_num_batched_tokens=max(2048, batch), config_overrides=dict(max_position_embeddings=out_len + 128),
              progress=False)
    vocab = llm.cfg.vocab_size

    def fake(seqs, tokens, rows, full_rows):  # the model's place: a pick for every row, no logits rows
        return StepLogits(torch.zeros(len(full_rows), vocab), sorted(full_rows),
                          [(7 * i + 11) % vocab for i in range(len(rows))], [], None)

    llm.runner.execute_rows = fake
    times, step = [], llm.engine.step

    def timed():
        t = time.thread_time()
        out = step()
        times.append(time.thread_time() - t)
        return out

    llm.engine.step = timed
    prompts = [[3 + (i * 131 + j * 17) % (vocab - 3) for j in range(64)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return 1e3 * statistics.median(times[-50:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--output-len", default="200,6000")
    a = ap.parse_args()
    print("| batch | output tokens | engine host ms / decode step (thread CPU time, median of the last 50) |")
    print("|---:|---:|---:|")
    for n in (int(x) for x in a.output_len.split(",")):
        print(f"| {a.batch} | {n} | {engine_ms(a.batch, n):.3f} |", flush=True)


if __name__ == "__main__":
    main()
