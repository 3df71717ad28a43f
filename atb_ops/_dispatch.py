"""Backend dispatch for atb_ops.

Every public op is a plain function in :mod:`atb_ops.ops`. It resolves an implementation by name:

1. an explicit override, from the ``use_backend(...)`` context manager or else the ``ATB_OPS_BACKEND``
   environment variable (``reference`` | ``cuda`` | ``npu`` | ``ascendc_emu``: our AscendC kernels run on the host
   through atb_ops/ascendc/emu);
2. otherwise the device type of the op's first tensor argument: ``cpu`` -> ``reference``,
   ``cuda`` -> ``cuda``, ``npu`` -> ``npu``.

A backend that has not registered the op falls back to the reference implementation on the same device
and logs that once per (backend, op): numerics never change silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import Callable, Iterator

import torch

from ._registry import BACKENDS, REGISTRY as _registry, BackendError, check as _check, register

__all__ = ["BACKENDS", "BackendError", "device_available", "implementations", "register", "resolve",
           "selected_backend", "use_backend"]

_DEVICE_TO_BACKEND = {"cpu": "reference", "cuda": "cuda", "npu": "npu", "meta": "reference"}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("atb_ops_backend", default=None)
_warned: set[tuple[str, str]] = set()
_loaded: set[str] = set()
log = logging.getLogger("atb_ops")


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend for every op called inside the block (``None`` = dispatch by device)."""
    token = _override.set(None if name is None else _check(name))
    try:
        yield
    finally:
        _override.reset(token)


def _load_backend(backend: str) -> None:
    # Importing a backend package registers its kernels; done lazily so that CPU users never import
    # triton or torch_npu.
    if backend in _loaded:
        return
    _loaded.add(backend)
    if backend == "cuda":
        from . import cuda  # noqa: F401
    elif backend == "npu":
        from . import npu  # noqa: F401
    elif backend == "ascendc_emu":
        from .ascendc import emu  # noqa: F401


def selected_backend(*args) -> str:
    """The backend an op called with ``args`` would use."""
    forced = _override.get() or os.environ.get("ATB_OPS_BACKEND") or None
    if forced:
        return _check(forced)
    for a in args:
        if isinstance(a, torch.Tensor):
            return _DEVICE_TO_BACKEND.get(a.device.type, "reference")
    return "reference"


def resolve(op_name: str, *args) -> Callable:
    """The implementation of ``op_name`` for these arguments (see module docstring)."""
    backend = selected_backend(*args)
    if backend != "reference":
        _load_backend(backend)
        fn = _registry[backend].get(op_name)
        if fn is not None:
            return fn
        if (backend, op_name) not in _warned:
            _warned.add((backend, op_name))
            log.info("atb_ops.%s: no %s kernel, using the reference implementation", op_name, backend)
    return _registry["reference"][op_name]


def implementations(op_name: str) -> dict[str, Callable]:
    """All registered implementations of an op, by backend (for tests)."""
    for b in BACKENDS[1:]:
        try:
            _load_backend(b)
        except Exception:  # a backend whose runtime is missing simply registers nothing
            pass
    return {b: reg[op_name] for b, reg in _registry.items() if op_name in reg}


def device_available(kind: str) -> bool:
    """Whether tensors can live on ``kind`` ('cpu' | 'cuda' | 'npu') in this process (imports torch_npu for 'npu')."""
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return False
        return bool(getattr(torch, "npu", None) and torch.npu.is_available())
    return False
