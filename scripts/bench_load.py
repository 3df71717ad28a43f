#!/usr/bin/env python3
"""Checkpoint-load benchmark: peak memory and throughput on a generated real-format checkpoint.

Writes (once) a random DeepSeek-V4 checkpoint in the official format — FP8 128x128 blocks, packed FP4 experts,
E8M0 scales, sharded with an index — then, in a fresh process, loads it with ``load_weights`` and reports:

- peak resident memory of the load (VmHWM minus the resident size just before loading) against the budget
  "loaded model size + largest tensor";
- load throughput as a fraction of a plain sequential read of the same shard files (both with a warm page
  cache: the files are read once first, so the ratio measures our overhead, not the disk).

Usage: python scripts/bench_load.py [--preset deepseek-v4-flash] [--layers 1] [--experts 64] [--dir DIR]
The default (Flash dims, 1 layer + MTP, 64 experts per layer) writes about 4 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, ROOT)
from ascend_dsv4.models import load_config
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.loader import load_weights

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
cfg = load_config(FOLDER)
with torch.device("meta"):
    model = DeepseekV4Model(cfg, torch.bfloat16, "exact")
rss0 = status("VmRSS:")
t = time.perf_counter()
load_weights(model, FOLDER, "cpu", progress=False)
dt = time.perf_counter() - t
size = sum(p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers()))
print(json.dumps({"seconds": dt, "rss_before": rss0, "hwm": status("VmHWM:"), "model_bytes": size}))
"""


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer (fewer = smaller file)")
    ap.add_argument("--dir", default="/tmp/ascend_dsv4_bench_ckpt")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    a = ap.parse_args()

    from ascend_dsv4.models import preset
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint
    from quant.safetensors_io import find_shards, read_header, sequential_read_throughput

    if not os.path.isfile(os.path.join(a.dir, "model.safetensors.index.json")):
        cfg = preset(a.preset).with_layers(a.layers).replace(n_routed_experts=a.experts)
        t = time.perf_counter()
        write_checkpoint(cfg, a.dir, "official", shard_bytes=int(a.shard_gb * (1 << 30)))
        print(f"wrote {a.dir} in {time.perf_counter() - t:.1f} s")
    shards = find_shards(a.dir)
    total = sum(os.path.getsize(p) for p in shards)
    largest = max(i.nbytes for p in shards for i in read_header(p).tensors.values())
    sequential_read_throughput(shards)  # warm the page cache
    seq = sequential_read_throughput(shards)

    child = CHILD.replace("ROOT", repr(ROOT)).replace("FOLDER", repr(a.dir))
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    peak = r["hwm"] - r["rss_before"]
    budget = r["model_bytes"] + largest
    thr = total / r["seconds"]
    print(f"checkpoint            {gb(total)} in {len(shards)} shard(s); largest tensor {gb(largest)}")
    print(f"loaded model          {gb(r['model_bytes'])} (FP8/FP4 kept; wo_a, head and fp32 layers dequantised)")
    print(f"peak RSS during load  {gb(peak)}  vs budget model + largest tensor {gb(budget)}: "
          f"{peak / budget:.2f} of budget -> {'OK' if peak <= budget else 'OVER'}")
    print(f"load                  {r['seconds']:.2f} s = {thr / 1e9:.2f} GB/s")
    print(f"sequential read       {seq / 1e9:.2f} GB/s (warm page cache)")
    print(f"load / sequential     {thr / seq:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
