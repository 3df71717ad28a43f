#!/usr/bin/env python3
"""Batch-invariance experiment (issue 10 item 6) and the cost of batch-invariant mode.

Greedy-decodes ``--prompts`` random-token prompts (lengths spread evenly over 1..``--max-len``) for
``--new-tokens`` tokens three ways: all submitted together with ``max_num_seqs`` = ``--seqs`` (32), each
alone, and together with ``max_num_seqs`` = ``--seqs-small`` (8). Prints how many prompts' outputs differ
between the runs and the output tokens/s of each run, for the default ops and (``--mode both``) for
``batch_invariant=True``; ``--mode`` picks one. Timings share the machine with whatever else runs: compare the
two modes of the same invocation (each timed run is repeated ``--repeat`` times; the best is printed).

Usage: python scripts/batch_invariance.py [--prompts 64] [--max-len 513] [--new-tokens 16] [--dtype bfloat16]
       [--device cpu|cuda] [--mode both|default|invariant] [--skip-alone]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_dsv4 import LLM, SamplingParams  # noqa: E402


def make_prompts(n: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1 + (i * (max_len - 1)) // max(n - 1, 1) for i in range(n)]
    return [[rng.randrange(1, vocab) for _ in range(length)] for length in lens]


def run(llm: LLM, prompts, params, alone: bool, repeat: int) -> tuple[list[list[int]], float]:
    best, outs = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = [llm.generate([p], params)[0] for p in prompts] if alone else llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t0)
        outs = [list(o.token_ids) for o in res]
    return outs, best


def experiment(args, invariant: bool) -> dict:
    kw = dict(model=args.model, dtype=args.dtype, device=args.device, progress=False, batch_invariant=invariant,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    big = LLM(max_num_seqs=args.seqs, **kw)
    prompts = make_prompts(args.prompts, args.max_len, big.cfg.vocab_size)
    n_out = args.prompts * args.new_tokens
    batched, t_b = run(big, prompts, params, False, args.repeat)
    res = {"mode": "batch_invariant" if invariant else "default", "batched_tok_s": n_out / t_b}
    small = LLM(max_num_seqs=args.seqs_small, **kw)
    small_out, t_s = run(small, prompts, params, False, args.repeat)
    res["seqs_small_tok_s"] = n_out / t_s
    res[f"differ_max_num_seqs_{args.seqs_small}_vs_{args.seqs}"] = sum(a != b for a, b in zip(small_out, batched))
    if not args.skip_alone:
        alone, t_a = run(big, prompts, params, True, 1)
        res["alone_tok_s"] = n_out / t_a
        res["differ_alone_vs_batched"] = sum(a != b for a, b in zip(alone, batched))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="toy-v4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=513)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seqs-small", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--mode", choices=("both", "default", "invariant"), default="both")
    ap.add_argument("--skip-alone", action="store_true", help="skip the one-prompt-at-a-time run")
    args = ap.parse_args()
    modes = {"both": (False, True), "default": (False,), "invariant": (True,)}[args.mode]
    results = [experiment(args, m) for m in modes]
    for r in results:
        print(json.dumps(r))
    if len(results) == 2:
        d, b = results
        print(f"batch-invariant / default output tokens/s: batched {b['batched_tok_s'] / d['batched_tok_s']:.2f}, "
              f"max_num_seqs={args.seqs_small} {b['seqs_small_tok_s'] / d['seqs_small_tok_s']:.2f}"
              + ("" if args.skip_alone else f", alone {b['alone_tok_s'] / d['alone_tok_s']:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
