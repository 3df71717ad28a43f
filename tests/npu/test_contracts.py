"""The contract checker replays torch_npu calls on the torch_npu wheel's own schemas and Meta kernels, and fails
calls the wheel would reject or whose emulated outputs disagree with the wheel's Meta outputs."""

import torch

from atb_ops.npu.contracts import ContractChecker


def test_oracle_has_the_backend_ops(oracle):
    from atb_ops.npu.emulation import OPS

    missing = [op for op in OPS if not oracle.has(op)]
    assert missing == []


def test_good_call_passes(emu, oracle):
    ck = ContractChecker(oracle).attach(emu)
    try:
        emu.npu_rms_norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8), epsilon=1e-6)
    finally:
        ck.detach()
    assert ck.ops["npu_rms_norm"].calls == 1 and ck.violations == []


def test_unknown_keyword_is_a_violation(emu, oracle):
    ck = ContractChecker(oracle)
    x = torch.randn(2, 4)
    msg = ck.check("npu_swiglu", (x,), {"axis": -1}, x[:, :2])  # the schema's keyword is `dim`
    assert msg is not None and "rejected" in msg


def test_wrong_output_dtype_is_a_violation(emu, oracle):
    ck = ContractChecker(oracle)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y, rstd = emu.npu_rms_norm(x, torch.ones(8))
    assert ck.check("npu_rms_norm", (x, torch.ones(8)), {}, (y, rstd)) is None
    msg = ck.check("npu_rms_norm", (x, torch.ones(8)), {}, (y.float(), rstd))
    assert msg is not None and "output 0" in msg


def test_meta_kernel_check_is_a_violation(emu, oracle):
    ck = ContractChecker(oracle)
    x = torch.randn(2, 3, 4)  # the wheel's Meta kernel requires a 2-D x
    msg = ck.check("npu_moe_gating_top_k", (x, 2), {}, None)
    assert msg is not None and "rejected" in msg


def test_detach_restores_the_module(emu, oracle):
    before = emu.npu_rms_norm
    ck = ContractChecker(oracle).attach(emu)
    assert emu.npu_rms_norm is not before
    ck.detach()
    assert emu.npu_rms_norm is before


def test_op_without_meta_kernel_is_checked_against_its_schema(emu, oracle):
    ck = ContractChecker(oracle)
    w = torch.randn(4, 4)
    assert ck.check("npu_format_cast", (w, 29), {}, w) is None  # no Meta kernel in the wheel: schema only
    assert ck.ops["npu_format_cast"].schema_only
    assert ck.check("npu_format_cast", (w,), {"format": 29}, w) is not None  # wrong keyword: the schema rejects
