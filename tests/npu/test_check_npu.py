"""``ascend-dsv4 check-npu`` and ``ascend-dsv4 info --backend npu``."""

import pytest
import torch

from ascend_dsv4.entrypoints.cli import main


@pytest.fixture(autouse=True)
def _wheel(oracle):
    """check-npu needs the wheel's contracts (skipped with the reason when they cannot be downloaded)."""
    from atb_ops.npu import emulation

    assert not emulation.is_installed()
    yield
    assert not emulation.is_installed()  # the command leaves the process as it found it


@pytest.mark.parametrize("model", ["toy-v3", "toy-v4"])
def test_check_npu_passes(model, capsys):
    assert main(["check-npu", "--model", model, "--prompt-len", "6", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: no contract violation" in out and "no NPU used" in out
    assert "rms_norm" in out and "torch_npu.npu_rms_norm" in out and "ok" in out


def test_check_npu_fails_on_a_contract_violation(monkeypatch, capsys):
    from atb_ops.npu import emulation

    good = emulation.OPS["npu_swiglu"]
    monkeypatch.setitem(emulation.OPS, "npu_swiglu", lambda x, dim=-1: good(x, dim).to(torch.float64))
    assert main(["check-npu", "--model", "toy-v4", "--prompt-len", "4", "--decode-steps", "1",
                 "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "npu_swiglu: output 0" in out


def test_check_npu_fails_on_a_hot_path_fallback(monkeypatch, capsys):
    from atb_ops.npu import emulation

    monkeypatch.delitem(emulation.OPS, "npu_rms_norm")
    assert main(["check-npu", "--model", "toy-v3", "--prompt-len", "4", "--decode-steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "hot-path op rms_norm ran on the reference fallback" in out


def test_check_npu_rejects_a_bad_tensor_parallel_size(capsys):
    assert main(["check-npu", "--model", "toy-v4", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().out


def test_worker_reports_are_read_back(tmp_path):
    from atb_ops.npu.worker_emulation import read_reports

    (tmp_path / "rank-11.jsonl").write_text('{"op": "npu_rms_norm", "violation": null}\n'
                                            '{"op": "npu_swiglu", "violation": "npu_swiglu: bad"}\n')
    (tmp_path / "rank-12.jsonl").write_text('{"op": "npu_rms_norm", "violation": null}\n')
    assert read_reports(str(tmp_path)) == ({"npu_rms_norm": 2, "npu_swiglu": 1}, ["npu_swiglu: bad"])


def test_info_prints_the_npu_table(capsys):
    assert main(["info", "--model", "toy-v4", "--backend", "npu"]) == 0
    out = capsys.readouterr().out
    assert "NPU backend op table" in out and "grouped_matmul" in out


def test_npu_backend_without_torch_npu_falls_back_and_says_so(caplog):
    import logging

    import atb_ops
    from atb_ops._dispatch import _registry
    from atb_ops.npu import optable

    caplog.set_level(logging.WARNING, logger="atb_ops")
    optable.reset()
    x, w = torch.randn(3, 8), torch.randn(8)
    with atb_ops.use_backend("npu"):
        y = atb_ops.rms_norm(x, w, 1e-6)
    assert torch.equal(y, _registry["reference"]["rms_norm"](x, w, 1e-6))
    assert optable.table()["rms_norm"].kind == "reference"
    assert any("rms_norm on the npu backend falls back to the reference" in r.getMessage() for r in caplog.records)
    optable.reset()
