"""parallel.npu_comm.matmul_all_reduce (torch_npu.npu_mm_all_reduce_base) at tensor-parallel world 2 through the
``hccl`` test backend under the torch_npu emulation, with the wheel's contracts: equals the unsplit
``x @ W^T + bias`` (the bias added once although the op adds it on every rank it is passed to)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parallel"))
    import hccl_test_backend

    from atb_ops.npu import emulation
    from atb_ops.npu.contracts import ContractChecker
    from atb_ops.npu.wheel_oracle import load_oracle
    from parallel.groups import destroy_parallel, init_parallel
    from parallel.npu_comm import fused_available, matmul_all_reduce

    hccl_test_backend.register()
    state = init_parallel(world, rank, init, backend="hccl")
    checker = ContractChecker(load_oracle()).attach(emulation.install())
    try:
        g = state.tp
        assert fused_available(g)
        gen = torch.Generator().manual_seed(0)  # same draws on every rank
        K, N = 8 * world, 12
        x, W, b = torch.randn(5, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
        sl = slice(rank * K // world, (rank + 1) * K // world)
        want = x @ W.t() + b
        got = matmul_all_reduce(x[:, sl], W[:, sl], g, bias=b)
        assert got.shape == want.shape and float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), \
            float((got - want).abs().max())
        got3 = matmul_all_reduce(x[:, sl].view(1, 5, -1), W[:, sl], g)  # 3-D x1, no bias
        assert torch.allclose(got3[0], x @ W.t(), atol=1e-5)
        assert not checker.violations, checker.violations
        assert checker.ops["npu_mm_all_reduce_base"].checked == 2
    finally:
        checker.detach()
        emulation.uninstall()
        destroy_parallel()


def test_matmul_all_reduce_world2(tmp_path):
    from atb_ops.npu import emulation
    from atb_ops.npu.wheel_oracle import OracleUnavailable, load_oracle

    if emulation.real_torch_npu_available():
        pytest.skip("the real torch_npu is installed: this test exercises the CPU emulation")
    try:
        load_oracle()
    except OracleUnavailable as e:
        pytest.skip(f"torch_npu wheel contracts unavailable: {e}")
    world = 2
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/rdzv"), nprocs=world, join=True)
