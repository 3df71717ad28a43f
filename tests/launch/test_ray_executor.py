"""The Ray executor: placement planning on recorded cluster data, then a real two-node Ray cluster on this
machine (CPU ranks, gloo): ranks ordered by node, environment propagated, process groups across the two nodes,
a call that times out, a killed rank, and a placement that cannot be satisfied."""

from __future__ import annotations

import os

import pytest

from ascend_dsv4.engine.ray_placement import (PlacementError, RankSlot, capacity_problem, local_device_index,
                                              order_ranks, rank_bundles)


def _node(ip, npus, cpus=192.0, alive=True):
    return {"NodeID": ip * 2, "Alive": alive, "NodeManagerAddress": ip, "Resources": {"CPU": cpus, "NPU": npus}}


def test_bundles_and_capacity():
    b = rank_bundles(16, "npu")
    assert len(b) == 16 and b[0] == {"NPU": 1.0, "CPU": 1.0} and rank_bundles(2, "cpu", 2)[1] == {"CPU": 2.0}
    two_a2 = [_node("10.0.0.1", 8), _node("10.0.0.2", 8)]
    assert capacity_problem(b, two_a2) is None
    msg = capacity_problem(b, two_a2[:1])
    assert msg == ("asked 16 NPU, the cluster has 8 NPU (10.0.0.1: 8) [16 bundle(s) of {NPU: 1, CPU: 1}]")
    msg = capacity_problem(b, two_a2, available={"NPU": 8.0, "CPU": 384.0})
    assert msg.startswith("asked 16 NPU, the cluster has 16 but only 8 available (other Ray jobs hold the rest")
    assert "no node can hold one bundle {'CPU': 1.0, 'NPU': 1.0}" in capacity_problem(
        b[:1], [_node("10.0.0.1", 8, cpus=0.0), _node("10.0.0.2", 0)])
    with pytest.raises(PlacementError, match="no Ray resource for device 'tpu'"):
        rank_bundles(2, "tpu")


def test_rank_order_and_device_index():
    slots = [RankSlot(0, "B", "10.0.0.2", ("1",)), RankSlot(1, "A", "10.0.0.10", ("0",)),
             RankSlot(2, "B", "10.0.0.2", ("0",)), RankSlot(3, "A", "10.0.0.10", ("1",))]
    got = [(r, local, s.bundle) for r, local, s in order_ranks(slots)]
    assert got == [(0, 0, 2), (1, 1, 0), (2, 0, 1), (3, 1, 3)]  # 10.0.0.2 < 10.0.0.10 numerically
    got = [(r, local, s.bundle) for r, local, s in order_ranks(slots, driver_node_id="A")]
    assert got == [(0, 0, 1), (1, 1, 3), (2, 0, 2), (3, 1, 0)]  # the driver's node first
    assert local_device_index(("5",), "4,5,6,7") == 1 and local_device_index(("3",), None) == 3
    assert local_device_index((), "0,1") is None
    with pytest.raises(PlacementError, match="not in the visible devices"):
        local_device_index(("9",), "0,1")


@pytest.mark.distributed
def test_two_node_executor(ray_cluster, monkeypatch, kill_and_wait, tmp_path):
    import ray

    from ascend_dsv4.engine.ray_executor import ExecutorError, RayExecutor

    c, _, node_env = ray_cluster
    monkeypatch.setenv("HCCL_BUFFSIZE", "512")  # propagated from the driver to every rank
    ex = RayExecutor(2, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", device="cpu", address=c.address,
                     start_timeout_s=120, call_timeout_s=60)
    try:
        ex.start()
        assert len({s.node_id for s in ex.slots}) == 2  # 1 CPU per node: one rank on each node
        where = ex.collective_rpc("where")
        assert [w["rank"] for w in where] == [0, 1] and [w["local_rank"] for w in where] == [0, 0]
        assert all(w["env"]["HCCL_BUFFSIZE"] == "512" and w["env"]["HCCL_IF_IP"] == node_env["HCCL_IF_IP"]
                   for w in where)
        assert where[0]["env"]["MASTER_ADDR"] == ex.slots[0].ip and where[1]["env"]["RANK"] == "1"
        assert ex.collective_rpc("all_reduce_ranks") == [{"world": 1.0, "tp": 1.0, "ep": 0.0}] * 2
        # the cluster could hold one more rank but this executor holds its CPUs: wait (bounded), then say why
        with pytest.raises(PlacementError, match=r"not satisfied within 3 s: asked 1 CPU, the cluster has 2 but only "
                                                 r"0 available"):
            RayExecutor(1, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", device="cpu",
                        start_timeout_s=3).start()
        assert ray.is_initialized()  # it did not own the connection: ex's stays
        with pytest.raises(ExecutorError, match=r"stall: rank 0 \(node .*\), rank 1 .* did not answer within 1 s"):
            ex.collective_rpc("stall", 20, timeout=1)
        assert not ex.is_healthy()
        with pytest.raises(ExecutorError, match="did not answer within 1 s.*restart it"):
            ex.collective_rpc("where")  # stays failed, answers at once
    finally:
        ex.shutdown()
    assert not ray.is_initialized()

    ex = RayExecutor(2, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", device="cpu", address=c.address,
                     start_timeout_s=120, call_timeout_s=60, enable_expert_parallel=True)
    try:
        ex.start()
        assert ex.collective_rpc("all_reduce_ranks")[1] == {"world": 1.0, "tp": 1.0, "ep": 1.0}
        kill_and_wait(ex.workers[1])
        with pytest.raises(ExecutorError, match=r"where: rank 1 \(node .*\) died"):
            ex.collective_rpc("where")
    finally:
        ex.shutdown()

    # a healthy executor lets every rank release its process groups before it kills the actors (NCCL: rank 0
    # hung in destroy_process_group when peers were killed with their communicators open)
    monkeypatch.setenv("ASCEND_DSV4_CLOSE_MARK", str(tmp_path))  # propagated to the ranks
    ex = RayExecutor(2, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", device="cpu", address=c.address,
                     start_timeout_s=120, call_timeout_s=60)
    try:
        ex.start()
        pids = [w["pid"] for w in ex.collective_rpc("where")]
    finally:
        ex.shutdown()
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]
    assert [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == pids

    with pytest.raises(PlacementError, match=r"asked 17 NPU, the cluster has 16 NPU"):
        RayExecutor(17, "ascend_dsv4.engine.ray_executor.GroupCheckWorker", device="npu",
                    address=c.address).start()
    assert not ray.is_initialized()  # a failed start disconnects again

