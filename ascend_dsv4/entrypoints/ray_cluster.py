"""What a Ray cluster holds, checked against what a deployment needs (used by the launch scripts and check-env).

``python -m ascend_dsv4.entrypoints.ray_cluster wait --address HEAD:6379 --nodes 2 --npus-per-node 8
--timeout 600`` polls the cluster until it has at least 2 live nodes with 8 ``NPU`` each (``--node-ip IP``: until
that node is alive with its NPUs), prints one line per node, and exits 0; on timeout it prints what the cluster
has instead and exits 1. The pure functions (:func:`summarize_nodes`, :func:`check_cluster`) work on the dicts
``ray.nodes()`` returns (keys ``NodeID``, ``Alive``, ``NodeManagerAddress``, ``Resources``), so they are tested
without a cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node: its IP, whether it is alive, and its total ``resource`` count (NPU / GPU / CPU)."""

    node_id: str
    ip: str
    alive: bool
    accelerators: float
    cpus: float


def summarize_nodes(nodes: list[dict], resource: str = "NPU") -> list[NodeInfo]:
    """``ray.nodes()`` entries -> :class:`NodeInfo` list, live nodes first, then by IP."""
    out = [NodeInfo(node_id=str(n.get("NodeID", ""))[:12], ip=str(n.get("NodeManagerAddress", "?")),
                    alive=bool(n.get("Alive", False)),
                    accelerators=float((n.get("Resources") or {}).get(resource, 0.0)),
                    cpus=float((n.get("Resources") or {}).get("CPU", 0.0))) for n in nodes]
    return sorted(out, key=lambda i: (not i.alive, i.ip, i.node_id))


def check_cluster(nodes: list[NodeInfo], want_nodes: int = 1, per_node: float = 0, node_ip: str | None = None,
                  resource: str = "NPU") -> tuple[bool, str]:
    """Does the cluster satisfy the deployment? Returns ``(ok, one-line reason)``.

    Satisfied when at least ``want_nodes`` live nodes have ``>= per_node`` of ``resource`` each and, with
    ``node_ip``, that node is one of them. The reason names what is missing (e.g. ``"1 of 2 nodes with 8 NPU:
    10.0.0.2 has 0 NPU"``) so a user can fix the node rather than guess.
    """
    live = [n for n in nodes if n.alive]
    good = [n for n in live if n.accelerators >= per_node]
    short = [f"{n.ip} has {n.accelerators:g} {resource}" for n in live if n.accelerators < per_node]
    dead = [n.ip for n in nodes if not n.alive]
    extra = (f"; short: {', '.join(short)}" if short else "") + (f"; dead: {', '.join(dead)}" if dead else "")
    if node_ip is not None:
        mine = [n for n in live if n.ip == node_ip]
        if not mine:
            return False, f"node {node_ip} is not alive in the cluster ({len(live)} live node(s): " \
                          f"{', '.join(n.ip for n in live) or 'none'}){extra}"
        if mine[0].accelerators < per_node:
            return False, (f"node {node_ip} joined with {mine[0].accelerators:g} {resource}, expected {per_node:g}: "
                           f"set ASCEND_RT_VISIBLE_DEVICES / --resources before `ray start` (ray stop first)")
    if len(good) < want_nodes:
        return False, f"{len(good)} of {want_nodes} node(s) with {per_node:g} {resource}{extra}"
    return True, f"{len(good)} node(s) with >= {per_node:g} {resource}{extra}"


def format_nodes(nodes: list[NodeInfo], resource: str = "NPU") -> str:
    """One line per node: ``  10.0.0.1  alive  8 NPU  192 CPU  (node 1a2b3c...)``."""
    return "\n".join(f"  {n.ip:<15} {'alive' if n.alive else 'DEAD ':<5} {n.accelerators:>4g} {resource}  "
                     f"{n.cpus:>4g} CPU  (node {n.node_id})" for n in nodes) or "  (no nodes)"


def fetch_nodes(address: str, resource: str = "NPU") -> list[NodeInfo]:
    """Connect to the cluster at ``address`` (or ``"auto"``), read ``ray.nodes()``, disconnect."""
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    try:
        return summarize_nodes(ray.nodes(), resource)
    finally:
        ray.shutdown()


def wait_for_cluster(address: str, want_nodes: int, per_node: float, node_ip: str | None, timeout: float,
                     resource: str = "NPU", poll: float = 2.0) -> tuple[bool, str, list[NodeInfo]]:
    """Poll the cluster until :func:`check_cluster` passes or ``timeout`` seconds pass.

    One connection for the whole wait; ``ray.nodes()`` is re-read every ``poll`` seconds.
    """
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    try:
        deadline = time.monotonic() + timeout
        while True:
            nodes = summarize_nodes(ray.nodes(), resource)
            ok, why = check_cluster(nodes, want_nodes, per_node, node_ip, resource)
            if ok or time.monotonic() >= deadline:
                return ok, why, nodes
            time.sleep(poll)
    finally:
        ray.shutdown()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ascend_dsv4.entrypoints.ray_cluster",
                                 description="Check / wait for a Ray cluster's nodes and accelerators")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("wait", "wait until the cluster has the nodes and accelerators"),
                        ("show", "print the cluster's nodes once")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"), help="HEAD_IP:PORT or auto")
        p.add_argument("--resource", default="NPU", help="accelerator resource name (NPU, GPU; CPU for tests)")
        p.add_argument("--nodes", type=int, default=1, help="live nodes needed")
        p.add_argument("--npus-per-node", type=float, default=0, help="accelerators each node must have")
        p.add_argument("--node-ip", default=None, help="this node must be one of them")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds (wait only)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    # ray.init itself has no timeout argument: a watchdog ends the process if connecting hangs
    limit = (a.timeout if a.cmd == "wait" else 0) + 60
    watchdog = threading.Timer(limit, lambda: (print(f"error: no answer from the Ray cluster at {a.address} "
                                                     f"within {limit:g} s; is `ray start` running there?",
                                                     file=sys.stderr, flush=True), os._exit(1)))
    watchdog.daemon = True
    watchdog.start()
    try:
        if a.cmd == "show":
            nodes = fetch_nodes(a.address, a.resource)
            ok, why = check_cluster(nodes, a.nodes, a.npus_per_node, a.node_ip, a.resource)
        else:
            ok, why, nodes = wait_for_cluster(a.address, a.nodes, a.npus_per_node, a.node_ip, a.timeout, a.resource)
    except (ConnectionError, RuntimeError) as e:
        print(f"error: cannot connect to the Ray cluster at {a.address}: {e}", file=sys.stderr)
        return 1
    finally:
        watchdog.cancel()
    print(format_nodes(nodes, a.resource))
    print(("ok: " if ok else "error: ") + why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
