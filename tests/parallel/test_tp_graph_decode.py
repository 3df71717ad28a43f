"""Graph decode under the ``mp`` executor: rank 0 allocates the pages, every rank replays the same bucket
(``replay_decode`` mirrored; the collectives inside the captured step meet). On the CPU the ranks run the
static-buffer path without capture (what CUDA captures); tests/parallel/test_nccl.py runs it captured on GPUs."""

from __future__ import annotations

import pytest

from ascend_dsv4 import LLM, SamplingParams
from ascend_dsv4.engine import executor_mp

pytestmark = pytest.mark.distributed

PROMPTS = [[(7 * i + 3 * j) % 900 + 5 for j in range(9 + 23 * i)] for i in range(3)]


def force_static_graphs(monkeypatch, executor_cls, mode="static") -> None:
    """Every rank ``executor_cls`` starts builds the static-buffer graph decoder (CPU: no capture), as LLM asks on
    CUDA (also used by tests/parallel/test_dp_graphs.py)."""
    orig = executor_cls.__init__

    def init(self, spec, *a, **k):
        spec.cuda_graphs = mode
        orig(self, spec, *a, **k)

    monkeypatch.setattr(executor_cls, "__init__", init)


@pytest.fixture
def static_graphs(monkeypatch):
    """Every rank of the mp executor builds the static-buffer decoder (CPU: no capture)."""
    monkeypatch.setenv("ASCEND_DSV4_MP_TIMEOUT", "60")
    force_static_graphs(monkeypatch, executor_mp.MPExecutor)


def _count_ahead(llm) -> list[int]:
    """Count the greedy steps rank 0 launches behind a step in flight (async scheduling's steady state)."""
    n = [0]
    orig = llm.runner.launch_greedy

    def launch(seqs, tokens=None, after=None, after_rows=None):
        p = orig(seqs, tokens, after, after_rows)
        n[0] += p is not None and after is not None
        return p

    llm.runner.launch_greedy = launch
    return n


@pytest.mark.parametrize("ep", ["", "alltoall", "allreduce"])
def test_tp2_graph_decode_equals_one_device(static_graphs, ep, monkeypatch):
    """TP 2, and TP 2 + EP (either configured form; graph steps take the static-shape form,
    layers/experts.py ep_static_rows, prefill the configured one), with async scheduling (replay_greedy mirrored)."""
    if ep:
        monkeypatch.setenv("ASCEND_DSV4_EP_COMM", ep)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 5, 20)]
    kw = dict(max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=True, max_num_seqs=4)
    want = [o.token_ids for o in LLM("toy-v4", **kw).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM("toy-v4", tensor_parallel_size=2, distributed_executor_backend="mp", async_scheduling=True,
              enable_expert_parallel=bool(ep), **kw)
    try:
        assert llm.runner.graphs is not None and llm.runner.mirrored
        ahead = _count_ahead(llm)
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert llm.runner.graphs.replays >= 15  # the decode steps ran from the (mirrored) graph buckets
        # async scheduling under TP: steps launched behind the one in flight, every rank feeding its own argmax
        assert llm.engine.overlap is not None and ahead[0] >= 10, ahead
    finally:
        llm.executor.shutdown()


def test_tp2_speculative_graph_steps_equal_one_device(static_graphs):
    """MTP speculation under TP 2 + EP on the graph path: verification steps (a row a token) and drafts
    (``replay_draft``, mirrored with the hidden states rank 0 holds) replay on every rank; greedy outputs equal one
    device without speculation."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 5, 20)]
    kw = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)
    want = [o.token_ids for o in LLM("toy-v4", **kw).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM("toy-v4", tensor_parallel_size=2, distributed_executor_backend="mp", enable_expert_parallel=True,
              num_speculative_tokens=1, **kw)
    try:
        assert llm.runner.graphs is not None and llm.runner.mirrored
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        keys = list(llm.runner.graphs.graphs)
        assert any(k[0] == "mtp" for k in keys) and any(k[0] != "mtp" and k[0] > 4 for k in keys), keys
    finally:
        llm.executor.shutdown()
