"""Where the ranks of a Ray deployment go: bundles, a capacity check that names what is missing, rank order.

Pure functions over plain data (``ray.nodes()`` entries, the placement-group table), so they are tested without
a cluster. One bundle per rank: ``{"NPU": 1, "CPU": c}`` on Ascend, ``{"GPU": 1, "CPU": c}`` on CUDA,
``{"CPU": c}`` for CPU ranks (tests). The placement group uses Ray's ``PACK`` strategy (fill a node before the
next), and ranks are ordered by node (the driver's node first, then by node IP), so that tensor-parallel
neighbours share a node and its HCCS links.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AscendDSV4Error

RESOURCE_BY_DEVICE = {"npu": "NPU", "cuda": "GPU", "cpu": "CPU"}


class PlacementError(AscendDSV4Error, RuntimeError):
    """The cluster cannot hold the ranks asked for; the message says what was asked and what the cluster has."""


def rank_bundles(world_size: int, device: str, cpus_per_rank: float = 1.0) -> list[dict[str, float]]:
    """One bundle per rank: the accelerator (``NPU`` / ``GPU``) plus ``cpus_per_rank`` CPUs; CPU ranks ask CPUs only."""
    if device not in RESOURCE_BY_DEVICE:
        raise PlacementError(f"no Ray resource for device {device!r}; expected one of {', '.join(RESOURCE_BY_DEVICE)}")
    if world_size < 1:
        raise PlacementError(f"world size must be >= 1, got {world_size}")
    res = RESOURCE_BY_DEVICE[device]
    bundle = {"CPU": float(cpus_per_rank)} if res == "CPU" else {res: 1.0, "CPU": float(cpus_per_rank)}
    return [dict(bundle) for _ in range(world_size)]


def describe_bundles(bundles: list[dict[str, float]]) -> str:
    """``"16 bundles of {NPU: 1, CPU: 1}"`` (or the distinct bundles when they differ)."""
    kinds = {tuple(sorted(b.items())) for b in bundles}
    if len(kinds) == 1:
        b = bundles[0]
        return f"{len(bundles)} bundle(s) of {{{', '.join(f'{k}: {v:g}' for k, v in b.items())}}}"
    return f"{len(bundles)} bundles: " + "; ".join(str(b) for b in bundles)


def capacity_problem(bundles: list[dict[str, float]], nodes: list[dict],
                     available: dict[str, float] | None = None) -> str | None:
    """Why ``bundles`` cannot be placed on the live ``nodes`` (``ray.nodes()`` entries), or None if they can.

    Checks the cluster totals per resource and that every bundle fits on some node; ``available``
    (``ray.available_resources()``) adds what other jobs already hold. The message lists, per resource, asked vs
    the cluster's total (and available), and each node's amount, e.g. ``"asked 16 NPU (16 bundle(s) of {NPU: 1,
    CPU: 1}); the cluster has 8 NPU (10.0.0.1: 8 NPU)"``.
    """
    live = [n for n in nodes if n.get("Alive")]
    asked: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            asked[k] = asked.get(k, 0.0) + v
    problems = []
    for res, want in asked.items():
        total = sum(float((n.get("Resources") or {}).get(res, 0.0)) for n in live)
        free = None if available is None else float(available.get(res, 0.0))
        per_node = ", ".join(f"{n.get('NodeManagerAddress', '?')}: {float((n.get('Resources') or {}).get(res, 0)):g}"
                             for n in live) or "no live nodes"
        if total < want:
            problems.append(f"asked {want:g} {res}, the cluster has {total:g} {res} ({per_node})")
        elif free is not None and free < want:
            problems.append(f"asked {want:g} {res}, the cluster has {total:g} but only {free:g} available "
                            f"(other Ray jobs hold the rest; {per_node})")
    for b in {tuple(sorted(b.items())) for b in bundles}:
        need = dict(b)
        if live and not any(all(float((n.get("Resources") or {}).get(k, 0.0)) >= v for k, v in need.items())
                            for n in live):
            problems.append(f"no node can hold one bundle {need}")
    if not problems:
        return None
    return "; ".join(problems) + f" [{describe_bundles(bundles)}]"


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: its bundle, node, node IP and the accelerator ids Ray gave it."""

    bundle: int
    node_id: str
    ip: str
    accelerator_ids: tuple[str, ...] = ()


def order_ranks(slots: list[RankSlot], driver_node_id: str | None = None) -> list[tuple[int, int, RankSlot]]:
    """``[(rank, local_rank, slot)]``: the driver's node first, then nodes by IP; inside a node by accelerator
    id (then bundle). ``local_rank`` counts ranks on the same node."""
    def node_key(s: RankSlot):
        return (0 if s.node_id == driver_node_id else 1, tuple(int(p) if p.isdigit() else 0 for p in s.ip.split(".")),
                s.ip, s.node_id)

    def acc_key(s: RankSlot):
        return tuple(int(a) if str(a).isdigit() else 0 for a in s.accelerator_ids), s.bundle

    ordered = sorted(slots, key=lambda s: (node_key(s), acc_key(s)))
    out, seen = [], {}
    for rank, s in enumerate(ordered):
        local = seen.get(s.node_id, 0)
        seen[s.node_id] = local + 1
        out.append((rank, local, s))
    return out


def local_device_index(accelerator_ids: tuple[str, ...], visible: str | None) -> int | None:
    """The device index a rank opens: position of its Ray-assigned id in ``ASCEND_RT_VISIBLE_DEVICES`` /
    ``CUDA_VISIBLE_DEVICES`` (Ray leaves the variable alone with ``RAY_EXPERIMENTAL_NOSET_*``); the id itself when
    the variable is unset; None for CPU ranks."""
    if not accelerator_ids:
        return None
    aid = str(accelerator_ids[0])
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if aid in ids:
            return ids.index(aid)
        raise PlacementError(f"Ray assigned device {aid}, which is not in the visible devices {visible!r}: start "
                             "the node's raylet with the same visibility variable (scripts/ray_worker.sh --restart)")
    return int(aid) if aid.isdigit() else 0
