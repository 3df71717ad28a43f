"""A real two-node Ray cluster on this machine (ray.cluster_utils.Cluster: two raylets, each a "node" with 8
"NPU"): the join check the launch scripts run, and check-env's Ray rows (probe task pinned to every node)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from ascend_dsv4.entrypoints import check_env as ce  # noqa: E402
from ascend_dsv4.entrypoints.check_env_cluster import check_ray  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IP = ray.util.get_node_ip_address()  # the address Ray gives both local "nodes"
NODE_ENV = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
            "HCCL_IF_IP": IP, "HCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in [*NODE_ENV, "PYTHONPATH"]}
    os.environ.update(NODE_ENV)  # the raylets inherit it, as after scripts/ray_head.sh / ray_worker.sh
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"NPU": 8},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"NPU": 8})
    c.wait_for_nodes()
    model = tmp_path_factory.mktemp("w") / "toy"
    from ascend_dsv4.entrypoints.cli import main

    assert main(["make-random-checkpoint", "--out", str(model)]) == 0
    try:
        yield c, str(model)
    finally:
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.distributed
def test_join_check_and_check_env_rows(cluster):
    c, model = cluster
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
