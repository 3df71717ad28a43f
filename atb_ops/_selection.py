"""Which backend an op call runs on: the explicit override (:func:`use_backend`, ``ATB_OPS_BACKEND``) or the device
of the first tensor argument. Kept apart from :mod:`atb_ops._dispatch` (which loads backends) so that code the
dispatcher loads lazily -- the batch-invariant primitives -- can ask it without an import cycle."""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch

from ._registry import check as _check

DEVICE_TO_BACKEND = {"cpu": "reference", "cuda": "cuda", "npu": "npu", "meta": "reference"}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("atb_ops_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend for every op called inside the block (``None`` = dispatch by device)."""
    token = _override.set(None if name is None else _check(name))
    try:
        yield
    finally:
        _override.reset(token)


def selected_backend(*args) -> str:
    """The backend an op called with ``args`` would use."""
    forced = _override.get() or os.environ.get("ATB_OPS_BACKEND") or None
    if forced:
        return _check(forced)
    for a in args:
        if isinstance(a, torch.Tensor):
            return DEVICE_TO_BACKEND.get(a.device.type, "reference")
    return "reference"
