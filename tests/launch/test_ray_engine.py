"""The ``ray`` executor behind LLM and the server, on a real two-node Ray cluster on this machine (CPU, gloo):
TP 2 across the two nodes (and TP 2 + EP) gives the greedy outputs of one process; a killed rank actor ends the
request in flight with an error naming the rank, ``/health`` turns 503 with the recovery advice, the server
keeps answering; a layout the cluster cannot hold is refused at once with what is missing."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.distributed

PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14] + [(3 * i + j) % 500 + 3 for j in range(9 + 5 * i)] for i in range(2)]


def _greedy(llm):
    from ascend_dsv4 import SamplingParams

    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0))]


def test_tp2_across_nodes_equals_one_process(ray_cluster, monkeypatch):
    from ascend_dsv4 import LLM

    c, _, _ = ray_cluster
    monkeypatch.setenv("RAY_ADDRESS", c.address)
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "120")
    kw = dict(max_model_len=128, max_num_batched_tokens=16, enable_prefix_caching=True)
    want = _greedy(LLM("toy-v3", **kw))
    for ep in (False, True):
        llm = LLM("toy-v3", tensor_parallel_size=2, enable_expert_parallel=ep, distributed_executor_backend="ray",
                  **kw)
        try:
            assert len({s.node_id for s in llm.executor.ray.slots}) == 2  # one rank per node
            assert _greedy(llm) == want, f"ep={ep}"
        finally:
            llm.shutdown()


def test_killed_rank_503_and_placement_shortfall(ray_cluster, monkeypatch, kill_and_wait):
    import ray

    from ascend_dsv4 import LLM
    from ascend_dsv4.engine.async_engine import AsyncEngine
    from ascend_dsv4.engine.ray_placement import PlacementError
    from ascend_dsv4.entrypoints.server import ServerThread, create_app

    c, _, _ = ray_cluster
    monkeypatch.setenv("RAY_ADDRESS", c.address)
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "120")
    llm = LLM("toy-v4", tensor_parallel_size=2, distributed_executor_backend="ray", max_model_len=128)
    eng = AsyncEngine(llm.engine, max_queue=8, ops_context=llm._ops)
    server = ServerThread(create_app(eng, "toy-v4")).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            ok = http.post("/v1/completions", json={"model": "toy-v4", "prompt": [5, 6, 7], "max_tokens": 3})
            assert ok.status_code == 200 and http.get("/health").status_code == 200
            kill_and_wait(llm.executor.ray.workers[0])
            bad = http.post("/v1/completions", json={"model": "toy-v4", "prompt": [5, 6, 8], "max_tokens": 3})
            assert bad.status_code >= 500 and "rank 1" in bad.text, bad.text
            health = http.get("/health")
            assert health.status_code == 503 and "rank 1" in health.text and "restart it" in health.text
            assert http.get("/v1/models").status_code == 200  # the server process stays up
    finally:
        server.stop()
        eng.shutdown()
        llm.shutdown()
    with pytest.raises(PlacementError, match="asked 4 CPU, the cluster has 2 CPU"):
        LLM("toy-v3", tensor_parallel_size=4, distributed_executor_backend="ray")
