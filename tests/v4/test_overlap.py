"""Side-stream overlap (ascend_dsv4/layers/overlap.py): the MoE router beside the shared expert, V4's compressed
entries (compressor, indexer) beside the query. In order on the CPU; on a GPU bitwise the same logits as without
overlap, eager and graph-captured."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4.layers import overlap


def test_cpu_runs_in_order_and_the_setting_is_checked(monkeypatch):
    x = torch.zeros(2)
    order = []
    a, b = overlap.run_beside(lambda: order.append("side") or 1, lambda: order.append("main") or 2, x)
    assert (a, b) == (1, 2) and order == ["side", "main"] and overlap.fork(x) is None
    assert overlap.run_beside(lambda: 3, None, x) == (3, None)
    monkeypatch.setenv("ASCEND_DSV4_OVERLAP", "yes")
    with pytest.raises(ValueError, match="ASCEND_DSV4_OVERLAP='yes': expected auto, 0 or 1"):
        overlap.enabled(torch.device("cuda"))
    monkeypatch.setenv("ASCEND_DSV4_OVERLAP", "auto")
    assert overlap.enabled(torch.device("cuda")) and not overlap.enabled(torch.device("xpu"))  # an NPU: opt-in
    monkeypatch.setenv("ASCEND_DSV4_OVERLAP", "1")
    assert overlap.enabled(torch.device("xpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["toy-v4", "toy-v3"])
def test_overlap_changes_no_logit(monkeypatch, family):
    from ascend_dsv4 import LLM

    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("ASCEND_DSV4_OVERLAP", mode)
        llm = LLM(model=family, device="cuda", dtype="bfloat16", progress=False)
        calls = []
        real = overlap.fork
        monkeypatch.setattr(overlap, "fork", lambda x: calls.append(1) or real(x))
        out[mode] = llm.logits(ids, prefill_len=60)  # prefill eager, then decode steps (graph-captured)
        monkeypatch.setattr(overlap, "fork", real)
        assert calls  # MoE layers (and V4's compressed layers) forked: a side stream when mode is 1
        del llm
    assert torch.equal(out["0"], out["1"])
