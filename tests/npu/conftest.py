"""Fixtures of the NPU-backend tests: the torch_npu CPU emulation and the torch_npu wheel's contracts."""

import pytest
import torch


@pytest.fixture(scope="module")
def emu():
    """The torch_npu emulation installed for one test module (removed afterwards)."""
    from atb_ops.npu import emulation

    if emulation.real_torch_npu_available():
        pytest.skip("the real torch_npu is installed: these tests exercise the CPU emulation")
    mod = emulation.install()
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield mod
    torch.set_num_threads(prev)
    emulation.uninstall()


@pytest.fixture(scope="session")
def oracle():
    """The torch_npu 2.13.0 wheel's schemas + Meta kernels (downloaded once into ~/.cache/ascend_dsv4)."""
    from atb_ops.npu.wheel_oracle import OracleUnavailable, load_oracle

    try:
        return load_oracle()
    except OracleUnavailable as e:
        pytest.skip(f"torch_npu wheel contracts unavailable: {e}")


@pytest.fixture
def checker(emu, oracle):
    """A ContractChecker attached to the emulated torch_npu for one test."""
    from atb_ops.npu.contracts import ContractChecker

    ck = ContractChecker(oracle).attach(emu)
    yield ck
    ck.detach()
