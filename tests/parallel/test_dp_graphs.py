"""Graph decode steps under data-parallel attention + EP (``executor_dp.GraphVote``): every replica replays the graph
of one key in a step (an idle replica on padding rows) or every replica runs eagerly; the experts inside a graph take
the all-gather / reduce-scatter form (``layers/experts.py`` ``ep_static_gather``). On the CPU the ranks run the
static-buffer path without capture (what CUDA captures); tests/parallel/test_nccl.py captures it on GPUs."""

from __future__ import annotations

import threading

import pytest

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine import executor_dp
from ascend_dsv4.engine.executor import ExecutorError
from ascend_dsv4.engine.executor_dp import GraphVote
from test_tp_graph_decode import force_static_graphs

pytestmark = pytest.mark.distributed

PROMPTS = [[(5 * i + j) % 1000 + 3 for j in range(9 + 17 * i)] for i in range(3)]
KW = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)


@pytest.fixture
def static_graphs(monkeypatch):
    """Every DP rank builds the static-buffer decoder (CPU: no capture), as LLM asks on CUDA."""
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "60")
    force_static_graphs(monkeypatch, executor_dp.DPExecutor)


def _count_ops(llm) -> dict:
    seen: dict = {}
    orig = llm.executor.call

    def call(replica, op, args):
        seen[op] = seen.get(op, 0) + 1
        return orig(replica, op, args)

    llm.executor.call = call
    return seen


@pytest.mark.parametrize("spec", [0, 1])
def test_dp2_graph_steps_equal_one_device(static_graphs, spec):
    """DP 2 x TP 1 + EP, V4: greedy outputs equal one device; decode steps replay graphs on both replicas (with
    requests of different lengths one replica goes idle and replays on padding rows); prefill steps stay eager
    for both. With MTP speculation the verification steps replay too (their drafts run eagerly)."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 4, 9)]
    want = [o.token_ids for o in LLM("toy-v4", **KW).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=spec, **KW)
    try:
        assert all(e.runner.graphs is not None for e in llm.engine.engines) and llm.engine.vote is not None
        ops = _count_ops(llm)
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert ops.get("graph", 0) >= 6 and ops.get("graph_dummy", 0) >= 1, ops
        assert ops.get("execute", 0) >= 1, ops  # the prefill steps
        if spec:
            assert ops.get("draft", 0) > 0 and llm.engine.stats.mtp_proposed > 0
    finally:
        llm.shutdown()


def test_graph_vote_rules():
    """One key for all or eager for all: the largest bucket and the widest lists; any eager proposal wins; all idle
    is eager; a replica that fails before proposing releases the others with an error."""
    def run(props):
        vote = GraphVote(len(props), 5.0)
        out = [None] * len(props)
        ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, vote.agree(i, props[i])))
              for i in range(len(props))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    a, b = (8, (4, 16), (128, 16)), (16, (4, 48), (128, 16))
    assert run([a, b]) == [(16, (4, 48), (128, 16))] * 2
    assert run([a, GraphVote.IDLE]) == [a, a]
    assert run([a, None]) == [None, None]
    assert run([GraphVote.IDLE, GraphVote.IDLE]) == [None, None]
    vote = GraphVote(2, 5.0)
    errs = []

    def waiter():
        try:
            vote.agree(0, a)
        except ExecutorError as e:
            errs.append(str(e))

    t = threading.Thread(target=waiter)
    t.start()
    vote.abort()
    t.join(5)
    assert not t.is_alive() and errs and "another replica" in errs[0]
