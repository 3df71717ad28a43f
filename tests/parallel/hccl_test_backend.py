"""Test-only torch.distributed backend registered under the name ``hccl`` that delegates to gloo.

It lets the HCCL branch of :mod:`parallel.groups` (group options with ``hccl_buffer_size``, the connect timeout)
run on CPU: every group it creates records the options and timeout it was given in ``CREATED``.
"""

from __future__ import annotations

import torch.distributed as dist

CREATED: list[dict] = []


def _create(opts, pg_options):
    CREATED.append({"group_id": opts.group_id, "size": opts.group_size, "timeout_s": opts.timeout.total_seconds(),
                    "hccl_config": dict(getattr(pg_options, "hccl_config", {}) or {})})
    return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register() -> None:
    if "HCCL" not in dist.Backend._plugins:
        dist.Backend.register_backend("hccl", _create, extended_api=True, devices=["cpu"])
