"""``parallel.groups.destroy_parallel`` runs its before-destroy hooks (the CUDA-graph release of
engine/cuda_graphs.py) before the groups go, once per registration, and a failing hook does not stop it.
tests/v4/test_cuda_graphs.py releases real captured graphs on the GPU."""

from __future__ import annotations

import torch.distributed as dist

from parallel import groups


def test_hooks_run_before_the_groups_are_destroyed(monkeypatch):
    seen = []
    monkeypatch.setattr(groups, "_BEFORE_DESTROY", [])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append("destroy"))

    def bad():
        seen.append("bad")
        raise RuntimeError("boom")

    def release():
        seen.append("release")

    groups.before_destroy(bad)
    groups.before_destroy(release)
    groups.before_destroy(release)  # registered once
    groups.destroy_parallel()
    assert seen == ["bad", "release", "destroy"]

