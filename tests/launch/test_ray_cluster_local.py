"""A real two-node Ray cluster on this machine (ray.cluster_utils.Cluster: two raylets, each a "node" with 8
"NPU"): the join check the launch scripts run, and check-env's Ray rows (probe task pinned to every node)."""

from __future__ import annotations

import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

from ascend_dsv4.entrypoints import check_env as ce  # noqa: E402
from ascend_dsv4.entrypoints.check_env_cluster import check_ray  # noqa: E402


@pytest.mark.distributed
def test_join_check_and_check_env_rows(ray_cluster):
    c, model, _ = ray_cluster
    IP = ray.util.get_node_ip_address()  # the address Ray gives both local "nodes"
    wait = [sys.executable, "-m", "ascend_dsv4.entrypoints.ray_cluster", "wait", "--address", c.address,
            "--nodes", "2", "--npus-per-node", "8", "--timeout", "60"]
    r = subprocess.run(wait, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0 and "ok: 2 node(s) with >= 8 NPU" in r.stdout, r.stdout + r.stderr

    plan = ce.Plan(device="npu", npus_per_node=8, nodes=2, backend="ray", ray_address=c.address, model=model)
    rows = {row.name: row for row in check_ray(plan)}
    assert rows["ray"].verdict == "OK" and rows["ray"].detail.startswith("2 node(s) with >= 8 NPU"), rows
    assert rows["ray-env"].verdict == "OK", rows["ray-env"]
    assert rows["weights@nodes"].verdict == "OK" and "readable on all 2 node(s)" in rows["weights@nodes"].detail
    rows = {row.name: row for row in check_ray(ce.Plan(device="npu", npus_per_node=16, nodes=3, backend="ray",
                                                        ray_address=c.address))}
    assert rows["ray"].verdict == "FAIL" and "0 of 3 node(s) with 16 NPU" in rows["ray"].detail
    assert f"short: {IP} has 8 NPU, {IP} has 8 NPU" in rows["ray"].detail


@pytest.mark.distributed
def test_check_collectives_across_two_nodes(ray_cluster):
    c, _, _ = ray_cluster
    plan = ce.Plan(device="cpu", nodes=2, backend="ray", ray_address=c.address, tp=2, ep=True,
                   check_collectives=True)
    rows = {row.name: row for row in check_ray(plan)}
    assert rows["collectives"].verdict == "OK", rows["collectives"]
    assert rows["collectives"].detail.startswith("2 ranks on 2 node(s) formed the world / TP / EP groups")
    rows = {row.name: row for row in check_ray(ce.Plan(device="cpu", nodes=2, backend="ray", ray_address=c.address,
                                                        tp=4, check_collectives=True))}
    assert rows["collectives"].verdict == "FAIL" and "asked 4 CPU, the cluster has 2 CPU" in rows["collectives"].detail
