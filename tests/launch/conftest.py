"""A real two-node Ray cluster on this machine, shared by the distributed tests of tests/launch/
(ray.cluster_utils.Cluster: two raylets, each a "node" with 1 CPU and 8 "NPU")."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()  # the address Ray gives both local "nodes"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """``(cluster, toy model folder, node env)``; the raylets inherit ``node env`` as after scripts/ray_*.sh."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    env = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
           "HCCL_IF_IP": node_ip(), "HCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in [*env, "PYTHONPATH"]}
    os.environ.update(env)
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"NPU": 8},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"NPU": 8})
    c.wait_for_nodes()
    model = tmp_path_factory.mktemp("w") / "toy"
    from ascend_dsv4.entrypoints.cli import main

    assert main(["make-random-checkpoint", "--out", str(model)]) == 0
    try:
        yield c, str(model), env
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def kill_and_wait():
    """``kill_and_wait(actor)``: ``ray.kill`` returns before the actor is gone, so a call made at once can still be
    answered; wait (bounded) until the actor no longer answers, so the test sees the death it provoked."""
    import time

    import ray

    def kill(actor, timeout_s: float = 60.0) -> None:
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - dead (ActorDiedError) or unreachable: gone for the caller
                return
            time.sleep(0.2)
        raise AssertionError(f"actor {actor} still answers {timeout_s} s after ray.kill")

    return kill
