"""DeepSeek-V4 and V3 under tensor / expert parallelism equal world size 1 (float32, 1e-5 relative): logits of a
prefill and two decode steps plus the MTP draft logits, every rank loading only its slices of an official FP8/FP4
V4 checkpoint, a V4 checkpoint in DeepSeek's HF names, one written by transformers' save_pretrained (fused
experts), an FP8 and a BF16 V3 checkpoint. World 2: TP 2, TP 2 + EP
(all-to-all and all-reduce); world 4: EP 4. One spawned world per size."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from ascend_dsv4.models import preset

pytestmark = pytest.mark.distributed

V4 = preset("toy-v4").replace(moe_inter_dim=512, o_groups=4, n_layers=4, compress_ratios=(0, 4, 128, 4, 0))
V3 = preset("toy-v3").replace(n_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, inter_dim=512,
                              moe_inter_dim=512)
PROMPT = [(7 * i + 3) % 1000 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from ascend_dsv4.weights.random_checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("tp_ckpts")
    out = {}
    def transformers_folder(d):  # transformers' save_pretrained: fused gate_up_proj / down_proj experts
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "v4"))
        from hf_oracle import random_hf_model

        random_hf_model(V4.replace(dtype="bf16", expert_dtype=None), seed=6).save_pretrained(d)

    for name, write in (("v4_official", lambda d: write_checkpoint(V4, d, "official", 1, progress=False)),
                        ("v4_transformers", transformers_folder),
                        ("v4_hf", lambda d: write_checkpoint(V4, d, "hf", 2, progress=False)),
                        ("v3_fp8", lambda d: write_checkpoint(V3, d, "hf", 3, progress=False)),
                        ("v3_bf16", lambda d: write_checkpoint(V3.replace(dtype="bf16"), d, "hf", 4, progress=False))):
        out[name] = str(root / name)
        write(out[name])
    return out


def _run(model, device="cpu"):
    """Logits of a 40-token prefill and 2 decode steps, and MTP logits over the prefill: float32 [*, vocab]
    (on the CPU)."""
    from ascend_dsv4.kv.blocks import PoolSizes
    from ascend_dsv4.engine.model_runner import ModelRunner

    runner = ModelRunner(model, PoolSizes(16, 16, 2, 64, 16, 4), device)
    seq = runner.new_sequence()
    out, streams, ctx, ids = runner.step([seq], [PROMPT], logits="all", return_streams=True)
    mtp = model.mtp_logits(streams, torch.tensor(PROMPT[1:] + [5], device=device), ctx, 0)
    rows = [out, mtp]
    for t in (11, 12):
        rows.append(runner.step([seq], [[t]], logits="all"))
    return torch.cat([r.float().cpu() for r in rows])


def _load(folder, parallel, device="cpu"):
    from ascend_dsv4.models import load_config
    from ascend_dsv4.models import build_model
    from ascend_dsv4.weights.loader import load_weights

    with torch.device("meta"):
        m = build_model(load_config(folder), torch.float32, parallel=parallel)
    plan = load_weights(m, folder, device, progress=False)
    return m.to(device).eval(), plan.bytes_read


def _worker(rank, world, init, cases, result_dir, device_type="cpu"):
    """Rank ``rank``: every case under the layout, against world size 1 on rank 0's device (``device_type``
    "cuda": rank r on cuda:r over NCCL, tests/parallel/test_nccl.py)."""
    torch.set_num_threads(1)
    from parallel.groups import destroy_parallel, init_parallel, set_rank_device

    dev = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)
    set_rank_device(dev)

    lines = []
    for i, (folder, ep, comm) in enumerate(cases):
        os.environ["ASCEND_DSV4_EP_COMM"] = comm
        state = init_parallel(world, rank, init + f"_{i}", device=device_type, enable_expert_parallel=ep, timeout_s=120)
        assert state.backend == {"cpu": "gloo", "cuda": "nccl"}[device_type], state.backend
        try:
            with torch.inference_mode():
                model, nbytes = _load(folder, state, dev)
                got = _run(model, dev)
                del model
                if rank == 0:
                    ref_model, full_bytes = _load(folder, None, dev)
                    want = _run(ref_model, dev)
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    lines.append(f"{os.path.basename(folder)} {state.backend} world={world} ep={ep} comm={comm} rel_err={err:.2e} "
                                 f"bytes_read={nbytes} of {full_bytes}")
                    assert got.shape == want.shape and err <= 1e-5, lines[-1]
                    assert world == 1 or nbytes < full_bytes * (0.75 if world == 2 else 0.5), lines[-1]
        finally:
            destroy_parallel()
    if rank == 0:
        with open(os.path.join(result_dir, f"{device_type}_world{world}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def test_tp2_and_tp2_ep(folders, tmp_path):
    cases = [(folders["v4_official"], False, "alltoall"), (folders["v4_official"], True, "alltoall"),
             (folders["v4_official"], True, "allreduce"), (folders["v4_hf"], False, "alltoall"),
             (folders["v4_transformers"], False, "alltoall"), (folders["v4_transformers"], True, "alltoall"),
             (folders["v3_fp8"], False, "alltoall"), (folders["v3_bf16"], True, "alltoall")]
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rdv", cases, str(tmp_path)), nprocs=2, join=True)
    print((tmp_path / "cpu_world2.txt").read_text())


def test_ep4(folders, tmp_path):
    cases = [(folders["v4_official"], True, "alltoall"), (folders["v3_fp8"], True, "alltoall")]
    mp.spawn(_worker, args=(4, f"file://{tmp_path}/rdv", cases, str(tmp_path)), nprocs=4, join=True)
    print((tmp_path / "cpu_world4.txt").read_text())
