"""msModelSlim checkpoints (the real tool's tiny DeepSeek-V3 fixtures: W8A8_DYNAMIC, static W8A8 with quant_bias,
mixed W8A8 / W4A8) on the integer path under TP 2 and TP 2 + EP equal world size 1 (float32): quant_bias added
on one rank, dynamic per-token scales of row-parallel inputs from the global max."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "msmodelslim")
CASES = ["dsv3_w8a8_dynamic_v0", "dsv3_w8a8_static_v0", "dsv3_mix_w8a8_w4a8_v1"]
IDS = [[(11 * i + 5) % 120 + 3 for i in range(12)], [(7 * i + 1) % 120 + 3 for i in range(9)]]


def _logits(folder, parallel):
    from ascend_dsv4.kv.blocks import PoolSizes
    from ascend_dsv4.engine.model_runner import ModelRunner
    from ascend_dsv4.models import build_model, load_config
    from ascend_dsv4.weights.msmodelslim_loader import load_msmodelslim

    with torch.device("meta"):
        m = build_model(load_config(folder), torch.float32, parallel=parallel)
    load_msmodelslim(m, folder, "int", allow_float_mtp=True)
    r = ModelRunner(m.eval(), PoolSizes(16, 16, 2, 16, 16, 4), "cpu")
    seqs = [r.new_sequence() for _ in IDS]
    out = [r.step(seqs, IDS, logits="all")]
    out.append(r.step(seqs, [[4], [5]], logits="all"))
    return torch.cat(out)


def _worker(rank, world, init, result_dir):
    torch.set_num_threads(1)
    from parallel.groups import destroy_parallel, init_parallel

    lines = []
    for i, (case, ep) in enumerate((c, ep) for c in CASES for ep in (False, True)):
        state = init_parallel(world, rank, init + f"_{i}", enable_expert_parallel=ep, timeout_s=120)
        try:
            with torch.inference_mode():
                got = _logits(os.path.join(FIX, case), state)
                if rank == 0:
                    want = _logits(os.path.join(FIX, case), None)
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    lines.append(f"{case} world={world} ep={ep} rel_err={err:.2e}")
                    assert got.shape == want.shape and err <= 1e-5, lines[-1]
        finally:
            destroy_parallel()
    if rank == 0:
        with open(os.path.join(result_dir, "msm.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def test_msmodelslim_tp2_and_ep(tmp_path):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rdv", str(tmp_path)), nprocs=2, join=True)
    print((tmp_path / "msm.txt").read_text())


def test_msmodelslim_llm_tp2_greedy_equals_one_device(monkeypatch):
    from ascend_dsv4 import LLM, SamplingParams

    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "60")
    folder = os.path.join(FIX, "dsv3_w8a8_static_v0")
    kw = dict(device="cpu", dtype="float32", allow_float_mtp=True, progress=False, max_model_len=64)
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    want = [o.token_ids for o in LLM(folder, **kw).generate(IDS, sp)]
    llm = LLM(folder, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        assert [o.token_ids for o in llm.generate(IDS, sp)] == want
    finally:
        llm.shutdown()
