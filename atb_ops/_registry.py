"""The table of op implementations by backend, and :func:`register`, which backends use to fill it.

Kept apart from :mod:`atb_ops._dispatch` (which loads backends lazily and resolves ops): a backend imports only
this module, so no backend and the dispatcher import each other.
"""

from __future__ import annotations

from typing import Callable

BACKENDS = ("reference", "cuda", "npu", "ascendc_emu")

#: backend -> op name -> implementation
REGISTRY: dict[str, dict[str, Callable]] = {b: {} for b in BACKENDS}


class BackendError(ValueError):
    """An unknown backend name was requested."""


def check(name: str) -> str:
    if name not in BACKENDS:
        raise BackendError(f"unknown atb_ops backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def register(op_name: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``op_name``."""
    check(backend)

    def deco(fn: Callable) -> Callable:
        REGISTRY[backend][op_name] = fn
        return fn

    return deco
