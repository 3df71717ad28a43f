"""Per-rank checkpoint loading under tensor / expert parallelism: bytes each rank reads and its peak memory.

Writes a random official-format DeepSeek-V4 checkpoint (FP8 linears, FP4 experts; a widened toy so that the
weights dominate, about 100 MB), then for each layout spawns one process per rank (gloo, CPU); each rank builds
its share on ``meta`` and loads only its slices. Printed per layout: bytes read per rank, as a ratio of the whole
checkpoint and of the rank's ideal share (replicated bytes + split bytes / ranks, from
``ascend_dsv4.parallel_plan.rank_weight_bytes``), parameter bytes held, and peak RSS growth during the load
(``VmHWM`` after minus ``VmRSS`` before; includes the memory-mapped pages of the parts read and allocator
slack, so an upper bound).

    PYTHONPATH=. python scripts/bench_tp_load.py [--out scripts/bench_results/tp_load_cpu.txt]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_dsv4.models import preset  # noqa: E402

CFG = preset("toy-v4").replace(name="toy-v4-wide", dim=1024, moe_inter_dim=512, n_routed_experts=32, o_groups=4,
                               n_layers=4, compress_ratios=(0, 4, 128, 4, 0), vocab_size=8192)
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _status_kib(key: str) -> int:
    """VmRSS (current) / VmHWM (peak of this process image; ru_maxrss would carry the spawning parent's peak
    across exec on Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _rank(rank, world, ep, folder, init, q):
    torch.set_num_threads(1)
    from ascend_dsv4.models import build_model
    from ascend_dsv4.weights.loader import load_weights
    from parallel.groups import destroy_parallel, init_parallel

    state = init_parallel(world, rank, init, enable_expert_parallel=ep) if world > 1 else None
    before = _status_kib("VmRSS")
    with torch.device("meta"):
        m = build_model(CFG, torch.bfloat16, parallel=state)
    plan = load_weights(m, folder, progress=False)
    peak = _status_kib("VmHWM")
    held = sum(p.numel() * p.element_size() for p in m.parameters()) + sum(
        b.numel() * b.element_size() for b in m.buffers())
    q.put((rank, plan.bytes_read, held, max(0, peak - before) * 1024))
    if state is not None:
        destroy_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from ascend_dsv4.parallel_plan import rank_weight_bytes
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint

    lines = [f"per-rank load of {CFG.name} (official FP8/FP4 checkpoint), CPU gloo ranks, bf16 model"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        write_checkpoint(CFG, folder, "official", 0, progress=False)
        total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        lines.append(f"checkpoint: {total / 2**20:.1f} MiB")
        lines.append(f"{'layout':<12} {'rank':>4} {'read MiB':>9} {'read/ckpt':>9} {'read/share':>10} "
                     f"{'held MiB':>9} {'peak RSS+ MiB':>13}")
        ctx = mp.get_context("spawn")
        for i, (tp, ep) in enumerate(LAYOUTS):
            q = ctx.Queue()
            init = f"file://{tmp}/rdv{i}"
            procs = [ctx.Process(target=_rank, args=(r, tp, ep, folder, init, q)) for r in range(tp)]
            for p in procs:
                p.start()
            rows = sorted(q.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
            share = rank_weight_bytes(CFG, tp, ep)
            name = f"TP{tp}" + ("+EP" if ep else "")
            for r, nbytes, held, peak in rows:
                lines.append(f"{name:<12} {r:>4} {nbytes / 2**20:>9.2f} {nbytes / total:>9.3f} {nbytes / share:>10.3f} "
                             f"{held / 2**20:>9.2f} {peak / 2**20:>13.1f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
