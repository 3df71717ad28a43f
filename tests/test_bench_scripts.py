"""Smoke test of scripts/bench_decode.py on the CPU (its --toy mode): the synchronised graph-path step and the chained
one (``--modes async``, the engine's --async-scheduling loop on the runner) both run and print a row."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_decode_toy_graph_and_async_rows():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), "--toy", "--device", "cpu",
           "--modes", "graph,async", "--batches", "2", "--ctx", "64", "--formats", "bf16", "--steps", "2",
           "--warmup", "1", "--backends", "reference"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    for mode in ("graph", "async"):
        row = re.search(rf"^\| ours \(reference, {mode}\) \| bf16 \| 2 \| 64 \| ([0-9.]+) \|", out.stdout, re.M)
        assert row and float(row.group(1)) > 0, out.stdout


def test_bench_spec_decode_toy_rows():
    """scripts/bench_spec_decode.py --toy on the CPU: the speculative step on the graph path (uncaptured: every
    verification and draft from the static buffers) and eagerly, each printing its row."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_spec_decode.py"), "--toy", "--device", "cpu",
           "--batches", "2", "--ctx", "64", "--steps", "2", "--warmup", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    graph = re.search(r"^\| graph \((\d+) replays\) \| 2 \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|", out.stdout, re.M)
    # 3 plain steps + 2 x 3 speculative steps, each a verification and a draft replay
    assert graph and int(graph.group(1)) == 15 and all(float(graph.group(i)) > 0 for i in (2, 3, 4)), out.stdout
    assert re.search(r"^\| eager \| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", out.stdout, re.M), out.stdout


def test_bench_engine_step_layout_rows():
    """scripts/bench_engine_step.py --toy on the CPU with MTP speculation: the whole-step timing of any engine
    (run_steps, also what TP / DP layouts use) prints a row with the tokens a step gave."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_engine_step.py"), "--toy", "--device", "cpu",
           "--batches", "2", "--ctx", "16", "--output-len", "4", "--num-speculative-tokens", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = re.search(r"^\| 2 \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| (\d+) \|$", out.stdout, re.M)
    assert row and int(row.group(1)) > 0 and 1.0 <= float(row.group(3)) / 2 <= 2.0, out.stdout
    # progress stamps on '#' lines (a run cut by its timeout shows which phase it was in)
    assert re.search(r"^# [0-9.]+ s: engine built", out.stdout, re.M), out.stdout
    assert re.search(r"^# [0-9.]+ s: batch 2: prefill, graph capture and decode$", out.stdout, re.M), out.stdout


@pytest.mark.distributed
def test_bench_engine_step_dp_async_row():
    """scripts/bench_engine_step.py --toy -dp 2 --async-scheduling (the next device run's layout) runs on the CPU's
    worker processes and prints its row, the step split into the replicas' round trips and the front end's rest."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_engine_step.py"), "--toy", "--device", "cpu",
           "--batches", "2", "--ctx", "16", "--output-len", "4", "-dp", "2", "--async-scheduling"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TP 1 x DP 2 + EP, async scheduling" in out.stdout, out.stdout
    m = re.search(r"^\| 2 \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| 2\.0 \| (\d+) \|$", out.stdout, re.M)
    assert m, out.stdout
    step, trips, front = (float(m.group(i)) for i in (2, 3, 4))
    assert 0 < trips <= step and front <= step, out.stdout  # a step's round trips and front end lie within it
