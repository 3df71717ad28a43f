"""msModelSlim checkpoints (the real tool's tiny DeepSeek-V3 fixtures: W8A8_DYNAMIC, static W8A8 with quant_bias,
mixed W8A8 / W4A8) on the integer path under TP 2 and TP 2 + EP (all-to-all and all-reduce) equal world size 1
(float32): quant_bias added on one rank, dynamic per-token scales of row-parallel inputs from the global max."""

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


def _worker(rank, world, init, result_dir, v4_folders):
    torch.set_num_threads(1)
    from ascend_dsv4.layers.experts import static_shape_moe
    from parallel.groups import destroy_parallel, init_parallel

    lines = []
    folders = [os.path.join(FIX, c) for c in CASES] + v4_folders
    # EP: the all-to-all dispatch / combine (the default, and the path data parallelism needs) everywhere, the
    # all-reduce fallback and the static-shape form of graph steps (layers/experts.py static_shape_moe, every step
    # here) on the real tool's fixtures
    layouts = ((False, "alltoall"), (True, "alltoall"), (True, "allreduce"), (True, "static"))
    modes = [(f, ep, comm) for f in folders for ep, comm in layouts if f.startswith(FIX) or comm == "alltoall"]
    for i, (folder, ep, comm) in enumerate(modes):
        case = os.path.basename(folder)
        os.environ["ASCEND_DSV4_EP_COMM"] = "alltoall" if comm == "static" else comm
        state = init_parallel(world, rank, init + f"_{i}", enable_expert_parallel=ep, timeout_s=120)
        try:
            with torch.inference_mode(), static_shape_moe(comm == "static"):
                got = _logits(folder, state)
                if rank == 0:
                    want = _logits(folder, None)
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    lines.append(f"{case} world={world} ep={ep} {comm if ep else ''} rel_err={err:.2e}")
                    # the real tool's fixtures: 1e-5. Our quantiser's V4 toys quantise activations statically
                    # (W8A8): a last-ulp difference of the all-reduce order can flip one rounding (measured:
                    # 4e-3 .. 6e-3 after the flip, depending on the calibration's thread count), so they get the
                    # loose int-path bound of tests/quant (3e-2); quant_bias added on every rank gives 7e-1
                    tol = 1e-5 if folder.startswith(FIX) else 3e-2
                    assert got.shape == want.shape and err <= tol, lines[-1]
        finally:
            destroy_parallel()
    if rank == 0:
        with open(os.path.join(result_dir, "msm.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def test_msmodelslim_tp2_and_ep(tmp_path):
    """The three real-tool V3 fixtures and DeepSeek-V4 toy checkpoints written by our msModelSlim-format quantiser
    (W8A8_DYNAMIC everywhere; static W8A8 linears with W8A8_DYNAMIC MoE)."""
    from ascend_dsv4.models import preset
    from ascend_dsv4.quantize import quantize_model
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint

    # 3 layers (hash-routed, CSA, HCA): quantised activations are discontinuous, so the last-ulp differences of
    # the all-reduce order flip a rounding somewhere in a deep enough stack (measured on the 7-layer toy: ~3e-7
    # per layer until one layer (the 4th under TP 2, the 7th under EP) jumps to ~4e-3, ~1e-2 at the end); a
    # shallow stack makes a flip rare, and the bound in _worker allows one
    src = str(tmp_path / "toy_v4_3l")
    write_checkpoint(preset("toy-v4").replace(n_layers=3, compress_ratios=(0, 4, 128, 0), n_hash_layers=1), src,
                     seed=5, progress=False)
    v4 = []
    for qtype in ("w8a8_dynamic", "w8a8"):
        out = str(tmp_path / f"toy_v4_{qtype}")
        quantize_model(src, qtype, out, calib_tokens=16, dtype="float32", log=None)
        v4.append(out)
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rdv", str(tmp_path), v4), nprocs=2, join=True)
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
