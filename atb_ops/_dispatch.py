"""Backend dispatch for atb_ops.

Every public op is a plain function in :mod:`atb_ops.ops`. It resolves an implementation by name:

1. an explicit override, from the ``use_backend(...)`` context manager or else the ``ATB_OPS_BACKEND``
   environment variable (``reference`` | ``cuda`` | ``npu`` | ``ascendc_emu``: our AscendC kernels run on the host
   through atb_ops/ascendc/emu);
2. otherwise the device type of the op's first tensor argument: ``cpu`` -> ``reference``,
   ``cuda`` -> ``cuda``, ``npu`` -> ``npu``.

A backend that has not registered the op falls back to the reference implementation on the same device
and logs that once per (backend, op): numerics never change silently.

Batch-invariant mode (:func:`batch_invariant` / :func:`set_batch_invariant` / ``ATB_OPS_BATCH_INVARIANT=1``)
swaps every op for its batch-invariant variant (``register(op, backend, batch_invariant=True)``): a variant
whose result for one token (row) is bitwise independent of the other rows of the batch. A backend without
its own variant of an op uses the device-generic one registered under ``reference``, which builds on the
primitives of :mod:`atb_ops.invariant.primitives` (fixed-strategy matmul and sums, dispatched by device);
that fallback is logged once per (backend, op) too.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import Callable, Iterator

import torch

from ._registry import BACKENDS, BI_REGISTRY as _bi_registry, REGISTRY as _registry, BackendError, check as _check
from ._registry import register

__all__ = ["BACKENDS", "BackendError", "batch_invariant", "device_available", "implementations", "is_batch_invariant",
           "kv_layout", "register", "resolve", "selected_backend", "set_batch_invariant", "use_backend"]

from ._selection import DEVICE_TO_BACKEND as _DEVICE_TO_BACKEND, selected_backend, use_backend

_bi_mode: contextvars.ContextVar[bool | None] = contextvars.ContextVar("atb_ops_batch_invariant", default=None)
_bi_default = False
_warned: set[tuple[str, str]] = set()
_loaded: set[str] = set()
log = logging.getLogger("atb_ops")


def set_batch_invariant(enabled: bool) -> None:
    """Process-wide default of batch-invariant mode (what ``LLM(batch_invariant=True)`` sets)."""
    global _bi_default
    _bi_default = bool(enabled)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run every op inside the block in its batch-invariant variant (``False``: the normal kernels)."""
    token = _bi_mode.set(bool(enabled))
    try:
        yield
    finally:
        _bi_mode.reset(token)


def is_batch_invariant() -> bool:
    """Whether ops called now use their batch-invariant variants (context, else the process default, else
    ``ATB_OPS_BATCH_INVARIANT``)."""
    mode = _bi_mode.get()
    if mode is not None:
        return mode
    return _bi_default or os.environ.get("ATB_OPS_BATCH_INVARIANT", "0") not in ("", "0")


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


def resolve(op_name: str, *args) -> Callable:
    """The implementation of ``op_name`` for these arguments (see module docstring)."""
    backend = selected_backend(*args)
    if is_batch_invariant():
        return _resolve_invariant(op_name, backend)
    if backend != "reference":
        _load_backend(backend)
        fn = _registry[backend].get(op_name)
        if fn is not None:
            return fn
        if (backend, op_name) not in _warned:
            _warned.add((backend, op_name))
            log.info("atb_ops.%s: no %s kernel, using the reference implementation", op_name, backend)
    return _registry["reference"][op_name]


def _resolve_invariant(op_name: str, backend: str) -> Callable:
    from . import invariant  # noqa: F401  (registers the device-generic batch-invariant variants)

    if backend != "reference":
        _load_backend(backend)
        fn = _bi_registry[backend].get(op_name)
        if fn is not None:
            return fn
        if (backend, "bi:" + op_name) not in _warned:
            _warned.add((backend, "bi:" + op_name))
            log.info("atb_ops.%s: no batch-invariant %s kernel, using the device-generic batch-invariant variant",
                     op_name, backend)
    return _bi_registry["reference"][op_name]


def kv_layout(backend: str | None = None, device: torch.device | str | None = None):
    """The :class:`atb_ops.layout.KVLayout` ``backend`` asks for (``None``: the backend ``device`` dispatches to;
    neither: reference). Loads the backend, which registers its layout."""
    from .layout import REFERENCE, registered_layout

    if backend is None:
        backend = _DEVICE_TO_BACKEND.get(torch.device(device).type, "reference") if device is not None else "reference"
    backend = _check(backend)
    if backend != "reference":
        try:
            _load_backend(backend)
        except Exception:  # a backend whose runtime is missing registers nothing: its ops run on the reference
            pass
    return registered_layout(backend) or REFERENCE


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
