"""Contract checker: every torch_npu call the NPU backend makes, replayed on the torch_npu wheel's own contracts.

:class:`ContractChecker` wraps the ``npu_*`` functions of the (emulated) ``torch_npu`` module. Each call runs
normally and is then replayed on :mod:`.wheel_oracle`: its arguments are turned into ``meta`` tensors (same
shape, strides and dtype) and passed to ``torch.ops.npu.<op>``, which parses them against the wheel's schema
(argument names, types, keyword-only markers) and runs the wheel's Meta kernel (its argument checks and output
shapes / dtypes). A call fails its contract when the schema or the Meta kernel rejects it, or when the
emulated outputs' shapes or dtypes differ from the Meta outputs. Results are kept per op.

This checks signatures, shapes and dtypes against what the torch_npu 2.13.0 wheel declares. It does not run
CANN kernels, so device-side constraints that the Meta kernels do not encode (block sizes, head dims, SoC
support) are not checked; see the op docs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .wheel_oracle import Oracle


@dataclass
class OpContract:
    op: str
    calls: int = 0
    checked: int = 0
    violations: list[str] = field(default_factory=list)
    schema_only: bool = False  # the wheel has no Meta kernel: arguments checked against the schema only

    @property
    def ok(self) -> bool:
        return not self.violations


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    return v


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _flat(x)]
    return []


def _describe(ts: list[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in ts)


class ContractChecker:
    """Records the torch_npu calls made while :meth:`attach`-ed and checks each against ``oracle``."""

    def __init__(self, oracle: Oracle):
        self.oracle = oracle
        self.ops: dict[str, OpContract] = {}
        self._module = None
        self._saved: dict[str, Any] = {}

    # -- wrapping ------------------------------------------------------------------------------------------
    def attach(self, module) -> "ContractChecker":
        """Wrap every ``npu_*`` function of ``module`` (the torch_npu module the backend calls)."""
        if self._module is not None:
            raise RuntimeError("ContractChecker is already attached")
        self._module = module
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("npu_") and callable(fn):
                self._saved[name] = fn
                setattr(module, name, self._wrap(name, fn))
        return self

    def detach(self) -> None:
        if self._module is None:
            return
        for name, fn in self._saved.items():
            setattr(self._module, name, fn)
        self._module, self._saved = None, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.check(name, args, kwargs, out)
            return out

        return recorded

    # -- checking ------------------------------------------------------------------------------------------
    def check(self, op: str, args: tuple, kwargs: dict, out: Any) -> Optional[str]:
        """Replay one call on the wheel's contract; returns the violation text or None."""
        rec = self.ops.setdefault(op, OpContract(op))
        rec.calls += 1
        if not self.oracle.has(op):
            msg = f"{op}: not in the torch_npu wheel's schemas"
        else:
            msg = self._replay(op, args, kwargs, out)
        rec.checked += 1
        if msg is not None and len(rec.violations) < 20:
            rec.violations.append(msg)
        return msg

    def _replay(self, op: str, args: tuple, kwargs: dict, out: Any) -> Optional[str]:
        try:
            meta_out = self.oracle.call(op, *_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
        except NotImplementedError as e:
            if "Meta" in str(e):  # the arguments parsed against the schema; the wheel has no Meta kernel for it
                rec = self.ops[op]
                rec.schema_only = True
                return None
            return f"{op}: rejected by the wheel's schema / Meta kernel: {str(e).strip().splitlines()[0]}"
        except Exception as e:  # the schema parser or the Meta kernel refused the call
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"{op}: rejected by the wheel's schema / Meta kernel: {first}"
        got, want = _flat(out), _flat(meta_out)
        if len(got) != len(want):
            return f"{op}: {len(got)} outputs, the wheel's Meta kernel returns {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
                return (f"{op}: output {i} is {_describe([g])}, the wheel's Meta kernel says {_describe([w])} "
                        f"(all outputs: emulated [{_describe(got)}], meta [{_describe(want)}])")
        return None

    # -- results -------------------------------------------------------------------------------------------
    @property
    def violations(self) -> list[str]:
        return [v for r in self.ops.values() for v in r.violations]

    def summary(self) -> str:
        rows = [f"{r.op}: {r.calls} calls, {'ok' if r.ok else str(len(r.violations)) + ' violation(s)'}"
                f"{' (schema only: no Meta kernel in the wheel)' if r.schema_only else ''}" for r in self.ops.values()]
        return "\n".join(rows)
