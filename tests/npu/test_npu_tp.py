"""The NPU backend under tensor parallelism: world 2 through the ``hccl`` test backend (parallel.groups' HCCL
branch on gloo), every rank running its ops on the torch_npu emulation with its torch_npu calls replayed on the
wheel's contracts. Column / row-parallel linears (the row-parallel one as npu_mm_all_reduce_base) and the MoE
row / column-parallel linears (npu_grouped_matmul) against the unsplit math."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
HERE = os.path.dirname(os.path.abspath(__file__))


def _close(a, b, what):
    err = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    assert a.shape == b.shape and err <= 1e-5 * max(float(b.float().abs().max()), 1.0), (what, err)


def _worker(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parallel"))
    import hccl_test_backend

    import atb_ops
    from atb_ops.npu import emulation, optable
    from atb_ops.npu.contracts import ContractChecker
    from atb_ops.npu.wheel_oracle import load_oracle
    from parallel import ColumnParallelLinear, MoeColumnParallelLinear, MoeRowParallelLinear, RowParallelLinear
    from parallel.groups import destroy_parallel, init_parallel

    hccl_test_backend.register()
    state = init_parallel(world, rank, init, backend="hccl")
    checker = ContractChecker(load_oracle()).attach(emulation.install())
    try:
        assert state.backend == "hccl" and state.tp.size == world
        gen = torch.Generator().manual_seed(0)  # same draws on every rank
        K, N, E = 8 * world, 6 * world, 4
        sl = lambda n: slice(rank * n // world, (rank + 1) * n // world)  # noqa: E731
        x, W = torch.randn(5, K, generator=gen), torch.randn(N, K, generator=gen)
        ww = torch.randn(E, N, K, generator=gen)
        off = torch.tensor([0, 3, 3, 8, 12])
        xm = torch.randn(12, K, generator=gen)
        want_moe = torch.cat([xm[off[e]:off[e + 1]] @ ww[e].t() for e in range(E)])
        with atb_ops.use_backend("npu"):
            col = ColumnParallelLinear(K, N, torch.float32)
            col.weight.copy_(W[sl(N)])
            _close(col(x), (x @ W.t())[:, sl(N)], "column")
            row = RowParallelLinear(K, N, torch.float32)
            row.weight.copy_(W[:, sl(K)])
            _close(row(x[:, sl(K)]), x @ W.t(), "row")
            mr = MoeRowParallelLinear(E, K, N, input_is_parallel=True, params_dtype=torch.float32)
            mr.weight.copy_(ww[..., sl(K)])
            _close(mr(xm[:, sl(K)], off), want_moe, "moe row")
            mc = MoeColumnParallelLinear(E, K, N, params_dtype=torch.float32)
            mc.weight.copy_(ww[:, sl(N)])
            _close(mc(xm, off), want_moe[:, sl(N)], "moe column")
        tbl = optable.table()
        # the row-parallel linear ran as one npu_mm_all_reduce_base (matmul + all-reduce), not linear + reduce
        assert tbl["grouped_matmul"].calls == 2 and tbl["linear"].calls == 1, optable.format_table(tbl)
        assert checker.ops["npu_grouped_matmul"].calls == 2 and not checker.violations, checker.violations
        assert checker.ops["npu_mm_all_reduce_base"].checked == 1
    finally:
        checker.detach()
        emulation.uninstall()
        destroy_parallel()


def test_npu_backend_tensor_parallel_world2_hccl(tmp_path, oracle):
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/rdv"), nprocs=2, join=True)
