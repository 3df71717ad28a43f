"""The graph path of a decode step (static buffers -> context derived on the device -> model), run without capture on
the CPU, against the eager path: same logits, for a ragged batch through window and ratio boundaries, a shrinking
batch (padded rows, reused buckets) and steps that must stay eager (prefill, verification)."""

from __future__ import annotations

import torch

from ascend_dsv4.engine.cuda_graphs import CudaGraphDecoder
from ascend_dsv4.engine.model_runner import ModelRunner
from ascend_dsv4.models.deepseek_v4.model import DeepseekV4Model
from ascend_dsv4.weights.random_init import init_random_
from v4_helpers import SMALL_POOLS, rel_err, toy_cfg


def _runners(device: str = "cpu"):
    """(cfg, eager runner, graph runner) of one float32 toy model: on the CPU the graph runner's decoder runs the
    static-buffer path without capture; on CUDA it captures."""
    cfg = toy_cfg(index_topk=128)  # >= number of compressed entries: selection cannot differ by ties
    model = init_random_(DeepseekV4Model(cfg, torch.float32, "exact"), 0).eval().to(device)
    eager = ModelRunner(model, SMALL_POOLS, device)
    graph = ModelRunner(model, SMALL_POOLS, device, cuda_graphs=True, max_graph_batch=8)
    if graph.graphs is None:
        graph.graphs = CudaGraphDecoder(model, graph.pools, max_batch=8)
    return cfg, eager, graph


def test_graph_path_decode_equals_eager_decode(device: str = "cpu"):
    """(also run on CUDA, with capture, by tests/v4/test_cuda_graphs.py)"""
    cfg, eager, graph = _runners(device)
    g = torch.Generator().manual_seed(0)
    lens = [124, 30, 5, 250, 1, 62]  # decode crosses 128 / 256 (ratio-128 entries) and the window (32)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    se = [eager.new_sequence() for _ in lens]
    sg = [graph.new_sequence() for _ in lens]
    for a, b, p in zip(se, sg, prompts):  # prefill: eager, but for the one-token prompt (a decode step by shape)
        assert rel_err(graph.step([b], [p]), eager.step([a], [p])) < 1e-5
    assert graph.graphs.replays == 1
    live = list(range(len(lens)))
    steps = 1
    for i in range(40):
        if i in (15, 28):  # requests finish: the batch shrinks (fewer real rows in a bucket, then a smaller bucket)
            live = live[1::2] if i == 15 else live[:1]
        toks = [[int(x)] for x in torch.randint(0, cfg.vocab_size, (len(live),), generator=g)]
        want = eager.step([se[j] for j in live], toks)
        got = graph.step([sg[j] for j in live], toks)
        steps += 1
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, i
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert graph.last_prepare_s > 0
    assert graph.graphs.replays == steps
    assert {k[0] for k in graph.graphs.graphs} == {8, 4, 1}  # buckets of 6, 3 and 1 rows
    for a, b in zip(se, sg):
        assert a.num_tokens == b.num_tokens


def test_graph_path_execute_hidden_and_eager_fallbacks():
    cfg, eager, graph = _runners()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 127)]
    se, sg = [eager.new_sequence() for _ in prompts], [graph.new_sequence() for _ in prompts]
    eager.step(se, prompts)
    graph.step(sg, prompts)
    toks = [[3], [4]]
    # execute (the engine's call): logits and the hidden states of every row; sequences not advanced
    le, he = eager.execute(se, toks, [0, 1])
    lg, hg = graph.execute(sg, toks, [0, 1])
    assert graph.graphs.replays == 1 and sg[0].num_tokens == 40
    assert rel_err(lg, le) < 1e-5 and rel_err(hg.float(), he.float()) < 1e-5
    # a verification step (2 tokens for one row) and a step without every row's logits run eagerly
    graph.execute(sg, [[3, 5], [4]], [0, 1, 2])
    graph.execute(sg, toks, [1])
    assert graph.graphs.replays == 1
