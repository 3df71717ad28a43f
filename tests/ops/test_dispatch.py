"""Backend dispatch: device -> backend, overrides (context manager, env var), fallback with a one-time log."""

from __future__ import annotations

import logging

import pytest
import torch

import atb_ops
from atb_ops import _dispatch


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("ATB_OPS_BACKEND", raising=False)
    # fresh "already warned" memory so that log-once checks do not depend on test order
    monkeypatch.setattr(_dispatch, "_warned", set())


def _x():
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


def _fallback_records(caplog, op):
    return [r for r in caplog.records if r.name == "atb_ops" and op in r.getMessage() and "cuda" in r.getMessage()]


def test_cpu_resolves_to_reference():
    x = _x()
    assert atb_ops.selected_backend(x) == "reference"
    assert atb_ops.selected_backend(1.0, x) == "reference"  # first tensor argument decides
    assert _dispatch.resolve("rms_norm", x) is atb_ops.implementations("rms_norm")["reference"]


def test_implementations_list_reference_for_every_op():
    for op in atb_ops.OPS:
        impls = atb_ops.implementations(op)
        assert "reference" in impls and callable(impls["reference"]), op
    assert "reference" in atb_ops.implementations("rms_norm")


def test_use_backend_cuda_falls_back_to_reference_and_logs_once(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="atb_ops")
    atb_ops.implementations("rms_norm")  # load the backends first, then hide the cuda kernels
    monkeypatch.setitem(_dispatch._registry, "cuda", {})
    x = _x()
    w = torch.randn(8)
    expected = atb_ops.implementations("rms_norm")["reference"](x, w, 1e-6)
    with atb_ops.use_backend("cuda"):
        assert atb_ops.selected_backend(x) == "cuda"
        y1 = atb_ops.rms_norm(x, w, 1e-6)
        y2 = atb_ops.rms_norm(x, w, 1e-6)
    assert torch.equal(y1, expected) and torch.equal(y2, expected)
    assert len(_fallback_records(caplog, "rms_norm")) == 1
    # another op logs its own fallback, once
    with atb_ops.use_backend("cuda"):
        atb_ops.swiglu(x, x, 10.0)
        atb_ops.swiglu(x, x, 10.0)
    assert len(_fallback_records(caplog, "swiglu")) == 1
    assert len(_fallback_records(caplog, "rms_norm")) == 1
    # the override is gone after the block
    assert atb_ops.selected_backend(x) == "reference"


def test_cuda_backend_registers_kernels_when_triton_is_present():
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    assert "cuda" in atb_ops.implementations("rms_norm")
    assert "cuda" not in atb_ops.implementations("hadamard")  # no kernel: falls back (logged)


def test_use_backend_restores_on_exception():
    x = _x()
    with pytest.raises(RuntimeError):
        with atb_ops.use_backend("npu"):
            assert atb_ops.selected_backend(x) == "npu"
            raise RuntimeError("boom")
    assert atb_ops.selected_backend(x) == "reference"


def test_unknown_backend_raises():
    with pytest.raises(atb_ops.BackendError):
        with atb_ops.use_backend("tpu"):
            pass
    assert issubclass(atb_ops.BackendError, ValueError)


def test_env_var_selects_backend(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="atb_ops")
    x = _x()
    ref = atb_ops.hadamard(x)
    monkeypatch.setenv("ATB_OPS_BACKEND", "cuda")
    assert atb_ops.selected_backend(x) == "cuda"
    assert torch.equal(atb_ops.hadamard(x), ref)
    assert len(_fallback_records(caplog, "hadamard")) == 1
    # the context manager wins over the environment
    with atb_ops.use_backend("reference"):
        assert atb_ops.selected_backend(x) == "reference"
    monkeypatch.setenv("ATB_OPS_BACKEND", "reference")
    assert atb_ops.selected_backend(x) == "reference"


def test_env_var_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv("ATB_OPS_BACKEND", "tpu")
    with pytest.raises(atb_ops.BackendError, match="tpu"):
        atb_ops.rms_norm(_x(), None, 1e-6)


def test_empty_env_var_means_dispatch_by_device(monkeypatch):
    monkeypatch.setenv("ATB_OPS_BACKEND", "")
    assert atb_ops.selected_backend(_x()) == "reference"
