"""msModelSlim checkpoints on the NPU backend under tensor / expert parallelism (world 2 through the ``hccl`` test
backend, every rank on the torch_npu emulation with its calls replayed on the wheel's contracts): the rank's
share of each int-path linear in its NPU form where that gives the single-device integers (whole and
column-split linears; static W8A8 row splits), the EP rank's routed experts as one
``npu_grouped_matmul`` per projection (``msm_npu.NpuQuantExperts`` behind ``ParallelQuantExperts``, all-to-all
dispatch). Logits equal the world-size-1 reference backend on the real tool's DeepSeek-V3 fixtures (float32,
1e-5 of max |logit|, the msModelSlim tests' tight bound)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(os.path.dirname(HERE), "fixtures", "msmodelslim")
CASES = ["dsv3_w8a8_dynamic_v0", "dsv3_w8a8_static_v0"]
IDS = [[(11 * i + 5) % 120 + 3 for i in range(12)], [(7 * i + 1) % 120 + 3 for i in range(9)]]


def _logits(folder, parallel, backend):
    from ascend_dsv4.engine.model_runner import ModelRunner
    from ascend_dsv4.kv.blocks import PoolSizes
    from ascend_dsv4.models import build_model, load_config
    from ascend_dsv4.weights.msmodelslim_loader import load_msmodelslim

    with torch.device("meta"):
        m = build_model(load_config(folder), torch.float32, parallel=parallel)
    load_msmodelslim(m, folder, "int", allow_float_mtp=True, npu=backend == "npu")
    r = ModelRunner(m.eval(), PoolSizes(16, 16, 2, 16, 16, 4), "cpu", backend=backend)
    seqs = [r.new_sequence() for _ in IDS]
    out = [r.step(seqs, IDS, logits="all"), r.step(seqs, [[4], [5]], logits="all")]
    return torch.cat(out), m


def _worker(rank: int, world: int, init: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parallel"))
    import hccl_test_backend

    from atb_ops.npu import emulation
    from atb_ops.npu.contracts import ContractChecker
    from atb_ops.npu.wheel_oracle import load_oracle
    from ascend_dsv4.weights.msm_npu import NpuQuantExperts, NpuQuantLinear
    from ascend_dsv4.weights.msmodelslim_tp import ParallelQuantExperts, ParallelQuantLinearAdapter
    from parallel.groups import destroy_parallel, init_parallel

    hccl_test_backend.register()
    oracle = load_oracle()
    lines = []
    for i, (case, ep) in enumerate((c, ep) for c in CASES for ep in (False, True)):
        folder = os.path.join(FIX, case)
        os.environ["ASCEND_DSV4_EP_COMM"] = "alltoall"
        state = init_parallel(world, rank, init + f"_{i}", backend="hccl", enable_expert_parallel=ep)
        checker = ContractChecker(oracle).attach(emulation.install())  # after the groups: HCCL options
        try:
            with torch.inference_mode():
                got, m = _logits(folder, state, "npu")
            kinds = {(a.kind, type(a.ql).__name__) for a in m.modules() if isinstance(a, ParallelQuantLinearAdapter)}
            # column splits always in the NPU form, row splits unless the activations are quantised per token
            dynamic = "dynamic" in case
            assert ("column", NpuQuantLinear.__name__) in kinds, kinds
            assert (("row", NpuQuantLinear.__name__) in kinds) != dynamic, kinds
            experts = [x for x in m.modules() if isinstance(x, ParallelQuantExperts)]
            assert experts
            if ep:  # whole experts on this rank (W8A8_DYNAMIC in both fixtures): one grouped matmul per projection
                assert all(x.ep_comm == "alltoall" for x in experts)
                assert all(isinstance(x.local, NpuQuantExperts) for x in experts)
                assert checker.ops["npu_grouped_matmul"].calls > 0
            assert checker.ops["npu_quant_matmul"].calls > 0
            assert not checker.violations, checker.violations
        finally:
            checker.detach()
            emulation.uninstall()
        try:
            if rank == 0:
                with torch.inference_mode():
                    want, _ = _logits(folder, None, "reference")
                err = ((got - want).abs().max() / want.abs().max()).item()
                lines.append(f"{case} world={world} ep={ep} npu rel_err={err:.2e}")
                assert got.shape == want.shape and err <= 1e-5, lines[-1]
        finally:
            destroy_parallel()
    if rank == 0:
        with open(os.path.join(result_dir, "npu_msm.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def test_msmodelslim_npu_tp2_and_ep(tmp_path, oracle):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rdv", str(tmp_path)), nprocs=2, join=True)
    print((tmp_path / "npu_msm.txt").read_text())
