"""ascend_dsv4.entrypoints.ray_cluster on recorded ray.nodes() entries (no cluster needed)."""

from __future__ import annotations

from ascend_dsv4.entrypoints.ray_cluster import check_cluster, format_nodes, summarize_nodes


def _node(ip: str, npus: float, alive: bool = True) -> dict:
    # the keys ray.nodes() returns (Ray 2.x): NodeID, Alive, NodeManagerAddress, Resources
    return {"NodeID": f"{abs(hash(ip)):040x}", "Alive": alive, "NodeManagerAddress": ip,
            "Resources": {"CPU": 192.0, "NPU": npus, "memory": 1e12} if npus else {"CPU": 192.0}}


def test_two_a2_nodes_ready():
    nodes = summarize_nodes([_node("10.0.0.2", 8), _node("10.0.0.1", 8)])
    assert [n.ip for n in nodes] == ["10.0.0.1", "10.0.0.2"]
    ok, why = check_cluster(nodes, want_nodes=2, per_node=8)
    assert ok and why.startswith("2 node(s) with >= 8 NPU")
    assert check_cluster(nodes, 1, 8, node_ip="10.0.0.2")[0]
    assert "10.0.0.1" in format_nodes(nodes) and "8 NPU" in format_nodes(nodes)


def test_missing_and_short_nodes_are_named():
    nodes = summarize_nodes([_node("10.0.0.1", 8), _node("10.0.0.2", 0), _node("10.0.0.3", 8, alive=False)])
    ok, why = check_cluster(nodes, want_nodes=3, per_node=8)
    assert not ok and why == "1 of 3 node(s) with 8 NPU; short: 10.0.0.2 has 0 NPU; dead: 10.0.0.3"
    ok, why = check_cluster(nodes, 1, 8, node_ip="10.0.0.2")
    assert not ok and "joined with 0 NPU, expected 8" in why and "ASCEND_RT_VISIBLE_DEVICES" in why
    ok, why = check_cluster(nodes, 1, 8, node_ip="10.0.0.9")
    assert not ok and why.startswith("node 10.0.0.9 is not alive in the cluster (2 live node(s): 10.0.0.1, 10.0.0.2)")


def test_empty_cluster():
    ok, why = check_cluster(summarize_nodes([]), 1, 8)
    assert not ok and why == "0 of 1 node(s) with 8 NPU"
    assert format_nodes([]) == "  (no nodes)"
