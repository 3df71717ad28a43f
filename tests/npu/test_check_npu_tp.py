"""The NPU backend under tensor parallelism through the ``mp`` executor (worker processes install the torch_npu
emulation themselves, atb_ops.npu.worker_emulation): ``check-npu --tensor-parallel-size 2`` passes with the
workers' contracts reported, and toy-v3 at TP 2 on npu gives the single-device reference logits (the row-parallel
linears as npu_mm_all_reduce_base)."""

import pytest

from ascend_dsv4.entrypoints.cli import main

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _bounded(monkeypatch, oracle):
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "120")


def test_check_npu_tensor_parallel_2(capsys):
    from atb_ops.npu import emulation

    assert main(["check-npu", "--model", "toy-v3", "--tensor-parallel-size", "2", "--prompt-len", "6",
                 "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel size 2" in out and "OK: no contract violation" in out
    workers = out.split("ranks 1..1 (worker processes)")[1]
    assert "npu_mm_all_reduce_base" in workers and "npu_fused_infer_attention_score" in workers
    assert not emulation.is_installed()


def test_toy_v3_tp2_on_npu_equals_reference(emu, tmp_path, monkeypatch):
    from ascend_dsv4 import LLM
    from atb_ops.npu.worker_emulation import ENV_DIR, ENV_PARENT, read_reports
    import os

    ids = [1, 5, 9, 100, 33, 7, 81, 14, 2, 3, 99, 100, 17]
    want = LLM(model="toy-v3", backend="reference", device="cpu", dtype="float32", progress=False).logits(
        ids, prefill_len=9)
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_PARENT, str(os.getpid()))
    llm = LLM(model="toy-v3", backend="npu", device="cpu", dtype="float32", progress=False, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        got = llm.logits(ids, prefill_len=9)
    finally:
        llm.shutdown()
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
    calls, bad = read_reports(str(tmp_path))
    assert not bad and calls.get("npu_mm_all_reduce_base", 0) > 0
