"""Parallel layers and MoE linears against their single-device versions, world 2 (through the ``hccl`` test
backend: the HCCL branch of parallel.groups) and world 4 (gloo). One spawned world per size; each rank runs
every check and a failing check raises in the rank, which fails the test with its traceback."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed


def _close(a, b, tol=1e-5, what=""):
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
    assert a.shape == b.shape and err <= tol * scale, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}, err {err}"


def _naive_moe(x, w, b, off):
    """Per-expert loop over the flattened rows (experts 0..E-1), exact in float64 / int64."""
    flat = x.reshape(-1, x.shape[-1])
    exact = x.dtype == torch.int8
    acc = torch.int64 if exact else torch.float64
    y = torch.zeros(flat.shape[0], w.shape[1], dtype=acc)
    for e in range(w.shape[0]):
        a, c = int(off[e]), int(off[e + 1])
        y[a:c] = flat[a:c].to(acc) @ w[e].to(acc).t()
        if b is not None:
            y[a:c] += b[e].to(acc)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _checks(rank: int, world: int, dev: str = "cpu") -> None:
    """Every layer on ``dev`` (cpu under gloo / the hccl test backend; cuda:rank under NCCL, tests/parallel/
    test_nccl.py) against the single-device math computed on the CPU."""
    from parallel import (ColumnParallelLinear, MoeColumnParallelLinear, MoeRowParallelLinear, ParallelLMHead,
                          RowParallelLinear, VocabParallelEmbedding, resolve_group)
    from parallel.comm import all_to_all, exchange_counts

    g = resolve_group(None)
    assert (g.rank, g.size) == (rank, world)
    gen = torch.Generator().manual_seed(0)  # same draws on every rank
    K, N, V, D = 8 * world, 6 * world, 10 * world, 12

    def rnd(*s, dtype=torch.float32):
        return torch.randn(*s, generator=gen).to(dtype)

    def on(t):  # the layer's input / parameters on the device under test
        return t.to(dev)

    sl = lambda n: slice(rank * n // world, (rank + 1) * n // world)  # noqa: E731
    x, W, b = rnd(3, 5, K), rnd(N, K), rnd(N)

    col = ColumnParallelLinear(K, N, torch.float32).to(dev)
    col.weight.copy_(W[sl(N)])
    _close(col(on(x)), (x @ W.t())[..., sl(N)], what="column")
    col.gather_output = True
    _close(col(on(x)), x @ W.t(), what="column gather")

    for inp_par in (False, True):
        row = RowParallelLinear(K, N, torch.float32, input_is_parallel=inp_par, bias=True).to(dev)
        row.weight.copy_(W[:, sl(K)])
        row.bias.copy_(b)
        _close(row(on(x[..., sl(K)] if inp_par else x)), x @ W.t() + b, what=f"row input_is_parallel={inp_par}")

    table = rnd(V, D)
    emb = VocabParallelEmbedding(V, D, torch.float32).to(dev)
    emb.weight.copy_(table[sl(V)])
    ids = torch.tensor([[0, V - 1, (V // world) % V, V // world - 1], [1, 2, 3, V // 2]])  # shard edges
    _close(emb(on(ids)), table[ids], 0, what="vocab embedding")
    _close(emb(on(ids[:0])), table[ids[:0]], 0, what="vocab embedding, no ids")

    head = ParallelLMHead(D, V, torch.float32, compute_fp32=True).to(dev)
    head.weight.copy_(table[sl(V)])
    h = rnd(4, D)
    _close(head(on(h)), h @ table.t(), what="lm head")

    # MoeRowParallelLinear: dtypes x bias x input_is_parallel, an empty expert, 3-d input, empty input
    E = 4
    counts = torch.tensor([3, 0, 5, 4])  # expert 1 gets no rows
    off = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.int8, 0)):
        for bias in (True, False):
            for inp_par in (False, True):
                if dtype == torch.int8:
                    xw = torch.randint(-128, 128, (3, 4, K), generator=gen, dtype=torch.int8)
                    ww = torch.randint(-128, 128, (E, N, K), generator=gen, dtype=torch.int8)
                    bw = torch.randint(-1000, 1000, (E, N), generator=gen, dtype=torch.int32) if bias else None
                else:
                    xw, ww = rnd(3, 4, K, dtype=dtype), rnd(E, N, K, dtype=dtype)
                    bw = rnd(E, N, dtype=dtype) if bias else None
                m = MoeRowParallelLinear(E, K, N, bias_term=bias, input_is_parallel=inp_par,
                                         params_dtype=dtype).to(dev)
                m.weight.copy_(ww[..., sl(K)])
                if bias:
                    m.bias.copy_(bw)
                y = m(on(xw[..., sl(K)] if inp_par else xw), on(off)).cpu()
                want = _naive_moe(xw, ww, bw, off)
                what = f"moe row {dtype} bias={bias} input_is_parallel={inp_par}"
                if dtype == torch.int8:
                    assert y.dtype == torch.int32 and torch.equal(y.long(), want), what
                else:
                    assert y.dtype == dtype, what
                    _close(y, want, tol, what)
    m = MoeRowParallelLinear(E, K, N, params_dtype=torch.float32).to(dev)
    y = m(on(torch.zeros(0, K)), on(torch.zeros(E + 1, dtype=torch.long)))
    assert y.shape == (0, N)

    for dtype in (torch.float32, torch.int8):
        if dtype == torch.int8:
            xw = torch.randint(-128, 128, (12, K), generator=gen, dtype=torch.int8)
            ww = torch.randint(-128, 128, (E, N, K), generator=gen, dtype=torch.int8)
            bw = torch.randint(-9, 9, (E, N), generator=gen, dtype=torch.int32)
        else:
            xw, ww, bw = rnd(12, K), rnd(E, N, K), rnd(E, N)
        m = MoeColumnParallelLinear(E, K, N, bias_term=True, params_dtype=dtype).to(dev)
        m.weight.copy_(ww[:, sl(N)])
        m.bias.copy_(bw[:, sl(N)])
        want = _naive_moe(xw, ww, bw, off)[..., sl(N)]
        y = m(on(xw), on(off)).cpu()
        if dtype == torch.int8:
            assert y.dtype == torch.int32 and torch.equal(y.long(), want), "moe column int8"
        else:
            _close(y, want, what="moe column fp32")

    # all-to-all: rank r sends (r + 1) rows to every rank, rows carry (source, dest)
    send = [rank + 1] * world
    rows = on(torch.tensor([[rank, d] for d in range(world) for _ in range(rank + 1)], dtype=torch.float32))
    recv_counts = exchange_counts(on(torch.tensor(send)), g).tolist()
    assert recv_counts == [s + 1 for s in range(world)]
    got = all_to_all(rows, send, recv_counts, g)
    want = torch.tensor([[s, rank] for s in range(world) for _ in range(s + 1)], dtype=torch.float32)
    assert torch.equal(got.cpu(), want), "all_to_all"

    # KV pool sizes sized per rank from its own device memory: every rank takes the smallest page counts
    from ascend_dsv4.engine.memory_sizing import agree_on_sizes
    from ascend_dsv4.kv.blocks import PoolSizes

    mine = PoolSizes(16, 16, 2, 100 - rank, 50 + rank, 7 + 3 * ((rank + 1) % world))
    assert agree_on_sizes(mine, torch.device(dev)) == PoolSizes(16, 16, 2, 101 - world, 50, 7)


def _worker(rank: int, world: int, init: str, backend: str) -> None:
    torch.set_num_threads(1)
    from parallel.groups import destroy_parallel, init_parallel

    if backend == "hccl":
        import hccl_test_backend

        hccl_test_backend.register()
        os.environ["HCCL_BUFFSIZE"], os.environ["HCCL_CONNECT_TIMEOUT"] = "512", "77"
    state = init_parallel(world, rank, init, backend=backend, enable_expert_parallel=True)
    try:
        assert state.backend == backend and state.tp.size == world and state.ep.size == world
        if backend == "hccl":
            created = hccl_test_backend.CREATED
            assert len(created) == 3, created  # world, tp, ep
            assert all(c["hccl_config"] == {"hccl_buffer_size": 512} for c in created), created
            assert all(c["timeout_s"] == 77 for c in created), created
        _checks(rank, world)
    finally:
        destroy_parallel()


@pytest.mark.parametrize("world,backend", [(2, "hccl"), (4, "gloo")])
def test_parallel_layers(tmp_path, world, backend):
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/rdv", backend), nprocs=world, join=True)


def test_backend_by_device_and_errors():
    from parallel.groups import ParallelError, backend_for_device, resolve_group

    assert [backend_for_device(d) for d in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    assert backend_for_device("cuda:1", "gloo") == "gloo"
    with pytest.raises(ParallelError, match="meta"):
        backend_for_device("meta")
    g = resolve_group(None)  # not initialised: world size 1
    assert (g.rank, g.size) == (0, 1)
