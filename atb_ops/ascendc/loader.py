"""Load our AscendC kernels for the NPU backend: ``torch.ops.ascend_dsv4.{compressor_pool, sparse_attention, mla_decode}``.

The op schemas and their fake (meta) implementations are registered here, in Python, so that graph capture
(torch.compile / torchair) can trace the ops and so that they can be checked without CANN; the NPU implementations
come from ``libascend_dsv4_ascendc_ops.so`` (built by ``scripts/build_ascendc.sh`` on a machine with CANN; see
atb_ops/ascendc/README.md). Their semantics are those of the atb_ops ops of the same names.

The NPU backend calls :func:`register_npu_kernels` last at import: when the library is present it registers these
kernels as the ``npu`` implementations of the three ops (taking precedence over composed torch_npu paths) and
returns True; without it nothing changes and it returns False.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

log = logging.getLogger("atb_ops")

LIB_NAME = "libascend_dsv4_ascendc_ops.so"
HERE = os.path.dirname(os.path.abspath(__file__))
_state: dict[str, object] = {"schemas": None, "loaded": None}

SCHEMAS = {
    "compressor_pool": "compressor_pool(Tensor kv_state, Tensor score_state, Tensor cand, bool overlap) -> Tensor",
    "sparse_attention": ("sparse_attention(Tensor q, Tensor kv, Tensor idx, Tensor sink, float scale, Tensor? extra_kv=None, "
                         "Tensor? extra_idx=None) -> Tensor"),
    "mla_decode": "mla_decode(Tensor q_nope_absorbed, Tensor q_pe, Tensor latent, Tensor idx, float scale) -> Tensor",
}


def library_path() -> str | None:
    """``$ASCEND_DSV4_ASCENDC_LIB`` or the build script's install location, if the file exists."""
    for p in (os.environ.get("ASCEND_DSV4_ASCENDC_LIB"), os.path.join(HERE, "build", "install", "lib", LIB_NAME)):
        if p and os.path.isfile(p):
            return p
    return None


def _fake_compressor_pool(kv_state, score_state, cand, overlap):
    width = kv_state.shape[-1]
    return kv_state.new_empty((cand.shape[0], width // 2 if overlap else width), dtype=torch.float32)


def _fake_sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
    return torch.empty_like(q)


def _fake_mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
    return torch.empty_like(q_nope_absorbed)


def register_schemas() -> None:
    """Define the ``ascend_dsv4`` op schemas and their fake implementations (idempotent; no CANN needed)."""
    if _state["schemas"] is not None:
        return
    lib = torch.library.Library("ascend_dsv4", "FRAGMENT")  # noqa: TOR901  (kept alive in _state)
    for schema in SCHEMAS.values():
        lib.define(schema)
    for name, fake in (("compressor_pool", _fake_compressor_pool), ("sparse_attention", _fake_sparse_attention),
                       ("mla_decode", _fake_mla_decode)):
        torch.library.register_fake(f"ascend_dsv4::{name}", fake, lib=lib)
    _state["schemas"] = lib


def load_ascendc_ops() -> bool:
    """Load the NPU library of our kernels if it was built (and torch_npu imports); True when the ops are usable."""
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    path = library_path()
    ok = False
    if path is None:
        log.info("atb_ops.ascendc: %s not built (scripts/build_ascendc.sh); NPU ops use torch_npu paths", LIB_NAME)
    else:
        try:
            import torch_npu  # noqa: F401  (the library links against libtorch_npu)

            register_schemas()
            torch.ops.load_library(path)
            ok = True
            log.info("atb_ops.ascendc: loaded %s (compressor_pool, sparse_attention, mla_decode)", path)
        except (ImportError, OSError, RuntimeError) as e:
            log.warning("atb_ops.ascendc: cannot load %s: %s; NPU ops use torch_npu paths", path, e)
    _state["loaded"] = ok
    return ok


def npu_impls() -> dict[str, Callable]:
    """atb_ops-signature wrappers around ``torch.ops.ascend_dsv4.*`` (valid once :func:`load_ascendc_ops` is True)."""
    ops = torch.ops.ascend_dsv4

    def compressor_pool(kv_state, score_state, cand, overlap):
        return ops.compressor_pool(kv_state, score_state, cand, bool(overlap))

    def sparse_attention(q, kv, idx, sink, scale, extra_kv=None, extra_idx=None):
        return ops.sparse_attention(q, kv, idx, sink, float(scale), extra_kv, extra_idx)

    def mla_decode(q_nope_absorbed, q_pe, latent, idx, scale):
        return ops.mla_decode(q_nope_absorbed, q_pe, latent, idx, float(scale))

    return {"compressor_pool": compressor_pool, "sparse_attention": sparse_attention, "mla_decode": mla_decode}


def register_npu_kernels() -> bool:
    """Register our kernels as the ``npu`` implementations of their ops when the library loads (else no-op)."""
    if not load_ascendc_ops():
        return False
    from .._registry import register

    for name, fn in npu_impls().items():
        register(name, "npu")(fn)
    return True
