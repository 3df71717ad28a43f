"""Data-parallel attention + expert-parallel MoE on the ``ray`` executor across a real two-node Ray cluster on this
machine (CPU, gloo): DP 2 x TP 1 with the experts over both nodes gives the greedy outputs of one process (an idle
replica's dummy steps included); a killed rank actor ends the next call with an error naming the rank and its
node, and the executor stays down."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14] + [(3 * i + j) % 500 + 3 for j in range(9 + 5 * i)] for i in range(2)]


@pytest.mark.parametrize("graphs", [False, "static"])
def test_dp2_ep_across_nodes_equals_one_process_and_killed_rank(ray_cluster, monkeypatch, kill_and_wait, graphs):
    """(graphs="static": every rank with the static-buffer graph decoder, as on CUDA: decode steps replay on both
    replicas, executor_dp.GraphVote; the idle replica's on padding rows; with async scheduling, the steps launched
    on the actors ahead of the front end's collecting)"""
    import ray

    from ascend_dsv4 import LLM, SamplingParams
    from ascend_dsv4.engine import executor_dp_ray
    from ascend_dsv4.engine.executor import ExecutorError

    if graphs:  # every rank builds the static-buffer graph decoder, as LLM asks on CUDA
        orig = executor_dp_ray.RayDPExecutor.__init__
        def init(self, spec, *a, **k):
            spec.cuda_graphs = graphs
            orig(self, spec, *a, **k)

        monkeypatch.setattr(executor_dp_ray.RayDPExecutor, "__init__", init)

    c, _, _ = ray_cluster
    monkeypatch.setenv("RAY_ADDRESS", c.address)
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "120")
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    kw = dict(max_model_len=128, max_num_batched_tokens=16, enable_prefix_caching=True)
    one = LLM("toy-v4", **kw)
    want = [o.token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False)]
    alone = [o.token_ids for o in one.generate([[300 + j for j in range(20)]], greedy, use_tqdm=False)]
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="ray",
              async_scheduling=bool(graphs), **kw)
    try:
        assert len({s.node_id for s in llm.executor.ray.slots}) == 2  # one rank (= one replica) per node
        assert sorted(i["replica"] for i in llm.executor.ready_info) == [0, 1]
        ops: dict = {}
        call = llm.executor.call
        llm.executor.call = lambda d, op, args: ops.__setitem__(op, ops.get(op, 0) + 1) or call(d, op, args)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want
        assert (ops.get("graph", 0) + ops.get("launch", 0) > 0) == bool(graphs), ops  # replayed on the actors
        assert (ops.get("launch", 0) > 0) == bool(graphs), ops  # async: launched, then collected
        assert all(e.stats.prompt_tokens > 0 for e in llm.engine.engines)
        assert [o.token_ids for o in llm.generate([[300 + j for j in range(20)]], greedy, use_tqdm=False)] == alone
        assert (llm.engine.vote is not None) == bool(graphs)
        if graphs:
            assert all(e.runner.graphs is not None for e in llm.engine.engines)
        kill_and_wait(llm.executor.ray.workers[1])
        with pytest.raises(ExecutorError, match=r"rank 1 \(replica 1, node [0-9.]+\) (died|failed)"):
            llm.generate(PROMPTS, greedy, use_tqdm=False)
        with pytest.raises(ExecutorError, match="the ray executor is down"):
            llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
