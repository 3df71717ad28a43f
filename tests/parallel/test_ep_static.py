"""The capture-safe form of expert parallelism (``layers/experts.py``: ``static_shape_moe``, ``ep_static_rows``):
every (token, expert) row with static shapes, other ranks' rows given id E (zero rows in ``grouped_matmul``).

One process: the EP rank's share is computed without communication (the 'allreduce' and 'static' forms return
partial sums before the all-reduce), so each rank of a 4-way split is built in turn and the partial sums are
added here. tests/parallel/test_tp_graph_decode.py runs the form end to end (TP 2 + EP, mp executor, gloo);
tests/parallel/test_nccl.py captured on GPUs."""

from __future__ import annotations

import pytest
import torch

from ascend_dsv4.layers.experts import Experts, ep_local_rows, ep_mode, ep_static_rows, reduce_moe, static_shape_moe
from parallel.groups import Group


def _experts(n_total: int, ep: Group | None, inter: int, dim: int, g: torch.Generator, dtype=torch.float32) -> Experts:
    n = n_total // (ep.size if ep else 1)
    m = Experts(n, inter, dim, 7.0, dtype, reference=False, ep=ep, n_total=n_total)
    full = {k: torch.randn(n_total, *shape, generator=g).to(dtype) / dim**0.5
            for k, shape in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter)))}
    lo = (ep.rank if ep else 0) * n
    m.set_weights("dense", {k: v[lo:lo + n].clone() for k, v in full.items()})
    return m


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("comm", ["allreduce", "alltoall"])
def test_static_form_sums_to_the_unsplit_experts(t, comm, monkeypatch):
    monkeypatch.setenv("ASCEND_DSV4_EP_COMM", comm)
    E, k, dim, inter, ep_size = 8, 3, 16, 12, 4
    x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t))
    gen = torch.Generator().manual_seed(100 + t)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    if t > 2:
        ids[1] = torch.tensor([0, 1, 2])  # a token whose experts all live on rank 0
    weights = torch.rand(t, k, generator=gen)
    whole = _experts(E, None, inter, dim, torch.Generator().manual_seed(7))(x, weights, ids)
    parts = []
    for r in range(ep_size):
        m = _experts(E, Group(r, ep_size), inter, dim, torch.Generator().manual_seed(7))
        assert ep_mode(m) == comm
        with static_shape_moe():
            assert ep_mode(m) == "static"
            parts.append(m(x, weights, ids))
        assert ep_mode(m) == comm  # the context restores the configured form
        if comm == "allreduce":
            eager = m(x, weights, ids)
            torch.testing.assert_close(parts[-1], eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-6)


def test_static_rows_of_a_rank_without_any_routed_row():
    """A rank that no token chose: every row has id E, the partial sum is exactly zero (and rows() still runs,
    on T * k rows, so that the shapes do not depend on the routing)."""
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(4, 8, generator=g), torch.tensor([[0, 1]] * 4), torch.rand(4, 2, generator=g)
    seen = []

    def rows(xs, e, rw, dtype):
        seen.append((xs.shape[0], e.tolist(), rw.tolist()))
        return torch.randn(xs.shape[0], 8, generator=g) * (e < 2).unsqueeze(-1)  # id E rows zero, as the GEMMs

    out = ep_static_rows(x, w, ids, 2, 2, rows)  # this rank holds experts 2 and 3
    assert out.dtype == torch.float32 and not out.any()
    assert seen == [(8, [2] * 8, [0.0] * 8)]
    assert not ep_local_rows(x, w, ids, 2, 2, rows).any()


def test_reduce_moe_all_reduces_the_static_partial_sums(monkeypatch):
    """Under the context the alltoall-configured experts return partial sums: reduce_moe must all-reduce them
    (over ``tp``, the EP ranks); outside, their complete rows are not reduced again."""
    monkeypatch.setenv("ASCEND_DSV4_EP_COMM", "alltoall")
    calls = []
    import ascend_dsv4.layers.experts as ex

    monkeypatch.setattr(ex, "all_reduce", lambda y, grp: calls.append(grp.size) or y * 2)
    m = _experts(8, Group(0, 2), 4, 8, torch.Generator().manual_seed(1))
    routed, shared = torch.ones(3, 8), torch.ones(3, 8)
    tp = Group(0, 2)
    with static_shape_moe():
        torch.testing.assert_close(reduce_moe(routed, shared, m, tp), torch.full((3, 8), 4.0))
    assert calls == [2]
    torch.testing.assert_close(reduce_moe(routed, shared, m, tp), torch.full((3, 8), 3.0))  # shared reduced only
    assert calls == [2, 2]


def test_data_parallel_split_takes_the_gather_form(monkeypatch):
    """Replicas of data-parallel attention hold different tokens: the static all-reduce form would mix them, so
    inside the context their experts take the all-gather / reduce-scatter form (complete rows, not reduced again);
    outside it the all-to-all."""
    monkeypatch.setenv("ASCEND_DSV4_EP_COMM", "alltoall")
    m = Experts(2, 4, 8, 7.0, torch.float32, reference=False, ep=Group(0, 4), n_total=8, split=Group(0, 2))
    with static_shape_moe():
        assert ep_mode(m) == "static_dp"
    assert ep_mode(m) == "alltoall"


def _dp_static_worker(rank: int, init: str, out_dir: str) -> None:
    """Rank ``rank`` of DP 2 x TP 2 (gloo): the two replicas hold different tokens (each padded to one bucket of T
    rows, as every replica's graph step); the all-gather / reduce-scatter form must give each replica the complete
    sums of the all-to-all form (and of the unsplit experts)."""
    import ascend_dsv4.layers.experts as ex
    from parallel.dp_groups import init_dp_parallel
    from parallel.groups import destroy_parallel

    torch.set_num_threads(1)
    state = init_dp_parallel(2, 2, rank, init_method=init, device="cpu")
    try:
        E, k, dim, inter, T = 8, 3, 16, 12, 5  # T = 5 does not split evenly over the replica's 2 ranks
        replica = rank // 2
        gen = torch.Generator().manual_seed(50 + replica)  # each replica's own tokens
        x = torch.randn(T, dim, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        weights = torch.rand(T, k, generator=gen)
        whole = _experts(E, None, inter, dim, torch.Generator().manual_seed(7))(x, weights, ids)
        m = _experts(E, state.ep, inter, dim, torch.Generator().manual_seed(7))
        m.split = state.tp  # as routed_experts sets it under data parallelism
        eager = m(x, weights, ids)  # the all-to-all form
        with static_shape_moe():
            assert ep_mode(m) == "static_dp" and ex.complete_rows("static_dp")
            static = m(x, weights, ids)
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static, whole, rtol=1e-5, atol=1e-6)
        torch.save(static, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_parallel()


@pytest.mark.distributed
def test_static_gather_form_under_data_parallelism(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dp_static_worker, args=(f"file://{tmp_path}/rdv", str(tmp_path)), nprocs=4, join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])  # a replica's ranks agree
    assert not torch.allclose(outs[0], outs[2])  # the replicas' tokens differ
