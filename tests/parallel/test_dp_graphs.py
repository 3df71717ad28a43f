"""Graph decode steps under data-parallel attention + EP (``executor_dp.GraphVote``): every replica replays the graph
of one key in a step (an idle replica on padding rows) or every replica runs eagerly; the experts inside a graph take
the all-gather / reduce-scatter form (``layers/experts.py`` ``ep_static_gather``). On the CPU the ranks run the
static-buffer path without capture (what CUDA captures); tests/parallel/test_nccl.py captures it on GPUs."""

from __future__ import annotations

import threading

import pytest

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine import executor_dp, spec_decode
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
def test_dp2_graph_steps_equal_one_device(static_graphs, spec, monkeypatch):
    """DP 2 x TP 1 + EP, V4: greedy outputs equal one device; decode steps replay graphs on both replicas (with
    requests of different lengths one replica goes idle and replays on padding rows); prefill steps stay eager
    for both. With MTP speculation the verification steps replay too, and so do the MTP drafts of graph steps (an
    idle replica's on padding rows); the drafts of prefill steps stay eager."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 4, 9)]
    drafts: dict = {}  # run -> {(prompt, outputs so far): the MTP draft}
    real = spec_decode.MTPDrafter.catch_up

    def spy(self, items, streams):
        res = real(self, items, streams)
        for (r, *_), x in zip(items, res):
            if x is not None and r.output_ids:
                drafts.setdefault(run[0], {})[(tuple(r.prompt_ids), len(r.output_ids))] = x[0]
        return res

    monkeypatch.setattr(spec_decode.MTPDrafter, "catch_up", spy)
    run = ["one"]
    want = [o.token_ids for o in LLM("toy-v4", num_speculative_tokens=spec, **KW).generate(PROMPTS, params,
                                                                                             use_tqdm=False)]
    run[0] = "dp"
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=spec, **KW)
    try:
        assert all(e.runner.graphs is not None for e in llm.engine.engines) and llm.engine.vote is not None
        ops = _count_ops(llm)
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert ops.get("graph", 0) >= 6 and ops.get("graph_dummy", 0) >= 1, ops
        assert ops.get("execute", 0) >= 1, ops  # the prefill steps
        if spec:
            assert ops.get("draft", 0) > 0 and llm.engine.stats.mtp_proposed > 0, ops
            assert ops.get("graph_draft", 0) >= 4 and ops.get("graph_draft_dummy", 0) >= 1, ops
            assert all(e.runner.draft_calls == e.runner.calls for e in llm.engine.engines)  # one of each per step
            common = drafts["one"].keys() & drafts["dp"].keys()  # the replayed drafts are one device's drafts
            assert len(common) >= 10 and all(drafts["one"][k] == drafts["dp"][k] for k in common)
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


def test_dp2_replica_failing_before_its_draft_releases_the_other(static_graphs, monkeypatch):
    """A replica whose step fails after its main forward and before its MTP forward releases the other replica,
    which waits in the MTP vote: the step raises that failure at once, not after the vote's timeout."""
    import time

    real, seen = spec_decode.MTPDrafter.catch_up, []

    def failing(self, items, streams):
        seen.append(self.runner.replica)
        if self.runner.replica == 0 and seen.count(0) == 4:  # a decode step of replica 0
            raise RuntimeError("drafter failed on purpose")
        return real(self, items, streams)

    monkeypatch.setattr(spec_decode.MTPDrafter, "catch_up", failing)
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=1, **KW)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="drafter failed on purpose"):
            llm.generate(PROMPTS, params, use_tqdm=False)
        assert time.monotonic() - t < 30  # the vote's timeout is 60 s here
    finally:
        llm.shutdown()


