"""The records check-env passes around: what the user intends to run (:class:`Plan`), one table row (:class:`Check`),
facts one check leaves for another (:class:`Probe`). Shared by :mod:`.check_env` and :mod:`.check_env_cluster`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import env_probes as ep

NPUS_PER_NODE = {"a2": 8, "a3": 16}


@dataclass
class Check:
    """One row of the table."""

    name: str
    verdict: str
    detail: str
    fix: str = ""


@dataclass
class Plan:
    """What the user intends to run (check-env's arguments, defaults resolved)."""

    device: str = "npu"
    platform: str | None = None
    npus_per_node: int | None = None
    nodes: int = 1
    backend: str = "mp"
    ray_address: str | None = None
    model: str | None = None
    tp: int = 1
    dp: int = 1
    ep: bool = False
    max_model_len: int = 32768
    max_num_seqs: int = 8
    memory_utilization: float = 0.9
    ascend_root: str = "/usr/local/Ascend"
    check_collectives: bool = False
    env: dict = field(default_factory=lambda: dict(os.environ))

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1 or self.backend == "ray"

    def expected_npus(self) -> int | None:
        if self.npus_per_node:
            return self.npus_per_node
        return NPUS_PER_NODE.get(self.platform or "")


@dataclass
class Probe:
    """Facts gathered by one check and used by a later one (the chips seen by ``npu-smi``)."""

    chips: list[ep.Chip] | None = None
