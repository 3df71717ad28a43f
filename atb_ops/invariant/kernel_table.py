"""The table of device kernels for the batch-invariant primitives (:mod:`.primitives`), filled by the backends that
have them (:mod:`atb_ops.cuda.invariant_kernels`). Its own module so that a backend registering a kernel and the
primitives looking one up do not import each other."""

from __future__ import annotations

from typing import Callable

KERNELS: dict[str, dict[str, Callable]] = {"cuda": {}}


def register_primitive(name: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is ``backend``'s batch-invariant kernel of primitive ``name``."""

    def deco(fn: Callable) -> Callable:
        KERNELS.setdefault(backend, {})[name] = fn
        return fn

    return deco