def test_dp2_async_scheduling_equals_sync(static_graphs, monkeypatch):
    """Async scheduling under DP 2 x TP 1 + EP: each replica's greedy decode steps are launched on its ranks
    (``launch``, input ids from the ranks' own argmax of the step before) before the front end collects the step
    in flight. Requests of different lengths (they finish while a step is in flight; one replica idles on padding
    rows while the other runs ahead), more requests than max_num_seqs (admission: sync steps between launches), a sampled request (its
    replica steps synchronously while the other launches: the vote a launch took carries over to the sync step or
    the dummy) and a prefix-cache hit: the tokens, texts and finish reasons of the synchronous DP engine."""
    prompts = PROMPTS + [[(7 * j) % 900 + 5 for j in range(11 + 5 * i)] for i in range(4)]
    prompts[4] = prompts[1][:20] + [7, 8, 9]  # shares a prefix with prompt 1
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 4, 9, 12, 7, 20, 3)]
    params[5] = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)

    def run(llm):
        return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]

    carried, agree = [0], executor_dp.ReplicaRunner._agree

    def spy(self, proposal):  # a step's forward that follows a launch which voted eager: no second vote
        carried[0] += self._decided is not None
        return agree(self, proposal)

    monkeypatch.setattr(executor_dp.ReplicaRunner, "_agree", spy)

    kw = dict(KW, enable_prefix_caching=True, max_num_seqs=2)
    sync = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        want = run(sync)
    finally:
        sync.shutdown()
    base = LLM("toy-v4", **kw).generate(prompts[:3], params[:3], use_tqdm=False)
    assert [w[0] for w in want[:3]] == [o.token_ids for o in base]
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True, **kw)
    try:
        assert all(e.overlap is not None for e in llm.engine.engines)
        ops = _count_ops(llm)
        assert run(llm) == want
        # a step launched ahead for requests that then finished stays in flight until that replica's next step
        assert ops.get("launch", 0) >= 10 and 0 <= ops["launch"] - ops.get("collect", 0) <= 2, ops
        assert ops.get("graph_dummy", 0) >= 1 and ops.get("execute", 0) >= 2 and carried[0] >= 1, ops
        assert run(llm) == want  # again, from a warm prefix cache
    finally:
        llm.shutdown()


def test_launch_and_collect_on_a_rank_keep_bad_rows_in_full():
    """The rank side of async scheduling under DP (dp_worker's ``launch`` / ``collect``): rank 0 answers every row's
    argmax and the non-finite rows in full, for the step it launched under that step number; other ranks None."""
    import torch

    from ascend_dsv4.engine.dp_worker import DPRankState, apply_dp_call

    logits = torch.randn(3, 50)
    logits[1, 4] = float("nan")

    from ascend_dsv4.engine.model_runner import ModelRunner

    class Runner:  # the rank's ModelRunner around a stub replay
        pools = None
        pending_step, collect = ModelRunner.pending_step, ModelRunner.collect

        def replay_greedy(self, seqs, tokens, key, src):
            self.got = (seqs, tokens, key, src)
            self._greedy_arg = torch.argmax(logits, -1)
            return torch.zeros(3, 2, 8), logits

    runner, state = Runner(), DPRankState()
    assert apply_dp_call("launch", ([], [[1], [2], [3]], (4,), None, 7), None, runner, "cpu", True, state) is None
    assert runner.got[2] == (4,) and 7 in state.launched and state.like.shape == (0, 2, 8)
    rows, kept, arg, bad = apply_dp_call("collect", 7, None, runner, "cpu", True, state)
    assert kept == bad == [1] and torch.isnan(rows[0, 4]) and arg[0] == int(torch.argmax(logits[0]))
    assert not state.launched and state.like.untyped_storage().nbytes() == 0  # not a view of the step's states
    other = DPRankState()
    assert apply_dp_call("launch", ([], [[1]] * 3, (4,), [0, 1, 2], 7), None, runner, "cpu", False, other) is None
    assert not other.launched and apply_dp_call("collect", 7, None, runner, "cpu", False, other) is None


def test_dp2_async_abort_in_flight_and_pages_returned(static_graphs):
    """Async scheduling under DP: a request aborted while its replica's step is in flight ends there, the others
    give the synchronous outputs, and every replica's pages come back (the front end's page tables) once the
    steps still in flight are dropped."""
    kw = dict(KW, max_num_seqs=2)
    p = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    sync = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        want = [o.token_ids for o in sync.generate(PROMPTS, p, use_tqdm=False)]
    finally:
        sync.shutdown()
    llm = LLM("toy-v4", data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True, **kw)
    try:
        e = llm.engine
        free0 = [x.runner.pools.token_alloc.num_free for x in e.engines]
        ids = [e.add_request(x, p) for x in PROMPTS]
        seen: dict = {i: [] for i in ids}
        steps = 0
        while e.has_unfinished():
            for o in e.step():
                seen[o.request_id] = o.token_ids
            steps += 1
            if steps == 6:
                owner = e.engines[e.owner[ids[1]]]
                assert owner.overlap.inflight is not None  # its replica runs ahead
                assert e.abort_request(ids[1])
        assert seen[ids[0]] == want[0] and seen[ids[2]] == want[2] and len(seen[ids[1]]) < 14
        e.step()  # every replica drops (collects) a step still in flight
        assert all(x.overlap.inflight is None for x in e.engines)
        assert [x.runner.pools.token_alloc.num_free for x in e.engines] == free0
    finally:
        llm.shutdown()
