"""The NPU backend's op table: which implementation runs each atb_ops op, resolved once at start-up.

Each op has an ordered list of candidates registered by the ``impl_*`` modules with :func:`candidate`:

* ``custom``: an op of a custom-op package (vllm-ascend ``torch.ops._C_ascend``, cann-recipes
  ``torch.ops.custom``, ours) -- used when that package is loaded;
* ``torch_npu``: built on a torch_npu fused op (called through the ``torch_npu`` module at call time, with its
  public keyword names) -- used when torch_npu has that op;
* ``composed``: composed from torch / torch_npu primitives on the device.

The first available candidate wins. An op with none falls back to the reference implementation on the device:
that is logged as a warning and shown in the table, never silent. :func:`table` resolves on first use and
logs the table; :func:`reset` forgets it (e.g. after the emulation is installed).
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

log = logging.getLogger("atb_ops")

KINDS = ("custom", "torch_npu", "composed", "reference")

#: ops that run on every step of numerics="exact" serving: a reference fallback for one of them fails check-npu
HOT_PATH = ("rms_norm", "apply_rope", "hc_pre", "hc_post", "hc_head", "compressor_pool", "indexer_topk",
            "sparse_attention", "moe_gate", "swiglu", "linear", "grouped_matmul", "mla_decode", "mla_prefill",
            "quant_linear", "quant_grouped_matmul", "add_rms_norm", "mla_decode_split",
            "moe_permute", "moe_unpermute")


@dataclass
class Candidate:
    kind: str
    via: str  # what runs it, e.g. "torch_npu.npu_rms_norm"
    available: Callable[[], bool]
    fn: Callable


@dataclass
class Entry:
    op: str
    kind: str
    via: str
    fn: Callable
    calls: int = 0
    note: str = ""
    alternatives: list[str] = field(default_factory=list)


_candidates: dict[str, list[Candidate]] = {}
_table: Optional[dict[str, Entry]] = None


def torch_npu():
    """The ``torch_npu`` module (real or emulated) or None; imported at call time, never cached here."""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return mod
    try:
        return importlib.import_module("torch_npu")
    except Exception:
        return None


def has_torch_npu(*names: str) -> Callable[[], bool]:
    def check() -> bool:
        mod = torch_npu()
        return mod is not None and all(hasattr(mod, n) for n in names)

    return check


def soc_name() -> str:
    """``torch_npu.npu.get_device_name()`` (e.g. "Ascend910B3", "Ascend950PR"), or "" when unknown."""
    try:
        return str(torch_npu().npu.get_device_name())
    except Exception:
        return ""


def on_soc(prefix: str, *names: str) -> Callable[[], bool]:
    """torch_npu has ``names`` and the device is an ``prefix``* part (ops documented for some SoCs only)."""

    def check() -> bool:
        return has_torch_npu(*names)() and soc_name().startswith(prefix)

    return check


def has_custom(namespace: str, name: str) -> Callable[[], bool]:
    """Whether ``torch.ops.<namespace>.<name>`` is registered (a custom-op package is loaded)."""

    def check() -> bool:
        try:
            return hasattr(getattr(torch.ops, namespace), name)
        except Exception:
            return False

    return check


def always() -> bool:
    return True


def candidate(op: str, kind: str, via: str, available: Callable[[], bool] = always) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as a way to run ``op`` (candidates are tried in registration order)."""
    if kind not in KINDS[:3]:
        raise ValueError(f"kind must be one of {KINDS[:3]}, got {kind!r}")

    def deco(fn: Callable) -> Callable:
        _candidates.setdefault(op, []).append(Candidate(kind, via, available, fn))
        return fn

    return deco


def _order(c: Candidate) -> int:
    return KINDS.index(c.kind)


def resolve() -> dict[str, Entry]:
    """Build the table for every atb_ops op (does not log)."""
    from .. import OPS
    from .._registry import REGISTRY as _registry

    ops = list(OPS) + [o for o in _candidates if o not in OPS]
    out: dict[str, Entry] = {}
    for op in ops:
        cands = sorted(_candidates.get(op, []), key=_order)  # stable: registration order within a kind
        chosen = None
        others = []
        for c in cands:
            ok = False
            try:
                ok = bool(c.available())
            except Exception:
                ok = False
            if ok and chosen is None:
                chosen = c
            else:
                others.append(f"{c.kind}:{c.via}{'' if ok else ' (unavailable)'}")
        if chosen is not None:
            out[op] = Entry(op, chosen.kind, chosen.via, chosen.fn, alternatives=others)
        else:
            ref = _registry["reference"].get(op)
            note = "no NPU implementation available" if cands else "no NPU implementation"
            out[op] = Entry(op, "reference", f"atb_ops reference ({note})", ref, note=note, alternatives=others)
    return out


def table() -> dict[str, Entry]:
    """The resolved op table (resolved and logged once)."""
    global _table
    if _table is None:
        _table = resolve()
        mod = torch_npu()
        where = "none" if mod is None else ("emulated" if getattr(mod, "__ascend_dsv4_emulation__", False) else "real")
        log.info("atb_ops npu backend (torch_npu: %s, device %s):\n%s", where, soc_name() or "?", format_table(_table))
        for e in _table.values():
            if e.kind == "reference":
                log.warning("atb_ops.%s on the npu backend falls back to the reference implementation (%s)",
                            e.op, e.note)
    return _table


def reset() -> None:
    global _table
    _table = None


def run(op: str, *args):
    e = table()[op]
    e.calls += 1
    return e.fn(*args)


def format_table(tbl: dict[str, Entry], extra: Optional[dict[str, str]] = None) -> str:
    """Plain-text table: op, kind, what runs it, calls (and an extra column when given)."""
    rows = [("op", "kind", "runs on", "calls") + (("contract",) if extra is not None else ())]
    for op, e in tbl.items():
        hot = "" if op in HOT_PATH else " (not hot path)"
        rows.append((op + hot, e.kind, e.via, str(e.calls)) + ((extra.get(op, "-"),) if extra is not None else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def hot_path_fallbacks(tbl: Optional[dict[str, Entry]] = None) -> list[str]:
    """Hot-path ops that run on the reference implementation."""
    tbl = tbl if tbl is not None else table()
    return [op for op, e in tbl.items() if op in HOT_PATH and e.kind == "reference"]
